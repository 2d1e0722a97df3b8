"""Process sets: collectives over subsets of the ranks, membership, validation, removal.

Run: mpiexec -n K python tests/mpi/process_sets.py [--only SUBSTRING]
"""

from __future__ import annotations

import numpy as np

import ringtrain as rt
from _harness import (WORLD, Digests, assert_equal_arrays, assert_reduced, check, expect_raises,
                      main, make_input, reduce_reference)


@check
def world_queries():
    k, me = rt.size(), rt.rank()
    assert rt.is_initialized()
    assert (me, k) == (WORLD.Get_rank(), WORLD.Get_size())
    # every rank runs on this one host
    assert (rt.local_rank(), rt.local_size()) == (me, k)
    assert (rt.cross_rank(), rt.cross_size()) == (0, 1)
    ps = rt.global_process_set
    assert ps.ranks == list(range(k)) and ps.size() == k and ps.rank() == me and ps.included()
    y = rt.allreduce(np.full(3, me, np.float64), rt.Sum, process_set=rt.global_process_set)
    assert_equal_arrays(y, np.full(3, k * (k - 1) / 2), "allreduce on global_process_set")
    assert rt.remove_process_set(rt.global_process_set) is False


def collectives_on(ps: rt.ProcessSet, tag: str) -> None:
    """Every collective on ``ps`` (this rank is a member), checked against numpy."""
    members = ps.ranks
    m, me = len(members), rt.rank()
    index = members.index(me)
    assert ps.rank() == index and ps.size() == m and ps.included()
    digests = Digests()
    for algorithm in ("ring", "recursive_doubling", "native", "auto"):
        for op, dtype in [(rt.Sum, np.float32), (rt.Average, np.float64), (rt.Max, np.int32),
                          (rt.Product, np.float16), (rt.Min, np.uint8), (rt.Sum, np.int8)]:
            for shape in [(13,), (3, 5), (2 * m + 1,), ()]:
                inputs = [make_input(r, shape, dtype, op, tag) for r in members]
                what = f"allreduce on {members} {algorithm} {op.name} {np.dtype(dtype)} {shape}"
                y = rt.allreduce(inputs[index], op, name="ps", process_set=ps,
                                 algorithm=algorithm)
                assert_reduced(y, reduce_reference(inputs, op), np.dtype(dtype), what)
                x = inputs[index].copy()
                rt.allreduce_(x, op, process_set=ps, algorithm=algorithm)
                assert_reduced(x, reduce_reference(inputs, op), np.dtype(dtype), what + " in place")
                if algorithm != "native":
                    digests.add(what, y)
        scaled = [make_input(r, (7,), np.float32, rt.Average, tag, "scaled") for r in members]
        y = rt.synchronize(rt.allreduce_async(scaled[index], rt.Average, process_set=ps,
                                              prescale_factor=0.5, postscale_factor=2.0,
                                              algorithm=algorithm))
        assert_reduced(y, reduce_reference(scaled, rt.Average, 0.5, 2.0), np.dtype(np.float32),
                       f"allreduce_async scaled on {members}")
        grouped = rt.grouped_allreduce([scaled[index], np.full(2, me, np.int64)], rt.Sum,
                                       process_set=ps, algorithm=algorithm)
        assert_reduced(grouped[0], reduce_reference(scaled, rt.Sum), np.dtype(np.float32),
                       "grouped on a process set")
        assert_equal_arrays(grouped[1], np.full(2, sum(members), np.int64), "grouped int64")
    for algorithm in ("binomial", "pipeline", "native", "auto"):
        for root in members:
            for shape, dtype in [((5, 3), np.float64), ((0,), np.int8),
                                 (((1 << 16) + 1,), np.uint8)]:
                expected = make_input(root, shape, dtype, None, tag, "bcast")
                y = rt.broadcast(make_input(me, shape, dtype, None, tag, "bcast"), root,
                                 process_set=ps, algorithm=algorithm)
                assert_equal_arrays(y, expected, f"broadcast on {members} from world rank "
                                                 f"{root} {algorithm}")
            x = np.full(4, me, np.int32)
            rt.broadcast_(x, root, process_set=ps, algorithm=algorithm)
            assert_equal_arrays(x, np.full(4, root, np.int32), "broadcast_ on a process set")
    for algorithm in ("ring", "native", "auto"):
        rows = [make_input(r, (r % 3, 2), np.float32, None, tag, "ag") for r in members]
        y = rt.allgather(rows[index], process_set=ps, algorithm=algorithm)
        assert_equal_arrays(y, np.concatenate(rows), f"allgather on {members} {algorithm}")
        for op, dtype in [(rt.Sum, np.float64), (rt.Average, np.float32), (rt.Max, np.int64)]:
            for n in (2 * m + 1, m - 1, 3 * m):
                inputs = [make_input(r, (n, 2), dtype, op, tag, "rs") for r in members]
                y = rt.reducescatter(inputs[index], op, process_set=ps, algorithm=algorithm)
                full = reduce_reference(inputs, op)
                assert_reduced(y, np.array_split(full, m)[index], np.dtype(dtype),
                               f"reducescatter on {members} {algorithm} {op.name} n={n}")
    for algorithm in ("pairwise", "native", "auto"):
        def splits_of(i):
            return [(i + 2 * j) % 3 for j in range(m)]
        inputs = [make_input(r, (sum(splits_of(i)), 3), np.int32, None,
                             tag, "a2a") for i, r in enumerate(members)]
        received, received_splits = rt.alltoall(inputs[index], splits_of(index),
                                                process_set=ps, algorithm=algorithm)
        blocks = []
        for i, x in enumerate(inputs):
            start = sum(splits_of(i)[:index])
            blocks.append(x[start:start + splits_of(i)[index]])
        assert_equal_arrays(received, np.concatenate(blocks), f"alltoall on {members}")
        assert_equal_arrays(received_splits,
                            np.array([splits_of(i)[index] for i in range(m)], np.int64),
                            "alltoall received_splits on a process set")
    for root in members:
        got = rt.broadcast_object({"from": me, "set": members}, root_rank=root, process_set=ps)
        assert got == {"from": root, "set": members}, got
    assert rt.allgather_object(("rank", me), process_set=ps) == [("rank", r) for r in members]
    rt.barrier(process_set=ps)
    members_comm = WORLD.Split(0, me)
    try:
        digests.verify(members_comm, members)
    finally:
        members_comm.Free()


