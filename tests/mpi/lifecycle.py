"""init / shutdown / init cycles, init on a sub-communicator, and asynchronous ordering.

Every check leaves ringtrain initialized on all ranks, as it found it.

Run: mpiexec -n K python tests/mpi/lifecycle.py [--only SUBSTRING]
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from _harness import (WORLD, Digests, assert_equal_arrays, assert_reduced, check, expect_raises,
                      main, make_input, reduce_reference)


def world_sum_works(tag: str) -> None:
    k, me = rt.size(), rt.rank()
    y = rt.allreduce(np.full(4, me + 1, np.float64), rt.Sum, name="cycle")
    assert_equal_arrays(y, np.full(4, k * (k + 1) / 2), f"allreduce {tag}")
    z = rt.broadcast(np.full(3, me, np.int64), k - 1)
    assert_equal_arrays(z, np.full(3, k - 1, np.int64), f"broadcast {tag}")


@check
def init_is_idempotent():
    me, k = rt.rank(), rt.size()
    rt.init()
    rt.init(None)
    assert rt.is_initialized() and (rt.rank(), rt.size()) == (me, k)
    world_sum_works("after repeated init")


@check
def shutdown_then_init_again():
    k, me = rt.size(), rt.rank()
    for cycle in range(4):
        rt.shutdown()
        assert not rt.is_initialized()
        rt.shutdown()  # a second shutdown does nothing
        expect_raises(rt.NotInitializedError, rt.rank)
        expect_raises(rt.NotInitializedError, rt.size)
        expect_raises(rt.NotInitializedError, rt.local_rank)
        expect_raises(rt.NotInitializedError, rt.allreduce, np.ones(2), rt.Sum)
        expect_raises(rt.NotInitializedError, rt.allreduce_async, np.ones(2), rt.Sum)
        expect_raises(rt.NotInitializedError, rt.broadcast, np.ones(2), 0)
        expect_raises(rt.NotInitializedError, rt.barrier)
        error = expect_raises(RuntimeError, rt.allgather, np.ones(2))  # Horovod-style catch
        assert isinstance(error, rt.NotInitializedError)
        if cycle % 2:
            rt.init(MPI.COMM_WORLD)
        else:
            rt.init()
        assert rt.is_initialized() and (rt.rank(), rt.size()) == (me, k)
        world_sum_works(f"after re-init #{cycle}")
        h = rt.allreduce_async(np.full(2, me, np.float32), rt.Max)
        assert_equal_arrays(rt.synchronize(h), np.full(2, k - 1, np.float32), "async after init")


@check
def shutdown_finishes_queued_async_work():
    k, me = rt.size(), rt.rank()
    handles = [rt.allreduce_async(np.full(1000, me + i, np.float64), rt.Sum, name=f"q{i}")
               for i in range(5)]
    rt.shutdown()
    for i, h in enumerate(handles):
        assert rt.poll(h), f"handle {i} was not completed by shutdown()"
        assert_equal_arrays(rt.synchronize(h), np.full(1000, sum(r + i for r in range(k)),
                                                       np.float64), f"queued allreduce {i}")
    rt.init()
    world_sum_works("after shutdown with queued work")


@check
def process_set_survives_reinit():
    """A process set built before shutdown is rebuilt after init and works."""
    k, me = rt.size(), rt.rank()
    ps = rt.add_process_set([r for r in range(k) if r % 2 == 0])
    if ps.included():
        y = rt.allreduce(np.ones(3), rt.Sum, process_set=ps)
        assert_equal_arrays(y, np.full(3, float(ps.size())), "before shutdown")
    rt.shutdown()
    rt.init()
    if ps.included():
        for _ in range(2):
            y = rt.allreduce(np.full(3, float(me)), rt.Sum, process_set=ps)
            assert_equal_arrays(y, np.full(3, float(sum(ps.ranks))), "process set after re-init")
            rt.barrier(process_set=ps)
    rt.remove_process_set(ps)
    world_sum_works("after a process set across re-init")


@check(min_size=2)
def init_on_a_sub_communicator():
    """init(comm) with half the ranks: rank/size, collectives, and the same call (same
    name, shape, op) before and after must use the current world (Average divides by it)."""
    k, me = rt.size(), rt.rank()
    x = np.full(5, float(me))
    before = rt.allreduce(x, rt.Average, name="same-call")
    assert_equal_arrays(before, np.full(5, (k - 1) / 2), "Average over the world")
    before_ring = rt.allreduce(np.full(40_000, float(me), np.float32), rt.Average,
                               name="same-ring", algorithm="ring")
    assert_equal_arrays(before_ring, np.full(40_000, (k - 1) / 2, np.float32), "ring Average")
    rt.shutdown()
    half = WORLD.Split(color=me % 2, key=me)
    mates = [r for r in range(k) if r % 2 == me % 2]
    try:
        rt.init(half)
        assert rt.size() == len(mates) and rt.rank() == mates.index(me)
        assert rt.global_process_set.ranks == list(range(len(mates)))
        after = rt.allreduce(x, rt.Average, name="same-call")
        assert_equal_arrays(after, np.full(5, float(np.mean(mates))),
                            "the same Average call after init on half the ranks")
        after_ring = rt.allreduce(np.full(40_000, float(me), np.float32), rt.Average,
                                  name="same-ring", algorithm="ring")
        assert_equal_arrays(after_ring, np.full(40_000, np.mean(mates), np.float32),
                            "the same ring Average after init on half the ranks")
        y = rt.broadcast(np.full(2, me, np.int32), 0)  # root 0 of the half
        assert_equal_arrays(y, np.full(2, mates[0], np.int32), "broadcast in the half")
        assert rt.allgather_object(me) == mates
        expect_raises(rt.InvalidArgumentError, rt.broadcast, np.ones(2), len(mates), name="h")
        rt.shutdown()
    finally:
        if rt.is_initialized():
            rt.shutdown()
        half.Free()
        rt.init()
    again = rt.allreduce(x, rt.Average, name="same-call")
    assert_equal_arrays(again, np.full(5, (k - 1) / 2), "Average over the world again")


@check
def async_handles_synchronized_in_reverse_order():
    k, me = rt.size(), rt.rank()
    digests = Digests()
    handles = []
    for i in range(8):
        dtype = [np.float32, np.float64, np.int32, np.float16][i % 4]
        op = rt.Sum if np.dtype(dtype).kind == "i" else rt.Average
        shape = [(13,), (3, 4), (37 * k + 1,), ()][i % 4]
        x = make_input(me, shape, dtype, op, "rev", i)
        algorithm = ["ring", "recursive_doubling", "auto", "native"][i % 4]
        handles.append((i, dtype, op, shape, algorithm,
                        rt.allreduce_async(x, op, name=f"h{i}", algorithm=algorithm)))
    for i, dtype, op, shape, algorithm, h in reversed(handles):
        assert h.collective == "allreduce" and h.name == f"h{i}"
        y = rt.synchronize(h)
        expected = reduce_reference([make_input(r, shape, dtype, op, "rev", i) for r in range(k)],
                                    op)
        assert_reduced(y, expected, np.dtype(dtype), f"allreduce_async #{i} ({algorithm})")
        assert rt.synchronize(h) is y, "synchronize twice must give the same result"
        if algorithm != "native":
            digests.add(f"async {i}", y)
    digests.verify()


@check
def poll_becomes_true():
    k, me = rt.size(), rt.rank()
    x = np.full(1 << 18, float(me), np.float32)
    h = rt.allreduce_async(x, rt.Sum, name="poll", algorithm="ring")
    deadline = time.monotonic() + 30
    while not rt.poll(h):
        assert time.monotonic() < deadline, "poll() never became True"
        time.sleep(0.001)
    assert "done" in repr(h)
    assert_equal_arrays(rt.synchronize(h), np.full(1 << 18, k * (k - 1) / 2, np.float32),
                        "allreduce_async after poll")


@check
def async_then_blocking_keeps_program_order():
    """A blocking collective runs after every queued one: when it returns, they are done."""
    k, me = rt.size(), rt.rank()
    for round_ in range(3):
        a = np.full(50_000, float(me + round_), np.float32)
        handles = [
            rt.allreduce_async(a, rt.Sum, name="first"),
            rt.allreduce_async_(np.full(7, me, np.int64), rt.Max, name="second"),
            rt.broadcast_async(np.full(5, me, np.int8), k - 1, name="third"),
            rt.broadcast_async_(np.full(3, me, np.float64), 0, name="fourth"),
            rt.allgather_async(np.full((me, 2), me, np.int32), name="fifth"),
            rt.reducescatter_async(np.full((2 * k, 3), 1.0), rt.Sum, name="sixth"),
            rt.alltoall_async(np.arange(k, dtype=np.float32) + 10 * me, name="seventh"),
            rt.grouped_allreduce_async([np.ones(2), np.ones(3, np.int32)], rt.Sum, name="eighth"),
            rt.grouped_allreduce_async_([np.ones(4, np.float16)], rt.Sum, name="ninth"),
        ]
        if me == 0:
            time.sleep(0.02)  # one rank is late: the order must not depend on timing
        blocking = rt.allreduce(np.full(3, me, np.float64), rt.Sum, name="blocking")
        assert all(rt.poll(h) for h in handles), \
            f"a blocking call returned before queued ones: {[repr(h) for h in handles]}"
        assert_equal_arrays(blocking, np.full(3, k * (k - 1) / 2), "blocking allreduce")
        results = [rt.synchronize(h) for h in handles]
        assert_equal_arrays(results[0], np.full(50_000, sum(r + round_ for r in range(k)),
                                                np.float32), "first")
        assert_equal_arrays(results[1], np.full(7, k - 1, np.int64), "second")
        assert_equal_arrays(results[2], np.full(5, k - 1, np.int8), "third")
        assert_equal_arrays(results[3], np.full(3, 0.0), "fourth")
        assert_equal_arrays(results[4], np.concatenate([np.full((r, 2), r, np.int32)
                                                        for r in range(k)]), "fifth")
        assert_equal_arrays(results[5], np.full((2, 3), float(k)), "sixth")
        received, splits = results[6]
        assert_equal_arrays(received, np.array([me + 10 * r for r in range(k)], np.float32),
                            "seventh")
        assert_equal_arrays(splits, np.ones(k, np.int64), "seventh splits")
        assert_equal_arrays(results[7][0], np.full(2, float(k)), "eighth")
        assert_equal_arrays(results[7][1], np.full(3, k, np.int32), "eighth int32")
        assert_equal_arrays(results[8][0], np.full(4, k, np.float16), "ninth")
        rt.barrier()
        assert rt.broadcast_object(round_ * 10 + me, 0) == round_ * 10


@check
def many_small_async_calls():
    k, me = rt.size(), rt.rank()
    handles = [rt.allreduce_async(np.array([me, i], np.int64), rt.Sum) for i in range(200)]
    for i, h in enumerate(handles):
        assert_equal_arrays(rt.synchronize(h), np.array([k * (k - 1) // 2, k * i], np.int64),
                            f"small async #{i}")


if __name__ == "__main__":
    main()
