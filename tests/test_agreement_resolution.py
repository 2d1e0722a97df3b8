"""What follows a disagreement: who fails, who waits, what a joined rank replays."""

from ringtrain.collectives.agreement._resolution import resolve

ALLREDUCE = {"collective": "allreduce", "name": "g", "op": "Sum", "compression": "none"}
GATHER = {"collective": "allgather", "name": "g"}
BARRIER = {"collective": "barrier", "name": None}


def joined(rounds=0):
    return {"collective": "join", "name": None, "rounds": rounds}


def test_ranks_that_disagree_all_fail():
    outcome = resolve([ALLREDUCE, GATHER, ALLREDUCE])
    assert outcome.failing == (0, 1, 2) and outcome.again == () and outcome.replay is None
    assert not outcome.joined_error


def test_a_barrier_keeps_waiting_and_the_other_collective_fails():
    outcome = resolve([BARRIER, GATHER, GATHER])
    assert outcome.again == (0,) and outcome.failing == (1, 2)


def test_joined_ranks_replay_an_allreduce_and_the_others_exchange_again():
    outcome = resolve([joined(2), ALLREDUCE, joined(0), ALLREDUCE])
    assert outcome.joined == (0, 2) and outcome.again == (1, 3) and outcome.failing == ()
    assert outcome.replay == ALLREDUCE


def test_joined_ranks_enter_a_barrier():
    outcome = resolve([joined(), BARRIER])
    assert outcome.again == (1,) and outcome.replay == BARRIER


def test_other_collectives_fail_while_a_rank_is_joined():
    outcome = resolve([GATHER, joined(), GATHER])
    assert outcome.failing == (0, 2) and outcome.joined_error and outcome.replay is None


def test_an_allreduce_with_an_unknown_compressor_is_not_replayed():
    custom = dict(ALLREDUCE, compression="my-int8")
    outcome = resolve([custom, joined()])
    assert outcome.failing == (0,) and outcome.joined_error


def test_disagreeing_ranks_fail_and_joined_ranks_wait():
    outcome = resolve([joined(), ALLREDUCE, GATHER])
    assert outcome.failing == (1, 2) and outcome.replay is None and not outcome.joined_error


def test_every_rank_joined():
    outcome = resolve([joined(1), joined(0)])
    assert outcome.joined == (0, 1) and outcome.failing == () and outcome.replay is None