def non_member_refused(ps: rt.ProcessSet) -> None:
    """Every collective on a set this rank is not in raises before communicating."""
    me = rt.rank()
    assert not ps.included()
    expect_raises(rt.InvalidArgumentError, ps.rank, match=[str(me)])
    x = np.ones(4, np.float32)
    root = ps.ranks[0]
    calls = [
        lambda: rt.allreduce(x, rt.Sum, name="nm", process_set=ps),
        lambda: rt.allreduce_(x, rt.Sum, name="nm", process_set=ps),
        lambda: rt.allreduce_async(x, rt.Sum, name="nm", process_set=ps),
        lambda: rt.grouped_allreduce([x], rt.Sum, name="nm", process_set=ps),
        lambda: rt.broadcast(x, root, name="nm", process_set=ps),
        lambda: rt.broadcast_async_(x, root, name="nm", process_set=ps),
        lambda: rt.allgather(x, name="nm", process_set=ps),
        lambda: rt.reducescatter(x, rt.Sum, name="nm", process_set=ps),
        lambda: rt.alltoall(x, name="nm", process_set=ps),
        lambda: rt.broadcast_object(1, root, name="nm", process_set=ps),
        lambda: rt.allgather_object(1, name="nm", process_set=ps),
        lambda: rt.barrier(process_set=ps),
    ]
    for call in calls:
        expect_raises(rt.InvalidArgumentError, call, match=[str(me)])


def use_set(ranks: list[int], tag: str) -> None:
    k, me = rt.size(), rt.rank()
    ps = rt.add_process_set(ranks)
    assert ps.ranks == sorted(ranks) and ps.size() == len(ranks)
    assert ps.included() == (me in ranks)
    if ps.included():
        collectives_on(ps, tag)
        # a member naming a root outside the set is refused before communicating
        outsiders = [r for r in range(k) if r not in ranks]
        if outsiders:
            expect_raises(rt.InvalidArgumentError, rt.broadcast, np.ones(2), outsiders[0],
                          name="root", process_set=ps, match=["'root'", str(outsiders[0])])
    else:
        WORLD.Split(1, me).Free()  # matches the members' split in collectives_on
        non_member_refused(ps)
    WORLD.Barrier()
    assert rt.remove_process_set(ps) == ps.included()
    # the world is unaffected
    y = rt.allreduce(np.ones(2, np.float32), rt.Sum)
    assert_equal_arrays(y, np.full(2, k, np.float32), "allreduce after a process set")


