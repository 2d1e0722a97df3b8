"""Horovod's collectives through ``ringtrain.horovod``: results, dtypes, gradients, handles,
names, errors, process sets, sparse allreduce, Adasum, join and the timeline, each
checked against a reference computed from every rank's input.

Run: mpiexec -n K python tests/mpi/horovod_ops.py [--only SUBSTRING]
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import numpy as np
import torch

import ringtrain.horovod as hvd
from _harness import (WORLD, Digests, adasum_reference, all_inputs, assert_reduced, check,
                      expect_raises, main, make_input, reduce_reference)

TORCH_DTYPES = {np.dtype(n): t for n, t in (
    (np.uint8, torch.uint8), (np.int8, torch.int8), (np.int16, torch.int16),
    (np.int32, torch.int32), (np.int64, torch.int64), (np.float16, torch.float16),
    (np.float32, torch.float32), (np.float64, torch.float64), (np.bool_, torch.bool))}
REDUCE = [d for d in TORCH_DTYPES if d.kind != "b"]
INTEGERS = [d for d in REDUCE if d.kind in "iu"]
FLOATS = [d for d in REDUCE if d.kind == "f"]
SHAPES = [(), (5,), (3, 7)]


def tensor_of(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array, copy=True))


def ranks() -> range:
    return range(hvd.size())


def assert_tensor(result, dtype: np.dtype, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``result`` is a torch tensor of ``dtype`` and ``shape``; return it as numpy."""
    assert isinstance(result, torch.Tensor), f"{what}: got a {type(result).__name__}"
    assert result.dtype == TORCH_DTYPES[np.dtype(dtype)], f"{what}: dtype {result.dtype}"
    assert tuple(result.shape) == tuple(shape), f"{what}: shape {tuple(result.shape)}, " \
                                                f"expected {tuple(shape)}"
    return result.numpy()


