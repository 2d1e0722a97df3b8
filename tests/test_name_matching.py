"""The decision the ranks take when named calls reach them in different orders
(collectives/agreement/_name_matching.py): the same on every rank, from the same gathered data."""

from __future__ import annotations

from ringtrain.collectives.agreement._name_matching import WAIT, Order, choose, threads_hint


def orders(*waiting, threads=False, waited=0.0, limit=30.0):
    return [Order(tuple(names), threads, waited, limit) for names in waiting]


def test_a_name_every_rank_made_or_has_waiting_runs_first():
    assert choose(["a", "b"], orders(["b"], ["a"])) == "a"
    assert choose(["b", "a"], orders(["a"], ["b"])) == "b"
    assert choose(["a", "a", "b"], orders([], [], ["a"])) == "a"


def test_a_name_waiting_everywhere_runs_when_no_current_one_is_common():
    assert choose(["a", "b", "c"], orders(["z"], ["z"], ["z", "a"])) == "z"


def test_unnamed_calls_are_never_chosen():
    assert choose([None, "b"], orders(["b"], [])) == "b"
    assert choose([None, None], orders([], [])) is None


def test_the_same_name_everywhere_is_a_real_mismatch():
    assert choose(["a", "a"], orders(["b"], ["b"], threads=True)) is None


def test_with_threads_the_ranks_wait_for_a_call_on_its_way_until_the_limit():
    assert choose(["a", "b"], orders([], [], threads=True)) == WAIT
    assert choose(["a", "b"], orders([], [], threads=True, waited=31.0)) is None
    assert choose(["a", "b"], orders([], [], threads=False)) is None


def test_the_lowest_rank_limit_decides():
    mixed = [Order((), True, 5.0, 2.0), Order((), True, 5.0, 60.0)]
    assert choose(["a", "b"], mixed) is None
    mixed.reverse()
    assert choose(["a", "b"], mixed) == WAIT


def test_the_hint_names_the_threaded_ranks_and_what_to_do():
    gathered = [Order((), True, 1.0, 30.0), Order((), False, 1.0, 30.0)]
    hint = threads_hint((4, 6), ["a", "b"], gathered)
    assert "several threads on rank 4" in hint and "name=" in hint
    assert threads_hint((4, 6), ["a", "a"], gathered) is None
    assert threads_hint((4, 6), ["a", "b"], orders([], [])) is None
