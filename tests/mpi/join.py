"""ringtrain.collectives.join: joined ranks contribute zeros to allreduces and wait in barriers.

Every check lets each rank in turn join first; the ranks still working compare their
results with a numpy reference over the inputs of the ranks that have not joined.
"""

import numpy as np

import ringtrain as rt
import ringtrain.collectives as rtc
from _harness import (FLOAT_DTYPES, REDUCE_DTYPES, assert_reduced, check, expect_raises,
                      make_input, main, reduce_reference, same_on_all_ranks)

SHAPES = [(5,), (17, 3), (40_001,)]  # the last one is past the small-message path


def _expected(active: list[int], shape, dtype, op, key) -> np.ndarray:
    inputs = [make_input(r, shape, dtype, op, key) for r in active]
    total = reduce_reference(inputs, rt.Sum)
    if op is rt.Average:
        total = total / rt.size()  # an Average divides by every rank, joined ones included
    return total


@check
def alone_join_returns_own_rank():
    if rt.size() == 1:
        assert rtc.join() == 0


@check(min_size=2)
def joined_rank_contributes_zeros_to_allreduce():
    k, me = rt.size(), rt.rank()
    for first in range(k):
        active = [r for r in range(k) if r != first]
        if me == first:
            last = rtc.join()
        else:
            for dtype in REDUCE_DTYPES:
                for shape in SHAPES:
                    for op in (rt.Sum, rt.Average) if dtype.kind == "f" else (rt.Sum,):
                        key = ("join", first)
                        mine = make_input(me, shape, dtype, op, key)
                        got = rt.allreduce(mine, op, name=f"t{shape}")
                        assert_reduced(got, _expected(active, shape, dtype, op, key), dtype,
                                       f"{op} {dtype} {shape}, rank {first} joined")
            last = rtc.join()
        assert last == max(active), (last, active)
        same_on_all_ranks(last, "join's result")


@check(min_size=2)
def joined_rank_takes_part_in_grouped_async_and_compressed_allreduces():
    k, me = rt.size(), rt.rank()
    for first in range(k):
        active = [r for r in range(k) if r != first]
        key = ("grouped", first)
        if me == first:
            rtc.join()
            continue
        inputs = [make_input(me, (9, 2), np.float32, rt.Sum, key),
                  make_input(me, (4,), np.int32, rt.Sum, key)]
        grouped = rt.grouped_allreduce(inputs, rt.Sum, name="group")
        handle = rt.allreduce_async(make_input(me, (300,), np.float64, rt.Average, key),
                                    rt.Average, name="async")
        fp16 = rt.allreduce(make_input(me, (70_000,), np.float32, rt.Sum, key), rt.Sum,
                            name="fp16", compression=rt.Compression.fp16)
        assert_reduced(grouped[0], _expected(active, (9, 2), np.float32, rt.Sum, key),
                       np.float32, "grouped float32")
        assert_reduced(grouped[1], _expected(active, (4,), np.int32, rt.Sum, key),
                       np.int32, "grouped int32")
        assert_reduced(rt.synchronize(handle),
                       _expected(active, (300,), np.float64, rt.Average, key),
                       np.float64, "async Average")
        expected = _expected(active, (70_000,), np.float32, rt.Sum, key)
        assert np.allclose(fp16, expected, atol=2e-3 * len(active)), "fp16-compressed Sum"
        rtc.join()


@check(min_size=2)
def ranks_join_one_after_another():
    """Rank r joins after r allreduces: each allreduce sums the ranks still working."""
    k, me = rt.size(), rt.rank()
    for step in range(k):
        if me < step:
            continue  # joined already, inside the join() below
        if me == step:
            last = rtc.join()
            break
        got = rt.allreduce(np.full(6, me + 1.0), rt.Sum, name="staggered")
        expected = sum(r + 1.0 for r in range(step + 1, k))
        assert np.array_equal(got, np.full(6, expected)), (step, got)
    assert last == k - 1, last
    same_on_all_ranks(last, "join's result")


@check(min_size=2)
def other_collectives_fail_while_a_rank_is_joined():
    k, me = rt.size(), rt.rank()
    for first in range(k):
        if me == first:
            last = rtc.join()
        else:
            for call in (lambda: rt.allgather(np.ones(3, np.float32), name="gathered"),
                         lambda: rt.broadcast(np.ones(3, np.float32), 1 - min(first, 1),
                                              name="sent"),
                         lambda: rt.reducescatter(np.ones(k * 2, np.float32), rt.Sum)):
                error = expect_raises(rt.UsageError, call, match=[f"rank {first} joined"])
                assert isinstance(error, RuntimeError)
            rt.barrier()  # a joined rank also enters barriers
            last = rtc.join()
        same_on_all_ranks(last, "join's result")
    total = rt.allreduce(np.full(3, me + 1.0), rt.Sum, name="after")
    assert np.array_equal(total, np.full(3, k * (k + 1) / 2)), total


@check(min_size=2)
def everyone_joins_at_once():
    assert rtc.join() == rt.size() - 1


@check(min_size=2)
def joined_rank_ignores_mismatched_calls_of_the_others():
    """The working ranks disagree among themselves: they get a MismatchError; the joined
    rank goes on waiting."""
    k, me = rt.size(), rt.rank()
    if k < 3:
        return
    if me == 0:
        rtc.join()
    else:
        shape = (3,) if me == 1 else (4,)
        expect_raises(rt.MismatchError, rt.allreduce, np.ones(shape, FLOAT_DTYPES[1]), rt.Sum)
        rtc.join()


if __name__ == "__main__":
    main()