def truncated_mean(total: np.ndarray, count: int) -> np.ndarray:
    """Integer division rounding toward zero."""
    return np.where(total < 0, -((-total) // count), total // count)


def reference(inputs: list[np.ndarray], op) -> np.ndarray:
    """Horovod's result: integer averages truncate toward zero."""
    if op is hvd.Average and inputs[0].dtype.kind in "iu":
        return truncated_mean(reduce_reference(inputs, hvd.Sum), len(inputs))
    return reduce_reference(inputs, op)


def input_op(dtype: np.dtype, op):
    """The op whose value range make_input uses: integer averages take Sum's (no overflow)."""
    return hvd.Sum if op is hvd.Average and dtype.kind in "iu" else op


# --------------------------------------------------------------------------- allreduce

@check
def allreduce_every_dtype_and_form():
    for dtype in REDUCE:
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            for shape in SHAPES:
                key = ("hvd allreduce", op.name)
                inputs = all_inputs(ranks(), shape, dtype, input_op(dtype, op), *key)
                expected = reference(inputs, op)
                mine = inputs[hvd.rank()]
                what = f"{dtype} {op.name} {shape}"
                result = hvd.allreduce(tensor_of(mine), op=op, name="a")
                assert_reduced(assert_tensor(result, dtype, shape, what), expected, dtype, what)
                tensor = tensor_of(mine)
                assert hvd.allreduce_(tensor, op=op, name="a") is tensor, what
                assert_reduced(tensor.numpy(), expected, dtype, what + " in place")
                handle = hvd.allreduce_async(tensor_of(mine), op=op, name="a")
                result = hvd.synchronize(handle)
                assert_reduced(assert_tensor(result, dtype, shape, what), expected, dtype,
                               what + " async")
                tensor = tensor_of(mine)
                assert hvd.synchronize(hvd.allreduce_async_(tensor, op=op)) is tensor, what
                assert_reduced(tensor.numpy(), expected, dtype, what + " async in place")


@check
def integer_average_truncates_toward_zero():
    # every rank holds the same values: the sum is size * value, the exact mean the value
    # plus one on rank 0 only: the mean is value + 1/size, truncated toward zero
    base = np.array([-7, -3, -1, 0, 1, 3, 7], np.int32)
    bump = np.array([1 if hvd.rank() == 0 else 0], np.int32)
    result = hvd.allreduce(tensor_of(base + bump), op=hvd.Average)
    expected = truncated_mean(base.astype(np.int64) * hvd.size() + 1, hvd.size())
    assert np.array_equal(result.numpy(), expected), (result, expected)
    if hvd.size() > 1:  # -6.5 must give -6, not -7 (floor) and not -6.5
        negative = np.array([-13 if hvd.rank() == 0 else 0], np.int64)
        result = hvd.allreduce(tensor_of(negative), op=hvd.Average)
        assert result.item() == int(-13 / hvd.size()), result


@check
def scale_factors_as_horovod_computes_them():
    for dtype in INTEGERS + FLOATS:
        for pre, post in ((0.37, 1.0), (1.0, 0.61), (1.7, 0.4)):
            inputs = all_inputs(ranks(), (4, 5), dtype, hvd.Sum, "scaled")
            if dtype.kind in "iu":
                # each rank scales in float64 and truncates, the sum is scaled likewise
                scaled = [np.trunc(x.astype(np.float64) * pre).astype(dtype) for x in inputs]
                total = np.sum(scaled, axis=0, dtype=np.int64)
                expected = np.trunc(total * post).astype(np.int64)
            elif dtype == np.float16:
                scaled = [(x.astype(np.float32) * np.float32(pre)).astype(np.float16)
                          for x in inputs]
                total = np.sum(scaled, axis=0, dtype=np.float64)
                expected = total * post
            else:
                expected = reduce_reference(inputs, hvd.Sum, pre, post)
            what = f"{dtype} prescale {pre} postscale {post}"
            result = hvd.allreduce(tensor_of(inputs[hvd.rank()]), op=hvd.Sum,
                                   prescale_factor=pre, postscale_factor=post)
            assert_reduced(assert_tensor(result, dtype, (4, 5), what), expected, dtype, what)


@check
def average_argument_is_deprecated():
    mine = tensor_of(make_input(hvd.rank(), (6,), np.float64, hvd.Sum, "deprecated"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summed = hvd.allreduce(mine, average=False)
        averaged = hvd.allreduce(mine, average=True)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught
    assert torch.allclose(summed, hvd.allreduce(mine, op=hvd.Sum))
    assert torch.allclose(averaged, hvd.allreduce(mine, op=hvd.Average))
    expect_raises(ValueError, hvd.allreduce, mine, average=True, op=hvd.Sum)
    expect_raises(ValueError, hvd.allreduce_async, mine, average=False, op=hvd.Sum)


@check
def grouped_allreduce_mixed_dtypes():
    dtypes = [np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.float16),
              np.dtype(np.int64), np.dtype(np.float64)]
    shapes = [(3,), (2, 5), (7,), (), (4, 1)]
    for op in (hvd.Sum, hvd.Average, hvd.Max):
        inputs = [all_inputs(ranks(), s, d, input_op(d, op), "grouped", i)
                  for i, (s, d) in enumerate(zip(shapes, dtypes))]
        expected = [reference(x, op) for x in inputs]
        mine = [x[hvd.rank()] for x in inputs]
        results = hvd.grouped_allreduce([tensor_of(m) for m in mine], op=op, name="g")
        tensors = [tensor_of(m) for m in mine]
        same = hvd.grouped_allreduce_(tensors, op=op, name="g")
        assert all(a is b for a, b in zip(same, tensors))
        handle = hvd.grouped_allreduce_async([tensor_of(m) for m in mine], op=op)
        later = hvd.synchronize(handle)
        for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
            what = f"grouped {op.name} {i} {dtype}"
            assert_reduced(assert_tensor(results[i], dtype, shape, what), expected[i], dtype,
                           what)
            assert_reduced(tensors[i].numpy(), expected[i], dtype, what + " in place")
            assert_reduced(assert_tensor(later[i], dtype, shape, what), expected[i], dtype,
                           what + " async")


@check
def fp16_compression_returns_the_input_dtype():
    inputs = all_inputs(ranks(), (50,), np.float32, hvd.Average, "compressed")
    result = hvd.allreduce(tensor_of(inputs[hvd.rank()]), compression=hvd.Compression.fp16)
    assert_tensor(result, np.float32, (50,), "fp16")
    expected = reduce_reference(inputs, hvd.Average)
    assert np.allclose(result.numpy(), expected, rtol=1e-2, atol=1e-2), (result, expected)


# --------------------------------------------------------------------------- moving data

@check
def allgather_uneven_rows_every_dtype():
    digests = Digests()
    for dtype in TORCH_DTYPES:
        for tail in ((), (3,)):
            shapes = [(r % 3, *tail) for r in ranks()]  # rank 0 sends no rows
            inputs = [make_input(r, shapes[r], dtype, None, "gather") for r in ranks()]
            expected = np.concatenate(inputs, axis=0)
            what = f"allgather {dtype} {tail}"
            result = hvd.allgather(tensor_of(inputs[hvd.rank()]), name="g")
            got = assert_tensor(result, dtype, expected.shape, what)
            assert np.array_equal(got, expected), what
            handle = hvd.allgather_async(tensor_of(inputs[hvd.rank()]))
            assert np.array_equal(hvd.synchronize(handle).numpy(), expected), what + " async"
            digests.add(what, got)
    digests.verify()


@check
def grouped_allgather_keeps_the_order():
    mine = [tensor_of(make_input(hvd.rank(), (hvd.rank() + 1, 2), np.int16, None, "gg", i))
            for i in range(3)]
    expected = [np.concatenate([make_input(r, (r + 1, 2), np.int16, None, "gg", i)
                                for r in ranks()]) for i in range(3)]
    for results in (hvd.grouped_allgather(mine, name="gg"),
                    hvd.synchronize(hvd.grouped_allgather_async(mine))):
        assert len(results) == 3
        for result, wanted in zip(results, expected):
            assert np.array_equal(assert_tensor(result, np.int16, wanted.shape, "gg"), wanted)


@check
def broadcast_every_root_and_form():
    for dtype in TORCH_DTYPES:
        for root in ranks():
            data = make_input(root, (3, 4), dtype, None, "bcast")
            mine = make_input(hvd.rank(), (3, 4), dtype, None, "bcast")
            source = tensor_of(mine)
            what = f"broadcast {dtype} root {root}"
            result = hvd.broadcast(source, root, name="b")
            assert np.array_equal(assert_tensor(result, dtype, (3, 4), what), data), what
            assert np.array_equal(source.numpy(), mine), what + ": the input changed"
            tensor = tensor_of(mine)
            assert hvd.broadcast_(tensor, root_rank=root) is tensor
            assert np.array_equal(tensor.numpy(), data), what + " in place"
            result = hvd.synchronize(hvd.broadcast_async(tensor_of(mine), root))
            assert np.array_equal(result.numpy(), data), what + " async"
            tensor = tensor_of(mine)
            assert hvd.synchronize(hvd.broadcast_async_(tensor, root)) is tensor
            assert np.array_equal(tensor.numpy(), data), what + " async in place"


def alltoall_rows(sender: int, receiver: int, count: int, dtype: np.dtype) -> np.ndarray:
    return make_input(sender, (count, 2), dtype, None, "a2a", receiver)


@check
def alltoall_with_splits_every_dtype():
    size = hvd.size()

    def count(sender: int, receiver: int) -> int:
        return (sender + 2 * receiver) % 3

    for dtype in TORCH_DTYPES:
        blocks = [alltoall_rows(hvd.rank(), j, count(hvd.rank(), j), dtype) for j in ranks()]
        mine = tensor_of(np.concatenate(blocks))
        expected = np.concatenate([alltoall_rows(i, hvd.rank(), count(i, hvd.rank()), dtype)
                                   for i in ranks()])
        wanted_splits = [count(i, hvd.rank()) for i in ranks()]
        for splits, splits_dtype in (([count(hvd.rank(), j) for j in ranks()], torch.int32),
                                     (torch.tensor([count(hvd.rank(), j) for j in ranks()],
                                                   dtype=torch.int64), torch.int64)):
            what = f"alltoall {dtype} splits {type(splits).__name__}"
            output, received = hvd.alltoall(mine, splits, name="x")
            assert np.array_equal(assert_tensor(output, dtype, expected.shape, what), expected)
            assert isinstance(received, torch.Tensor) and received.dtype == splits_dtype, \
                f"{what}: received splits {received!r}"
            assert received.tolist() == wanted_splits, (what, received)
            output, received = hvd.synchronize(hvd.alltoall_async(mine, splits))
            assert np.array_equal(output.numpy(), expected) and \
                received.tolist() == wanted_splits, what + " async"
    # no splits: the first dimension is divided evenly and only the rows come back
    rows = make_input(hvd.rank(), (2 * size, 3), np.float32, None, "even")
    result = hvd.alltoall(tensor_of(rows))
    assert isinstance(result, torch.Tensor), type(result)
    expected = np.concatenate([make_input(i, (2 * size, 3), np.float32, None, "even")
                               [2 * hvd.rank():2 * hvd.rank() + 2] for i in ranks()])
    assert np.array_equal(result.numpy(), expected)
    if size > 1:
        expect_raises(ValueError, hvd.alltoall, torch.zeros(size + 1))
    expect_raises(ValueError, hvd.alltoall, torch.zeros(size), torch.ones(size))
    expect_raises(ValueError, hvd.alltoall, torch.zeros(size + 1),
                  torch.ones(size, dtype=torch.int32))


@check
def reducescatter_uneven_rows():
    size = hvd.size()
    rows = 2 * size + 1
    bounds = np.cumsum([0] + [rows // size + (1 if r < rows % size else 0) for r in ranks()])
    share = slice(bounds[hvd.rank()], bounds[hvd.rank() + 1])
    for dtype in REDUCE:
        for op in (hvd.Sum, hvd.Average, hvd.Max):
            inputs = all_inputs(ranks(), (rows, 3), dtype, input_op(dtype, op), "rs")
            expected = reference(inputs, op)[share]
            what = f"reducescatter {dtype} {op.name}"
            result = hvd.reducescatter(tensor_of(inputs[hvd.rank()]), op=op, name="r")
            assert_reduced(assert_tensor(result, dtype, expected.shape, what), expected, dtype,
                           what)
            handle = hvd.reducescatter_async(tensor_of(inputs[hvd.rank()]), op=op)
            assert_reduced(hvd.synchronize(handle).numpy(), expected, dtype, what + " async")
    inputs = [all_inputs(ranks(), (rows, 2), np.int32, hvd.Sum, "grs", i) for i in range(2)]
    results = hvd.grouped_reducescatter([tensor_of(x[hvd.rank()]) for x in inputs],
                                        op=hvd.Average, prescale_factor=0.5)
    for result, x in zip(results, inputs):
        halves = [np.trunc(v * 0.5).astype(np.int32) for v in x]
        expected = truncated_mean(np.sum(halves, axis=0, dtype=np.int64), size)[share]
        assert np.array_equal(result.numpy(), expected), (result, expected)
    expect_raises(RuntimeError, hvd.reducescatter, torch.ones(rows), op=hvd.Adasum)
    expect_raises(ValueError, hvd.reducescatter, torch.tensor(1.0))


# --------------------------------------------------------------------------- gradients

def upstream(shape: tuple[int, ...], rank: int, key: str) -> np.ndarray:
    return make_input(rank, shape, np.float64, None, "upstream", key)


@check
def gradients_follow_horovods_definitions():
    size, me = hvd.size(), hvd.rank()
    shape = (4, 3)
    for op in (hvd.Sum, hvd.Average):
        x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        hvd.allreduce(x, op=op).backward(tensor_of(upstream(shape, me, "ar")))
        expected = reference([upstream(shape, r, "ar") for r in ranks()], op)
        assert np.allclose(x.grad.numpy(), expected), f"allreduce {op.name} gradient"
        xs = [torch.zeros(shape, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        outs = hvd.grouped_allreduce(xs, op=op)
        torch.autograd.backward(outs, [tensor_of(upstream(shape, me, f"gar{i}"))
                                       for i in range(2)])
        for i, xi in enumerate(xs):
            expected = reference([upstream(shape, r, f"gar{i}") for r in ranks()], op)
            assert np.allclose(xi.grad.numpy(), expected), f"grouped allreduce {op.name} {i}"

    # allgather: this rank's rows of the averaged upstream gradient
    counts = [r + 1 for r in ranks()]
    total = sum(counts)
    x = torch.zeros((counts[me], 2), dtype=torch.float64, requires_grad=True)
    hvd.allgather(x).backward(tensor_of(upstream((total, 2), me, "ag")))
    mean = reference([upstream((total, 2), r, "ag") for r in ranks()], hvd.Average)
    start = sum(counts[:me])
    assert np.allclose(x.grad.numpy(), mean[start:start + counts[me]]), "allgather gradient"
    xs = [torch.zeros((counts[me], 2), dtype=torch.float64, requires_grad=True)
          for _ in range(2)]
    outs = hvd.grouped_allgather(xs)
    torch.autograd.backward(outs, [tensor_of(upstream((total, 2), me, "ag"))] * 2)
    for xi in xs:
        assert np.allclose(xi.grad.numpy(), mean[start:start + counts[me]]), "grouped allgather"

    # broadcast: the root gets the averaged gradient, the others zeros
    for root in ranks():
        x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        hvd.broadcast(x, root).backward(tensor_of(upstream(shape, me, "bc")))
        mean = reference([upstream(shape, r, "bc") for r in ranks()], hvd.Average)
        expected = mean if me == root else np.zeros(shape)
        assert np.allclose(x.grad.numpy(), expected), f"broadcast gradient, root {root}"

    # alltoall: the upstream gradient of each received block goes back to its sender
    def sent(i: int, j: int) -> int:
        return (i + j) % 2 + 1

    x = torch.zeros((sum(sent(me, j) for j in ranks()), 2), dtype=torch.float64,
                    requires_grad=True)
    out, received = hvd.alltoall(x, [sent(me, j) for j in ranks()])
    received_rows = sum(sent(i, me) for i in ranks())
    out.backward(tensor_of(upstream((received_rows, 2), me, "a2a")))
    pieces = []
    for j in ranks():  # rank j's upstream rows that came from this rank
        theirs = upstream((sum(sent(i, j) for i in ranks()), 2), j, "a2a")
        offset = sum(sent(i, j) for i in range(me))
        pieces.append(theirs[offset:offset + sent(me, j)])
    assert np.allclose(x.grad.numpy(), np.concatenate(pieces)), "alltoall gradient"

    # reducescatter: the allgather of the upstream gradient, times the size for Sum
    rows = 2 * size
    for op, factor in ((hvd.Sum, size), (hvd.Average, 1)):
        x = torch.zeros((rows, 2), dtype=torch.float64, requires_grad=True)
        hvd.reducescatter(x, op=op).backward(tensor_of(upstream((2, 2), me, "rs")))
        gathered = np.concatenate([upstream((2, 2), r, "rs") for r in ranks()])
        assert np.allclose(x.grad.numpy(), gathered * factor), f"reducescatter {op.name}"


# --------------------------------------------------------------------------- handles, names

@check(min_size=2)
def poll_is_false_then_true():
    big = torch.ones(4 << 20, dtype=torch.float32)
    handle = hvd.allreduce_async(big, op=hvd.Sum, name="big")
    assert not hvd.poll(handle), "poll was True right after starting a 16 MB allreduce"
    result = hvd.synchronize(handle)
    assert hvd.poll(handle)
    assert float(result[0]) == hvd.size() and float(result[-1]) == hvd.size()


@check
def duplicate_name_in_flight_is_refused():
    big = torch.ones(1 << 20, dtype=torch.float32)
    first = hvd.allreduce_async(big, op=hvd.Sum, name="dup")
    expect_raises(ValueError, hvd.allreduce_async, big, op=hvd.Sum, name="dup",
                  match=[f"rank {hvd.rank()}: allreduce of tensor 'dup'", "in flight"])
    expect_raises(ValueError, hvd.allreduce, big, op=hvd.Sum, name="dup")
    # another collective may use the same name
    other = hvd.allgather_async(torch.ones(2), name="dup")
    assert float(hvd.synchronize(first)[0]) == hvd.size()
    assert tuple(hvd.synchronize(other).shape) == (2 * hvd.size(),)
    # completed: the name is free again
    again = hvd.allreduce_async(big, op=hvd.Sum, name="dup")
    assert float(hvd.synchronize(again)[7]) == hvd.size()


@check(min_size=2)
def mismatched_calls_fail_on_every_rank():
    me = hvd.rank()
    expect_raises(RuntimeError, hvd.allreduce, torch.ones(3 + me))
    expect_raises(RuntimeError, hvd.allreduce, torch.ones(3, dtype=torch.int32 if me % 2
                                                          else torch.float32))
    expect_raises(RuntimeError, hvd.allgather, torch.ones(2, 1 + me))
    expect_raises(RuntimeError, hvd.broadcast, torch.ones(4), me)
    expect_raises(RuntimeError, hvd.broadcast, torch.ones(2 + me), 0)
    expect_raises(RuntimeError, hvd.reducescatter, torch.ones(4, 1 + me))
    expect_raises(RuntimeError, hvd.alltoall, torch.ones(hvd.size(), dtype=torch.int32 if me % 2
                                                         else torch.float32))
    handle = hvd.allreduce_async(torch.ones(5 + me), name="mismatch")
    expect_raises(RuntimeError, hvd.synchronize, handle)
    # the library still works afterwards
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum)[0].item() == hvd.size()


# --------------------------------------------------------------------------- process sets

@check(min_size=2)
def process_sets_subsets():
    size, me = hvd.size(), hvd.rank()
    first = [r for r in ranks() if r % 2 == 0]  # {0, 2} at np=3: not contiguous
    second = [r for r in ranks() if r % 2 == 1]
    sets = [hvd.add_process_set(first), hvd.add_process_set(hvd.ProcessSet(second))]
    try:
        for members, process_set in zip((first, second), sets):
            assert process_set.size() == len(members)
            assert process_set.included() == (me in members)
        mine_members, mine = (first, sets[0]) if me in first else (second, sets[1])
        assert mine.rank() == mine_members.index(me)
        inputs = all_inputs(mine_members, (5,), np.float64, hvd.Sum, "ps")
        result = hvd.allreduce(tensor_of(inputs[mine.rank()]), op=hvd.Sum, process_set=mine)
        assert_reduced(result.numpy(), reduce_reference(inputs, hvd.Sum), np.float64, "ps sum")
        result = hvd.allreduce(tensor_of(np.array([3 * me + 1], np.int32)), op=hvd.Average,
                               process_set=mine)
        expected = truncated_mean(np.array([sum(3 * r + 1 for r in mine_members)]),
                                  len(mine_members))
        assert np.array_equal(result.numpy(), expected), (result, expected)
        gathered = hvd.allgather(torch.tensor([me]), process_set=mine)
        assert gathered.tolist() == mine_members
        root = mine_members[-1]
        result = hvd.broadcast(torch.tensor([me, me]), root, process_set=mine)
        assert result.tolist() == [root, root]
        expect_raises(ValueError, hvd.add_process_set, first)  # exists already
        expect_raises(ValueError, hvd.add_process_set, list(ranks()))  # the global set
        expect_raises(ValueError, hvd.add_process_set, [0, size])  # out of range
    finally:
        removed = [hvd.remove_process_set(s) for s in sets]
    assert removed == [True, True], removed
    assert hvd.remove_process_set(sets[0]) is False
    assert hvd.remove_process_set(hvd.global_process_set) is False
    # the same ranks can be added again once removed
    again = hvd.add_process_set(first)
    try:
        if me in first:
            assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=again).item() == \
                len(first)
    finally:
        assert hvd.remove_process_set(again)
    hvd.barrier()


@check(min_size=2)
def barrier_of_a_process_set():
    others = [r for r in ranks() if r != 0]
    process_set = hvd.add_process_set(others)
    try:
        if hvd.rank() in others:
            hvd.barrier(process_set=process_set)
        hvd.barrier()
    finally:
        hvd.remove_process_set(process_set)


# --------------------------------------------------------------------------- the rest

def sparse_input(rank: int, key: str) -> torch.Tensor:
    dense = make_input(rank, (6, 4), np.float32, None, "sparse", key)
    dense[np.abs(dense) < 0.6] = 0
    return torch.from_numpy(dense).to_sparse()


@check
def sparse_allreduce_sums_the_entries():
    dense = [sparse_input(r, "s").to_dense().numpy() for r in ranks()]
    for op in (hvd.Sum, hvd.Average):
        handle = hvd.sparse_allreduce_async(sparse_input(hvd.rank(), "s"), name=f"sp{op.name}",
                                            op=op)
        result = handle() if op is hvd.Sum else hvd.synchronize(handle)
        assert result.is_sparse, result
        assert_reduced(result.to_dense().numpy(), reduce_reference(dense, op), np.float32,
                       f"sparse {op.name}")
    expect_raises(ValueError, hvd.sparse_allreduce_async, sparse_input(0, "s"), "x", hvd.Max)


@check
def adasum_on_any_number_of_ranks():
    """CPU tensors on any number of ranks, as Horovod's CPU Adasum (the tree for a number
    that is not a power of two: see _harness.adasum_reference)."""
    size = hvd.size()
    inputs = all_inputs(ranks(), (3, 5), np.float32, None, "adasum")
    mine = tensor_of(inputs[hvd.rank()])
    expected = adasum_reference(inputs)
    result = hvd.allreduce(mine, op=hvd.Adasum)
    assert_reduced(assert_tensor(result, np.float32, (3, 5), "adasum"), expected, np.float32,
                   "adasum")
    tensor = tensor_of(inputs[hvd.rank()])
    hvd.synchronize(hvd.allreduce_async_(tensor, op=hvd.Adasum))
    assert torch.equal(tensor, result), "adasum in place"
    # identical vectors: adasum(a, a) = a, so the result is each rank's (same) input
    same = torch.full((4,), 2.5, dtype=torch.float64)
    assert torch.allclose(hvd.allreduce(same, op=hvd.Adasum), same)
    # orthogonal vectors add up
    unit = torch.zeros(size, dtype=torch.float64)
    unit[hvd.rank()] = 1.0
    assert torch.allclose(hvd.allreduce(unit, op=hvd.Adasum), torch.ones(size, dtype=torch.float64))
    digests = Digests()
    digests.add("adasum", result.numpy())
    digests.verify()
    expect_raises(ValueError, hvd.allreduce, torch.ones(3, dtype=torch.int32), op=hvd.Adasum)
    # grouped: each tensor with its own coefficients, as Horovod's fused Adasum
    second = all_inputs(ranks(), (7,), np.float64, None, "adasum-grouped")
    grouped = hvd.grouped_allreduce([mine, tensor_of(second[hvd.rank()])], op=hvd.Adasum)
    assert_reduced(grouped[0].numpy(), expected, np.float32, "grouped adasum 0")
    assert_reduced(grouped[1].numpy(), adasum_reference(second), np.float64,
                   "grouped adasum 1")


@check
def join_contributes_zeros():
    size, me = hvd.size(), hvd.rank()
    steps = me + 1  # rank r runs out of data after r + 1 steps
    for step in range(steps):
        value = torch.full((3,), float(me + 1), dtype=torch.float64)
        summed = hvd.allreduce(value, op=hvd.Sum, name="join.sum")
        active = [r for r in ranks() if r + 1 > step]
        assert summed.tolist() == [float(sum(r + 1 for r in active))] * 3, (step, summed)
        averaged = hvd.allreduce(torch.tensor([4 * me + 3], dtype=torch.int32),
                                 op=hvd.Average, name="join.avg")
        expected = int(sum(4 * r + 3 for r in active) / size)
        assert averaged.item() == expected, (step, averaged, expected)
    last = hvd.join()
    assert last == size - 1, last
    everyone = WORLD.allgather(last)
    assert everyone == [size - 1] * size, everyone


@check
def basics():
    assert hvd.is_initialized()
    assert hvd.rank() == WORLD.Get_rank() and hvd.size() == WORLD.Get_size()
    assert 0 <= hvd.local_rank() < hvd.local_size() and 0 <= hvd.cross_rank() < hvd.cross_size()
    assert hvd.mpi_built() and hvd.mpi_enabled()
    assert not hvd.gloo_built() and not hvd.gloo_enabled() and hvd.nccl_built() == 0
    assert not (hvd.ddl_built() or hvd.ccl_built() or hvd.rocm_built() or hvd.cuda_built())
    assert isinstance(hvd.mpi_threads_supported(), bool)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.HorovodInternalError is hvd.elastic.HorovodInternalError
    assert len({id(op) for op in (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max,
                                  hvd.Product)}) == 6
    assert hvd.global_process_set.size() == hvd.size()


@check
def timeline_of_rank_zero():
    directory = WORLD.bcast(tempfile.mkdtemp() if hvd.rank() == 0 else None)
    path = os.path.join(directory, f"timeline{hvd.size()}.json")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="tl")
    hvd.stop_timeline()
    WORLD.Barrier()
    problems = []
    if hvd.rank() == 0:
        with open(path) as file:
            text = file.read()
        os.remove(path)
        json.loads(text)
        problems = [f"{word} not in the timeline" for word in (
            "allreduce.tl", "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"', "CYCLE_START",
            "start_time_since_epoch_in_micros") if word not in text]
        if os.listdir(directory):  # the other ranks write no timeline
            problems.append(f"other files were written: {os.listdir(directory)}")
    WORLD.Barrier()
    if hvd.rank() == 0:
        for name in os.listdir(directory):
            os.remove(os.path.join(directory, name))
        os.rmdir(directory)
    assert not problems, problems


if __name__ == "__main__":
    main()
