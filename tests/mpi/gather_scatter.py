"""allgather, reducescatter and alltoall, checked against numpy on any number of ranks.

Run: mpiexec -n K python tests/mpi/gather_scatter.py [--only SUBSTRING]
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import ringtrain as rt
from ringtrain.collectives.algorithms import _compiled_ring, _data_phase, _ring
from ringtrain.collectives.algorithms._ring import reduce_scatter as python_reduce_scatter
from ringtrain.collectives.algorithms._selection import auto_choice
from ringtrain.collectives.calls._allgather_plan import AllgatherPlan
from ringtrain.collectives.calls._alltoall_plan import AlltoallPlan
from ringtrain.collectives.calls._reducescatter_plan import ReducescatterPlan
from ringtrain.collectives.transport import _recursive_doubling
from ringtrain.collectives.transport._mailboxes import MESSAGE_BYTES
from ringtrain.collectives.world._topology import layout_of
from ringtrain.collectives.world._world import world
from _harness import (COPY_DTYPES, OPS, REDUCE_DTYPES, WORLD, assert_equal_arrays, assert_reduced,
                      check, configured, declined, expect_raises, main, make_input,
                      reduce_reference, refused, replaced)

# --------------------------------------------------------------------------- allgather

GATHER_ALGORITHMS = ["ring", "recursive_doubling", "pairwise", "native", "auto"]


def gather_rows(rank: int) -> int:
    """Rows each rank contributes: 0 on rank 0, then varying (1, 2, 0, 1, ...)."""
    return rank % 3


def allgather_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for dtype in COPY_DTYPES:
        for trailing in [(), (2, 3), (4,), (0,)]:
            for rows_of in (gather_rows, lambda r: 0, lambda r: 2 * r + 1):
                inputs = [make_input(r, (rows_of(r), *trailing), dtype, None, "ag")
                          for r in range(k)]
                x = inputs[me]
                before = x.copy()
                what = (f"allgather(algorithm={algorithm}, dtype={dtype.name}, rows="
                        f"{[rows_of(r) for r in range(k)]}, trailing={trailing})")
                y = rt.allgather(x, name="g", algorithm=algorithm)
                assert_equal_arrays(y, np.concatenate(inputs, axis=0), what)
                assert y.flags.c_contiguous and y.flags.writeable, \
                    f"{what}: not a writable C-contiguous array"
                assert not np.shares_memory(y, x)
                assert_equal_arrays(x, before, f"{what}: input after the call")


def allgather_special(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for dtype in COPY_DTYPES:
        # 0-d: one row per rank
        scalars = [make_input(r, (), dtype, None, "ag0") for r in range(k)]
        y = rt.allgather(scalars[me], algorithm=algorithm)
        assert_equal_arrays(y, np.stack(scalars), f"allgather of 0-d {dtype.name}")
    # 0-d on some ranks, one-row 1-D arrays on others: both are one row
    x = np.array(float(me)) if me % 2 == 0 else np.array([float(me)])
    assert_equal_arrays(rt.allgather(x, algorithm=algorithm), np.arange(k, dtype=np.float64),
                        "allgather of 0-d mixed with shape (1,)")
    # non-contiguous input
    base = make_input(me, (7, 6), np.float32, None, "agnc")
    views = [make_input(r, (7, 6), np.float32, None, "agnc")[r % 2::2, ::2] for r in range(k)]
    y = rt.allgather(base[me % 2::2, ::2], algorithm=algorithm)
    assert_equal_arrays(y, np.concatenate(views), "allgather non-contiguous")
    # asynchronous, several in flight
    handles = [rt.allgather_async(np.full((me + 1, 2), me * 10 + i, np.int64), name=f"a{i}",
                                  algorithm=algorithm) for i in range(4)]
    for i, handle in reversed(list(enumerate(handles))):
        expected = np.concatenate([np.full((r + 1, 2), r * 10 + i, np.int64) for r in range(k)])
        assert_equal_arrays(rt.synchronize(handle), expected, f"allgather_async #{i}")
    # equal counts, every dtype (a small auto or recursive_doubling allgather then needs
    # one exchange), and one rank with too many rows for the agreement's messages
    for dtype in COPY_DTYPES:
        equal = [make_input(r, (2, 3), dtype, None, "age") for r in range(k)]
        assert_equal_arrays(rt.allgather(equal[me], algorithm=algorithm),
                            np.concatenate(equal), f"allgather equal rows {dtype.name}")
    many = [make_input(r, (40000 if r == k - 1 else 1,), np.float32, None, "agm")
            for r in range(k)]
    assert_equal_arrays(rt.allgather(many[me], algorithm=algorithm), np.concatenate(many),
                        "allgather with 40000 rows on the last rank, 1 elsewhere")
    # array-likes
    assert_equal_arrays(rt.allgather([me, me], algorithm=algorithm),
                        np.repeat(np.arange(k, dtype=np.asarray([0]).dtype), 2),
                        "allgather(list)")


for _algorithm in GATHER_ALGORITHMS:
    check(name=f"allgather every dtype, uneven and empty rows, algorithm={_algorithm}")(
        lambda a=_algorithm: allgather_matrix(a))
    check(name=f"allgather 0-d, non-contiguous, async, algorithm={_algorithm}")(
        lambda a=_algorithm: allgather_special(a))

# --------------------------------------------------------------------------- reducescatter

SCATTER_ALGORITHMS = ["ring", "recursive_doubling", "native", "auto"]


def scatter_shapes() -> list[tuple[int, ...]]:
    k = rt.size()
    return [(3 * k + 1,), (k - 1,), (2 * k,), (1,), (0,), (2 * k + 1, 3), (k + 2, 2, 2)]


def reducescatter_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            for shape in scatter_shapes():
                x = make_input(me, shape, dtype, op, "rs")
                what = (f"reducescatter(algorithm={algorithm}, op={op.name}, dtype={dtype.name}, "
                        f"shape={shape})")
                if op is rt.Average and dtype.kind in "iu":
                    expect_raises(rt.InvalidArgumentError, rt.reducescatter, x, op, name="rs",
                                  algorithm=algorithm, match=["'rs'", "Average"])
                    continue
                before = x.copy()
                y = rt.reducescatter(x, op, name="rs", algorithm=algorithm)
                full = reduce_reference([make_input(r, shape, dtype, op, "rs") for r in range(k)],
                                        op)
                pieces = np.array_split(full, k, axis=0)
                assert_reduced(y, pieces[me], dtype, what)
                assert y.flags.c_contiguous and y.flags.writeable, \
                    f"{what}: not a writable C-contiguous array"
                assert_equal_arrays(x, before, f"{what}: input after the call")
                # the split across ranks is numpy.array_split's
                rows = WORLD.allgather(y.shape[0])
                assert rows == [p.shape[0] for p in pieces], \
                    f"{what}: rows per rank {rows}, numpy.array_split gives " \
                    f"{[p.shape[0] for p in pieces]}"


def reducescatter_special(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    # prescale / postscale on floats
    for dtype in (np.float16, np.float32, np.float64):
        for op in (rt.Average, rt.Sum, rt.Max):
            for pre, post in [(0.5, 3.0), (2.0, 1.0), (1.0, 0.25)]:
                shape = (2 * k + 1, 2)
                inputs = [make_input(r, shape, dtype, op, "rss", pre) for r in range(k)]
                y = rt.reducescatter(inputs[me], op, prescale_factor=pre, postscale_factor=post,
                                     algorithm=algorithm)
                full = reduce_reference(inputs, op, pre, post)
                assert_reduced(y, np.array_split(full, k)[me], np.dtype(dtype),
                               f"reducescatter {np.dtype(dtype).name} {op.name} pre={pre} "
                               f"post={post}")
    # non-contiguous input
    views = [make_input(r, (4 * k + 3, 5), np.float64, rt.Sum, "rsnc")[::2, 1:4]
             for r in range(k)]
    y = rt.reducescatter(views[me], rt.Sum, algorithm=algorithm)
    assert_reduced(y, np.array_split(reduce_reference(views, rt.Sum), k)[me], np.float64,
                   "reducescatter non-contiguous")
    # asynchronous, several in flight
    handles = []
    for i, dtype in enumerate(REDUCE_DTYPES):
        x = make_input(me, (k + i,), dtype, rt.Sum, "rsa")
        handles.append((dtype, i, rt.reducescatter_async(x, rt.Sum, name=f"rsa{i}",
                                                         algorithm=algorithm)))
    for dtype, i, handle in reversed(handles):
        full = reduce_reference([make_input(r, (k + i,), dtype, rt.Sum, "rsa") for r in range(k)],
                                rt.Sum)
        assert_reduced(rt.synchronize(handle), np.array_split(full, k)[me], dtype,
                       f"reducescatter_async {dtype.name}")
    # tiny segments: many ring messages per chunk
    with configured(segment_bytes=64):
        for n in (8 * k + 1, 50 * k - 3):
            inputs = [make_input(r, (n,), np.float64, rt.Average, "rsseg") for r in range(k)]
            y = rt.reducescatter(inputs[me], rt.Average, algorithm=algorithm)
            assert_reduced(y, np.array_split(reduce_reference(inputs, rt.Average), k)[me],
                           np.float64, f"reducescatter segment_bytes=64 n={n}")


def scatter_splits(rows: int) -> list[list[int]]:
    """Uneven splits of ``rows`` (at least the world size): all on the last rank, one
    more row per rank (with the rest on rank 0), and the even split reversed."""
    k = rt.size()
    growing = [min(r, rows) for r in range(k)]
    growing[0] += rows - sum(growing)
    even = [len(part) for part in np.array_split(np.arange(rows), k)]
    return [[0] * (k - 1) + [rows], growing, even[::-1]]


def reducescatter_with_splits(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for dtype in REDUCE_DTYPES:
        for op in (rt.Sum, rt.Max):
            for row_shape in ((), (3,)):
                rows = 2 * k + 1
                for splits in scatter_splits(rows):
                    shape = (rows, *row_shape)
                    what = (f"reducescatter(algorithm={algorithm}, op={op.name}, "
                            f"dtype={dtype.name}, shape={shape}, splits={splits})")
                    y = rt.reducescatter(make_input(me, shape, dtype, op, "rsp"), op,
                                         name="rsp", algorithm=algorithm, splits=splits)
                    full = reduce_reference([make_input(r, shape, dtype, op, "rsp")
                                             for r in range(k)], op)
                    start = sum(splits[:me])
                    assert_reduced(y, full[start:start + splits[me]], dtype, what)
    # Average, scales, asynchronous, and splits given as an array
    inputs = [make_input(r, (3 * k, 2), np.float64, rt.Average, "rspa") for r in range(k)]
    splits = np.array(scatter_splits(3 * k)[1], np.int32)
    handle = rt.reducescatter_async(inputs[me], rt.Average, name="rspa", prescale_factor=0.5,
                                    postscale_factor=3.0, algorithm=algorithm, splits=splits)
    full = reduce_reference(inputs, rt.Average, 0.5, 3.0)
    start = int(splits[:me].sum())
    assert_reduced(rt.synchronize(handle), full[start:start + int(splits[me])], np.float64,
                   f"reducescatter_async with splits, algorithm={algorithm}")


def reducescatter_splits_refused_and_mismatched() -> None:
    k, me = rt.size(), rt.rank()
    x = np.ones((k + 1, 2), np.float32)
    bad = [[1] * k,                          # sums to k, not k + 1
           [-1, k + 2] + [0] * (k - 2) if k > 1 else [-1],
           [(k + 1) / k] * k,                # not integers
           [k + 1] + [0] * k]                # one per rank, plus one
    for splits in bad:
        expect_raises(rt.InvalidArgumentError, rt.reducescatter, x, rt.Sum, name="bad",
                      splits=splits, match=["reducescatter", "'bad'", "splits"])
    # The even splits given are the same call as none given.
    even = [len(part) for part in np.array_split(np.arange(k + 1), k)]
    assert_equal_arrays(rt.reducescatter(x, rt.Sum, splits=even if me % 2 else None),
                        np.full((even[me], 2), k, np.float32), "even splits against none")
    if k > 1:
        differing = [k + 1 - min(me, 1), min(me, 1)] + [0] * (k - 2)
        expect_raises(rt.MismatchError, rt.reducescatter, x, rt.Sum, name="differs",
                      splits=differing, match=["reducescatter", "'differs'", "splits"])
    assert_equal_arrays(rt.reducescatter(x, rt.Sum, splits=[0] * (k - 1) + [k + 1]),
                        np.full((k + 1 if me == k - 1 else 0, 2), k, np.float32),
                        "a reducescatter after the mismatch")
    # A 16-bit wire: small integers travel exactly.
    splits = scatter_splits(2 * k + 1)[1]
    values = (np.arange((2 * k + 1) * 2, dtype=np.float32).reshape(-1, 2) % 7) + me
    got = rt.reducescatter(values, rt.Sum, name="rspc", compression=rt.Compression.fp16,
                           splits=splits)
    full = sum((np.arange((2 * k + 1) * 2, dtype=np.float32).reshape(-1, 2) % 7) + r
               for r in range(k))
    start = sum(splits[:me])
    assert_equal_arrays(got, full[start:start + splits[me]], "reducescatter fp16 with splits")


for _algorithm in SCATTER_ALGORITHMS:
    check(name=f"reducescatter every op x dtype x shape, algorithm={_algorithm}")(
        lambda a=_algorithm: reducescatter_matrix(a))
    check(name=f"reducescatter scaled, non-contiguous, async, segmented, algorithm={_algorithm}")(
        lambda a=_algorithm: reducescatter_special(a))
    check(name=f"reducescatter with uneven splits, every dtype, algorithm={_algorithm}")(
        lambda a=_algorithm: reducescatter_with_splits(a))
check(name="reducescatter splits refused, and splits that differ across ranks")(
    reducescatter_splits_refused_and_mismatched)

# --------------------------------------------------------------------------- alltoall

ALLTOALL_ALGORITHMS = ["recursive_doubling", "pairwise", "native", "auto"]


def uneven_splits(rank: int, k: int) -> list[int]:
    """Rows rank sends to each rank: includes zeros (and all-zero rows for some ranks)."""
    return [(rank + 2 * j) % 3 for j in range(k)]


def default_splits(rows: int, k: int) -> list[int]:
    return [len(p) for p in np.array_split(np.arange(rows), k)]


def alltoall_expected(inputs, splits_of, me):
    """Rows every rank sends to ``me``, concatenated in rank order, and their counts."""
    blocks, counts = [], []
    for r, x in enumerate(inputs):
        splits = splits_of(r)
        start = sum(splits[:me])
        blocks.append(x[start:start + splits[me]])
        counts.append(splits[me])
    return np.concatenate(blocks, axis=0), np.array(counts, np.int64)


def alltoall_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for dtype in COPY_DTYPES:
        for trailing in [(), (2,), (3, 2)]:
            cases = [
                ("default, even", lambda r: 2 * k, None),
                ("default, a row to each rank", lambda r: k, None),
                ("default, uneven", lambda r: 2 * k + 1 + r, None),
                ("explicit with zeros", lambda r: sum(uneven_splits(r, k)), uneven_splits),
                ("nothing to send", lambda r: 0, lambda r, kk: [0] * kk),
            ]
            for title, rows_of, splits_fn in cases:
                inputs = [make_input(r, (rows_of(r), *trailing), dtype, None, "a2a", title)
                          for r in range(k)]

                def splits_of(r, splits_fn=splits_fn, rows_of=rows_of):
                    return (splits_fn(r, k) if splits_fn is not None
                            else default_splits(rows_of(r), k))

                what = (f"alltoall(algorithm={algorithm}, dtype={dtype.name}, trailing="
                        f"{trailing}, {title})")
                x = inputs[me]
                before = x.copy()
                splits = None if splits_fn is None else splits_fn(me, k)
                received, received_splits = rt.alltoall(x, splits, name="a2a",
                                                        algorithm=algorithm)
                expected, expected_splits = alltoall_expected(inputs, splits_of, me)
                assert_equal_arrays(received, expected, what)
                assert received.flags.c_contiguous and received.flags.writeable, \
                    f"{what}: not a writable C-contiguous array"
                assert_equal_arrays(received_splits, expected_splits, what + " received_splits")
                assert_equal_arrays(x, before, f"{what}: input after the call")


def alltoall_special(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    # splits as a tuple, an int32 array and an int64 array
    x = np.arange(sum(uneven_splits(me, k)) * 2, dtype=np.float32).reshape(-1, 2) + 100 * me
    inputs = [np.arange(sum(uneven_splits(r, k)) * 2, dtype=np.float32).reshape(-1, 2) + 100 * r
              for r in range(k)]
    expected, expected_splits = alltoall_expected(inputs, lambda r: uneven_splits(r, k), me)
    for splits in (tuple(uneven_splits(me, k)), np.array(uneven_splits(me, k), np.int32),
                   np.array(uneven_splits(me, k), np.int64)):
        received, received_splits = rt.alltoall(x, splits, algorithm=algorithm)
        assert_equal_arrays(received, expected, f"alltoall splits as {type(splits).__name__}")
        assert_equal_arrays(received_splits, expected_splits, "received_splits")
    # one kind of call whose splits change from call to call: none, given (different on
    # every rank; the default ones on every rank; the same others on every rank), none
    rows = 2 * k
    x = make_input(me, (rows, 3), np.float64, None, "a2aalt")
    inputs = [make_input(r, (rows, 3), np.float64, None, "a2aalt") for r in range(k)]
    for title in ("default", "all to the next rank", "the default ones given",
                  "all to the last rank", "default again"):
        def splits_of(r, title=title):
            if title.startswith("default") or title == "the default ones given":
                return default_splits(rows, k)
            if title == "all to the last rank":
                return [rows if j == k - 1 else 0 for j in range(k)]
            return [rows if j == (r + 1) % k else 0 for j in range(k)]

        received, received_splits = rt.alltoall(
            x, None if title.startswith("default") else splits_of(me),
            name="a2a alternating", algorithm=algorithm)
        expected, expected_splits = alltoall_expected(inputs, splits_of, me)
        assert_equal_arrays(received, expected, f"alltoall splits {title}")
        assert_equal_arrays(received_splits, expected_splits, f"splits {title}")
    # non-contiguous input
    base = make_input(me, (4 * k, 6), np.int32, None, "a2anc")
    views = [make_input(r, (4 * k, 6), np.int32, None, "a2anc")[::2, ::3] for r in range(k)]
    received, _ = rt.alltoall(base[::2, ::3], algorithm=algorithm)
    expected, _ = alltoall_expected(views, lambda r: default_splits(2 * k, k), me)
    assert_equal_arrays(received, expected, "alltoall non-contiguous")
    # asynchronous, several in flight
    handles = []
    for i in range(3):
        rows = k * (i + 1)
        x = np.full((rows, 2), 10 * me + i, np.int64)
        handles.append((i, rt.alltoall_async(x, name=f"a2a{i}", algorithm=algorithm)))
    for i, handle in reversed(handles):
        received, received_splits = rt.synchronize(handle)
        expected = np.concatenate([np.full((i + 1, 2), 10 * r + i, np.int64) for r in range(k)])
        assert_equal_arrays(received, expected, f"alltoall_async #{i}")
        assert_equal_arrays(received_splits, np.full(k, i + 1, np.int64), "received_splits")


for _algorithm in ALLTOALL_ALGORITHMS:
    check(name=f"alltoall every dtype, default and uneven splits, algorithm={_algorithm}")(
        lambda a=_algorithm: alltoall_matrix(a))
    check(name=f"alltoall splits types, non-contiguous, async, algorithm={_algorithm}")(
        lambda a=_algorithm: alltoall_special(a))


@check()
def large_allgathers_and_alltoalls_check_and_move_in_one_compiled_call():
    """Rows too large to ride in the agreement, moved by MPI's own allgather or alltoall
    (``auto`` on one node): on more than one rank the check, the row counts or splits
    with it, and the collective are one compiled call, for every dtype; row counts that
    differ there take the general path; a rank whose call differs gets a MismatchError
    on every rank, and the next call works."""
    k, me = rt.size(), rt.rank()
    for dtype in COPY_DTYPES:
        rows = 50000  # 150 000 elements of 1 byte or more a rank: too many for the messages
        inputs = [make_input(r, (rows, 3), dtype, None, "agc") for r in range(k)]
        plan = AllgatherPlan(inputs[me], "compiled", None, None, False)
        assert (plan.checked is not None) == (k > 1), f"allgather {dtype.name}: compiled call?"
        assert_equal_arrays(rt.allgather(inputs[me], name="compiled"),
                            np.concatenate(inputs), f"allgather in one call, {dtype.name}")
        uneven = [make_input(r, (rows + r, 3), dtype, None, "agu") for r in range(k)]
        assert_equal_arrays(rt.allgather(uneven[me], name="compiled"),
                            np.concatenate(uneven), f"allgather of uneven rows, {dtype.name}")
        for blocks, per_block in (("even", 20000), ("as even as can be", 20000.5)):
            rows = int(per_block * k)
            inputs = [make_input(r, (rows, 2), dtype, None, "a2ac") for r in range(k)]
            plan = AlltoallPlan(inputs[me], "compiled", None, None, False)
            one_call = k > 1 and rows % k == 0
            assert (plan.checked is not None) == one_call, \
                f"alltoall {dtype.name}, {blocks} blocks: compiled call?"
            expected, expected_splits = alltoall_expected(
                inputs, lambda r: default_splits(rows, k), me)
            # the even splits given by the last rank: the Python path, the same messages
            for given in (None, default_splits(rows, k) if me == k - 1 else None):
                received, received_splits = rt.alltoall(inputs[me], given, name="compiled")
                what = f"alltoall of {blocks} blocks, {dtype.name}, splits given {given}"
                assert_equal_arrays(received, expected, what)
                assert_equal_arrays(received_splits, expected_splits,
                                    what + " received_splits")
    if k > 1:
        dtype = np.dtype(np.float32 if me == 0 else np.float64)
        expect_raises(rt.MismatchError, rt.allgather, np.zeros((50000, 3), dtype),
                      name="differs", match=["allgather", "'differs'", "dtype"])
        expect_raises(rt.MismatchError, rt.alltoall, np.zeros((20000 * k, 2), dtype),
                      name="differs", match=["alltoall", "'differs'", "dtype"])
        assert_equal_arrays(rt.allgather(np.full((50000, 3), me, np.int32), name="after"),
                            np.repeat(np.arange(k, dtype=np.int32), 50000)[:, None]
                            .repeat(3, axis=1), "an allgather after the mismatches")


@check()
def pairwise_allgathers_pass_rows_of_any_size_through_the_mailboxes():
    """The pairwise allgather, which on one node passes every rank's rows through the
    mailboxes (a mailbox at a time), and ``auto``, which takes it above the riding
    sizes: equal row counts checked and moved in one compiled call, ranks of 0 rows,
    rows of a mailbox and one byte to several mailboxes, counts that differ between
    ranks; each followed by a small allreduce that must find the messages in step."""
    k, me = rt.size(), rt.rank()
    room = MESSAGE_BYTES
    for title, rows_of in (("96 KiB gathered", lambda r: 96 * 1024 // k),
                           ("a mailbox and one byte each", lambda r: room + 1),
                           ("none from rank 0, 2.5 mailboxes from the others",
                            lambda r: 0 if r == 0 else 5 * room // 2),
                           ("different counts", lambda r: 40000 * (r + 1) + r)):
        inputs = [make_input(r, (rows_of(r),), np.uint8, None, "pairwise", title)
                  for r in range(k)]
        for algorithm in ("pairwise", "auto"):
            what = f"allgather({algorithm}), {title}"
            if algorithm == "auto" and title == "96 KiB gathered":
                plan = AllgatherPlan(inputs[me], "pairwise", None, algorithm, False)
                assert (plan.checked is not None) == (k > 1), f"{what}: compiled call?"
            assert_equal_arrays(rt.allgather(inputs[me], name="pairwise",
                                             algorithm=algorithm),
                                np.concatenate(inputs), what)
            total_ranks = rt.allreduce(np.full(2, me + 1, np.int64), op=rt.Sum, name="step")
            assert_equal_arrays(total_ranks, np.full(2, k * (k + 1) // 2, np.int64),
                                f"allreduce after {what}")


@check()
def pairwise_alltoalls_pass_blocks_of_any_size_through_the_mailboxes():
    """The pairwise alltoall, which on one node passes the blocks through the mailboxes
    (a mailbox at a time), and ``auto``, which takes it above the small sizes: even
    blocks checked and moved in one compiled call, blocks from empty to several
    mailboxes long and different sizes to and from each rank (the sends and receives
    of a step then count different messages), the same splits given explicitly by one
    rank (its Python path sends the same messages); each followed by a small allreduce
    that must find the messages in step."""
    k, me = rt.size(), rt.rank()
    room = MESSAGE_BYTES
    cases = [("even", lambda r, j: 8192), ("a mailbox and one byte", lambda r, j: room + 1),
             ("two and a half mailboxes", lambda r, j: 5 * room // 2),
             ("empty to some", lambda r, j: 0 if (r + j) % 2 else 40000 + r),
             ("large to one rank, small to others",
              lambda r, j: 3 * room if j == (r + 1) % k else 100 * (j + 1))]
    for title, block in cases:
        splits_of = [[block(r, j) for j in range(k)] for r in range(k)]
        inputs = [make_input(r, (sum(splits_of[r]),), np.uint8, None, "pairwise", title)
                  for r in range(k)]
        expected, expected_splits = alltoall_expected(inputs, lambda r: splits_of[r], me)
        even = len({n for row in splits_of for n in row}) == 1
        for algorithm in ("pairwise", "auto"):
            for given in (None if even else splits_of[me],
                          splits_of[me] if me == k - 1 or not even else None):
                what = f"alltoall({algorithm}), {title}, splits given: {given is not None}"
                if even and algorithm == "auto":
                    plan = AlltoallPlan(inputs[me], "pairwise", None, algorithm, False)
                    assert (plan.checked is not None) == (k > 1), f"{what}: compiled call?"
                received, received_splits = rt.alltoall(inputs[me], given, name="pairwise",
                                                        algorithm=algorithm)
                assert_equal_arrays(received, expected, what)
                assert_equal_arrays(received_splits, expected_splits, what + " splits")
                total_ranks = rt.allreduce(np.full(2, me + 1, np.int64), op=rt.Sum,
                                           name="step")
                assert_equal_arrays(total_ranks, np.full(2, k * (k + 1) // 2, np.int64),
                                    f"allreduce after {what}")


@check()
def allgather_rows_ride_in_the_agreement_only_where_the_table_says_so():
    """``auto``'s rows ride in the agreement's recursive doubling only
    where the tuning table takes recursive doubling for the gathered size; above it (96
    KiB gathered here, under the messages' capacity) MPI's own allgather moves them, in
    the same compiled call as the check."""
    k, me = rt.size(), rt.rank()
    settings = rt.current_settings()
    for row_count in (4, 4096 // k, 24576 // k):
        inputs = [make_input(r, (row_count,), np.float32, None, "ride") for r in range(k)]
        plan = AllgatherPlan(inputs[me], "ride", None, None, False)
        rides = auto_choice("allgather", inputs[me].nbytes * k, k, settings,
                            layout_of(world().group, settings)) == "recursive_doubling"
        assert plan.carried.carries_data == rides, (row_count, plan.carried.carries_data)
        assert (plan.checked is not None) == (k > 1 and not rides), row_count
        assert_equal_arrays(rt.allgather(inputs[me], name="ride"), np.concatenate(inputs),
                            f"allgather of {row_count} rows a rank")


@check()
def allgathers_ride_in_the_agreement_up_to_64_kib_even_and_uneven():
    """Gathered sizes from 4 KiB to 64 KiB ride through the node's mailboxes, each
    message carrying the rows its sender has by then: every dtype's bytes, odd row
    sizes, equal and unequal row counts (the rows then follow by the ring), and 0-row
    ranks; each call followed by a small allreduce that must find the agreement's
    messages in step."""
    k, me = rt.size(), rt.rank()
    for total in (4 * 1024, 16 * 1024 + 24, 64 * 1024):
        for dtype in (np.float64, np.int8, np.float32):
            width = 3
            rows = max(1, total // (k * width * np.dtype(dtype).itemsize))
            for counts in ([rows] * k, [rows + r % 3 - 1 for r in range(k)],
                           [0 if r == 0 else rows for r in range(k)]):
                inputs = [make_input(r, (counts[r], width), dtype, None, "gather", total)
                          for r in range(k)]
                got = rt.allgather(inputs[me], name="ride")
                assert_equal_arrays(got, np.concatenate(inputs),
                                    f"allgather of {counts} rows of {width} {dtype.__name__}")
                total_ranks = rt.allreduce(np.full(2, me + 1, np.int64), op=rt.Sum,
                                           name="step")
                assert_equal_arrays(total_ranks, np.full(2, k * (k + 1) // 2, np.int64),
                                    f"allreduce after the allgather of {counts} rows")


@check()
def ring_reducescatters_check_and_reduce_in_one_compiled_call():
    """The ring reduce-scatter of host arrays of the dtypes the compiled exchange
    combines is one compiled call (the check, then the ring's steps) on more than one
    rank, with the Python ring's bits: uneven shares, empty ones, several segments, every
    op, scaled; a rank whose call differs gets a MismatchError on every rank, and the
    next call works."""
    k, me = rt.size(), rt.rank()
    group = world().group
    with configured(segment_bytes=64):
        for dtype in (np.float32, np.float64, np.int8, np.int32):
            floating = np.dtype(dtype).kind == "f"
            for shape in ((3 * k + 1, 5), (k - 1,), (2 * k + 1, 3)):
                for op in OPS:
                    if op is rt.Average and not floating:
                        continue
                    post = 0.5 if floating else 1.0
                    x = make_input(me, shape, dtype, op, "rsc")
                    plan = ReducescatterPlan(x, op, None, 1.0, post, None, "ring",
                                             rt.Compression.none, False)
                    what = f"reducescatter ring {np.dtype(dtype).name} {op.name} {shape}"
                    assert (plan.checked is not None) == (k > 1), f"{what}: compiled call?"
                    python = np.empty(plan.share_shape, dtype)
                    if k > 1:
                        python_reduce_scatter(group, x.reshape(-1), python.reshape(-1),
                                              plan.bounds, plan.combine, plan.finish, 64)
                    else:
                        python[...] = x
                        if plan.finish is not None:
                            plan.finish(python)
                    assert_equal_arrays(rt.reducescatter(x, op, algorithm="ring",
                                                         postscale_factor=post), python, what)
    if k > 1:
        shape = (4 * k, 3) if me == 0 else (4 * k + 1, 3)
        expect_raises(rt.MismatchError, rt.reducescatter, np.ones(shape, np.float32), rt.Sum,
                      name="differs", algorithm="ring", match=["reducescatter", "'differs'",
                                                               "shape"])
        assert_equal_arrays(rt.reducescatter(np.ones((4 * k, 3), np.float32), rt.Sum,
                                             name="after", algorithm="ring"),
                            np.full((4, 3), k, np.float32), "a reducescatter after the mismatch")


@check(min_size=2)
def reducescatters_after_the_check_run_in_compiled_calls():
    """A reduce-scatter whose data phase follows the agreement (prescaled, compressed to
    a 16-bit wire, or by recursive doubling) runs it in compiled code, never the Python
    steps, with the bits those steps give; 16-bit floats and integers too."""
    k, me = rt.size(), rt.rank()
    cases = [(np.float32, rt.Compression.none, "ring"), (np.float16, rt.Compression.none, "ring"),
             (ml_dtypes.bfloat16, rt.Compression.none, "ring"),
             (np.float32, rt.Compression.fp16, "ring"), (np.float32, rt.Compression.bf16, "ring"),
             (np.float32, rt.Compression.none, "recursive_doubling"),
             (ml_dtypes.bfloat16, rt.Compression.none, "recursive_doubling"),
             (np.int32, rt.Compression.none, "recursive_doubling")]
    with configured(segment_bytes=4096):
        for dtype, compression, algorithm in cases:
            rows = 3 * k + 1 if algorithm == "ring" else 20_000  # past the agreement's payload
            x = make_input(me, (rows, 5), dtype, rt.Sum, "after the check")
            prescale = 1.0 if np.dtype(dtype).kind == "i" else 2.0
            what = f"reducescatter {algorithm} {np.dtype(dtype).name} {compression.name}"

            def reduced() -> np.ndarray:
                return rt.reducescatter(x, rt.Sum, algorithm=algorithm, compression=compression,
                                        prescale_factor=prescale, name=what)

            with replaced(_ring, "reduce_scatter", refused), \
                    replaced(_recursive_doubling, "allreduce", refused):
                compiled = reduced()
            with replaced(_compiled_ring, "ring_reduce_scatter", declined), \
                    replaced(_data_phase, "reduce_by_recursive_doubling", declined):
                python = reduced()
            assert_equal_arrays(compiled, python, what)


if __name__ == "__main__":
    main()
