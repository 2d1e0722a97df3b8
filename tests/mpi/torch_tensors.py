"""Every collective with torch CPU tensors: the same results as with numpy arrays,
returned as torch tensors (in-place calls return the caller's own tensor).

Run: mpiexec -n K python tests/mpi/torch_tensors.py [--only SUBSTRING]
"""

from __future__ import annotations

import numpy as np
import torch

import ringtrain as rt
from _harness import (COPY_DTYPES, REDUCE_DTYPES, all_inputs, assert_reduced, check,
                      expect_raises, main, make_input, reduce_reference)

SHAPES = [(), (0,), (5,), (3, 7)]


def as_torch(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array.copy())


def assert_tensor(result, dtype: np.dtype, shape: tuple[int, ...], what: str) -> None:
    assert isinstance(result, torch.Tensor), f"{what}: got {type(result).__name__}"
    assert result.numpy().dtype == dtype and tuple(result.shape) == shape, \
        f"{what}: {result.dtype} {tuple(result.shape)}, expected {dtype} {shape}"


@check
def allreduce_forms():
    ranks = range(rt.size())
    for dtype in REDUCE_DTYPES:
        for op in (rt.Sum, rt.Max) if dtype.kind != "f" else (rt.Sum, rt.Average, rt.Max):
            for shape in SHAPES:
                key = ("torch allreduce", op.name)
                expected = reduce_reference(all_inputs(ranks, shape, dtype, op, *key), op)
                mine = make_input(rt.rank(), shape, dtype, op, *key)
                what = f"{dtype} {op.name} {shape}"
                result = rt.allreduce(as_torch(mine), op=op, name="t")
                assert_tensor(result, dtype, shape, what)
                assert_reduced(result.numpy(), expected, dtype, what)
                tensor = as_torch(mine)
                assert rt.allreduce_(tensor, op=op, name="t") is tensor, what
                assert_reduced(tensor.numpy(), expected, dtype, what + " in place")
                handle = rt.allreduce_async(as_torch(mine), op=op, name="t")
                assert_reduced(rt.synchronize(handle).numpy(), expected, dtype, what + " async")
                tensor = as_torch(mine)
                assert rt.synchronize(rt.allreduce_async_(tensor, op=op, name="t")) is tensor
                assert_reduced(tensor.numpy(), expected, dtype, what + " async in place")


@check
def grouped_allreduce_of_tensors():
    ranks = range(rt.size())
    dtypes = [np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.float32)]
    shapes = [(4,), (2, 3), (7,)]
    mine = [make_input(rt.rank(), s, d, rt.Sum, "grouped", i)
            for i, (s, d) in enumerate(zip(shapes, dtypes))]
    expected = [reduce_reference(all_inputs(ranks, s, d, rt.Sum, "grouped", i), rt.Sum)
                for i, (s, d) in enumerate(zip(shapes, dtypes))]
    results = rt.grouped_allreduce([as_torch(m) for m in mine], op=rt.Sum, name="g")
    tensors = [as_torch(m) for m in mine]
    same = rt.grouped_allreduce_(tensors, op=rt.Sum, name="g")
    assert all(a is b for a, b in zip(same, tensors))
    cases = zip(results, tensors, expected, dtypes, shapes)
    for result, tensor, reference, dtype, shape in cases:
        assert_tensor(result, dtype, shape, "grouped")
        assert_reduced(result.numpy(), reference, dtype, "grouped")
        assert_reduced(tensor.numpy(), reference, dtype, "grouped in place")


@check
def broadcast_from_every_root():
    for dtype in COPY_DTYPES:
        for root in range(rt.size()):
            data = make_input(root, (3, 5), dtype, None, "torch broadcast")
            mine = data if rt.rank() == root else np.zeros((3, 5), dtype)
            result = rt.broadcast(as_torch(mine), root_rank=root, name="b")
            assert_tensor(result, dtype, (3, 5), f"broadcast {dtype}")
            assert np.array_equal(result.numpy(), data)
            tensor = as_torch(mine)
            assert rt.broadcast_(tensor, root_rank=root, name="b") is tensor
            assert np.array_equal(tensor.numpy(), data)


@check
def allgather_alltoall_reducescatter():
    k, me = rt.size(), rt.rank()
    rows = [r + 1 for r in range(k)]
    pieces = [make_input(r, (rows[r], 2), np.dtype(np.float32), None, "gather") for r in range(k)]
    gathered = rt.allgather(as_torch(pieces[me]), name="a")
    assert_tensor(gathered, np.dtype(np.float32), (sum(rows), 2), "allgather")
    assert np.array_equal(gathered.numpy(), np.concatenate(pieces))

    splits = [1 + (me + j) % 2 for j in range(k)]
    data = np.arange(sum(splits) * 3, dtype=np.int32).reshape(-1, 3) + 1000 * me
    received, received_splits = rt.alltoall(as_torch(data), splits=splits, name="x")
    assert_tensor(received, np.dtype(np.int32), (int(received_splits.sum()), 3), "alltoall")
    assert isinstance(received_splits, torch.Tensor)
    assert received_splits.tolist() == [1 + (j + me) % 2 for j in range(k)]

    inputs = all_inputs(range(k), (2 * k + 1, 3), np.dtype(np.float64), rt.Sum, "scatter")
    result = rt.reducescatter(as_torch(inputs[me]), op=rt.Sum, name="s")
    reference = np.array_split(reduce_reference(inputs, rt.Sum), k)[me]
    assert_tensor(result, np.dtype(np.float64), reference.shape, "reducescatter")
    assert_reduced(result.numpy(), reference, np.dtype(np.float64), "reducescatter")


@check
def views_and_tensors_that_need_gradients():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rt.rank() + 1)
    transposed = base.t()
    rt.allreduce_(transposed, op=rt.Sum, name="view")
    total = sum(range(1, rt.size() + 1))
    assert torch.equal(base, torch.arange(12, dtype=torch.float32).reshape(3, 4) * total)
    weights = torch.ones(5, requires_grad=True)
    summed = rt.allreduce(weights, op=rt.Sum, name="w")
    assert torch.equal(summed, torch.full((5,), float(rt.size())))


@check
def unsupported_tensors_are_refused_before_communication():
    """bfloat16 is supported (tests/mpi/bfloat16.py); dtypes neither numpy nor ringtrain
    has are refused by name."""
    expect_raises(rt.UnsupportedDtypeError, rt.allreduce, torch.ones(3, dtype=torch.complex32),
                  name="b", match=[f"rank {rt.rank()}: allreduce of tensor 'b'",
                                   "torch.complex32 is not supported"])
    expect_raises(rt.UnsupportedDtypeError, rt.allreduce, torch.ones(3, dtype=torch.uint16),
                  name="s", match=["uint16"])


if __name__ == "__main__":
    rt.init()
    main()