@check
def set_of_even_ranks():
    use_set([r for r in range(rt.size()) if r % 2 == 0], "even")


@check(min_size=2)
def set_without_rank_0():
    use_set(list(range(1, rt.size())), "not0")


@check(min_size=3)
def set_of_two_ranks_given_unsorted():
    k = rt.size()
    use_set([k - 1, 0], "pair")


@check
def set_of_all_ranks_listed_explicitly():
    use_set(list(range(rt.size())), "all")


@check(min_size=2)
def disjoint_sets_work_at_the_same_time():
    """Evens and odds reduce concurrently on their own communicators."""
    k, me = rt.size(), rt.rank()
    evens = rt.add_process_set([r for r in range(k) if r % 2 == 0])
    odds = rt.add_process_set([r for r in range(k) if r % 2 == 1])
    mine = evens if me % 2 == 0 else odds
    for i in range(20):
        y = rt.allreduce(np.full(3, me + i, np.int64), rt.Sum, process_set=mine)
        assert_equal_arrays(y, np.full(3, sum(r + i for r in mine.ranks), np.int64),
                            f"concurrent process sets, round {i}")
        z = rt.broadcast(np.full(2, me, np.int32), mine.ranks[-1], process_set=mine)
        assert_equal_arrays(z, np.full(2, mine.ranks[-1], np.int32), "concurrent broadcast")
    handles = [rt.allreduce_async(np.full(2, float(me)), rt.Max, process_set=mine)
               for _ in range(5)]
    for h in handles:
        assert_equal_arrays(rt.synchronize(h), np.full(2, float(max(mine.ranks))),
                            "async on concurrent process sets")
    rt.remove_process_set(evens)
    rt.remove_process_set(odds)
    assert_equal_arrays(rt.allreduce(np.ones(1), rt.Sum), np.full(1, float(k)), "world after")


@check
def singleton_sets():
    """Each rank alone in its own set: collectives return its own data."""
    me = rt.rank()
    ps = rt.ProcessSet([me])  # built lazily on first use, by its only member
    x = make_input(me, (5,), np.float32, rt.Average, "single")
    assert_equal_arrays(rt.allreduce(x, rt.Average, process_set=ps), x, "allreduce alone")
    assert_equal_arrays(rt.broadcast(x, me, process_set=ps), x, "broadcast alone")
    assert_equal_arrays(rt.allgather(x, process_set=ps), x, "allgather alone")
    assert_equal_arrays(rt.reducescatter(x, rt.Sum, process_set=ps), x, "reducescatter alone")
    received, splits = rt.alltoall(x, process_set=ps)
    assert_equal_arrays(received, x, "alltoall alone")
    assert_equal_arrays(splits, np.array([5], np.int64), "alltoall splits alone")
    assert rt.broadcast_object("me", me, process_set=ps) == "me"
    assert rt.allgather_object(me, process_set=ps) == [me]
    rt.barrier(process_set=ps)
    assert rt.remove_process_set(ps) is True


@check
def process_set_validation():
    k, me = rt.size(), rt.rank()
    expect_raises(rt.InvalidArgumentError, rt.ProcessSet, [])
    expect_raises(rt.InvalidArgumentError, rt.ProcessSet, [0, 0], match=["0"])
    outside = rt.ProcessSet([0, k])
    expect_raises(rt.InvalidArgumentError, rt.allreduce, np.ones(2), rt.Sum, name="range",
                  process_set=outside, match=[str(k)])
    lazy = rt.ProcessSet(range(k))
    assert lazy.ranks == list(range(k)) and lazy.size() == k and lazy.rank() == me
    assert rt.remove_process_set(lazy) is False  # never built: nothing to release
    assert repr(lazy).startswith("ProcessSet(")
    y = rt.allreduce(np.ones(2), rt.Sum)
    assert_equal_arrays(y, np.full(2, float(k)), "allreduce after refused process sets")


if __name__ == "__main__":
    main()
