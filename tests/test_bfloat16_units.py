"""bfloat16 in the collectives, without ranks: the buffer adapter (torch CPU tensors as
numpy bfloat16 arrays and back), the checks, the signature, the finishing step, where
reductions run, and the benchmark's options. The collectives themselves run in
tests/mpi/bfloat16.py."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.collectives import UnsupportedDtypeError
from ringtrain.collectives.agreement._call import Call
from ringtrain.collectives.base._buffers import results_like, returns_itself, torch_view
from ringtrain.collectives.base._checks import (active_compressor, check_reduction, in_place_array,
                                                input_array)
from ringtrain.collectives.base._finishing import finisher
from ringtrain.collectives.memory._memory import HOST, MPI_CANNOT_REDUCE
from ringtrain.collectives.base._ops import COPY_DTYPES, REDUCE_DTYPES, ReduceOp
from ringtrain.collectives.bench import cases
from ringtrain.collectives.bench.options import parse_options
from ringtrain.kernels import BFLOAT16, Compression

BF16 = BFLOAT16


def test_bfloat16_is_reduced_and_moved():
    assert BF16 in REDUCE_DTYPES and BF16 in COPY_DTYPES
    assert str(BF16) == "bfloat16"
    for op in ReduceOp:
        check_reduction(np.zeros(3, BF16), op, "x", 0.5, 2.0, "allreduce")


def test_torch_cpu_bfloat16_tensors_are_numpy_bfloat16_views():
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    array = input_array(tensor, "allreduce", "t")
    assert array.dtype == BF16 and array.shape == (2, 3)
    assert array.astype(np.float32).tolist() == [[0, 1, 2], [3, 4, 5]]
    array[1, 2] = 7.5  # the tensor's own memory
    assert tensor[1, 2].item() == 7.5
    transposed = in_place_array(tensor.t(), "allreduce_", "t")
    assert transposed.shape == (3, 2) and not transposed.flags.c_contiguous
    transposed[0, 1] = -2.0
    assert tensor[1, 0].item() == -2.0
    zero_d = torch_view(torch.tensor(1.25, dtype=torch.bfloat16), "allreduce", "s")
    assert zero_d.shape == () and float(zero_d) == 1.25


def test_results_come_back_as_torch_bfloat16_tensors():
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(2, dtype=torch.bfloat16)
    restore = results_like(tensor)
    result = restore(np.array([1.5, -3.0], BF16))
    assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16
    assert result.tolist() == [1.5, -3.0]
    received, splits = restore((np.array([[0.5]], BF16), np.array([1, 0], np.int64)))
    assert received.dtype == torch.bfloat16 and splits.dtype == torch.int64
    listed = results_like([tensor])([np.ones(1, BF16), np.ones(2, np.float32)])
    assert [t.dtype for t in listed] == [torch.bfloat16, torch.float32]
    assert returns_itself(tensor)(None) is tensor


def test_fp16_compression_of_bfloat16_is_refused_and_bf16_changes_nothing():
    with pytest.raises(UnsupportedDtypeError, match="'g'.*fp16.*bfloat16"):
        active_compressor(Compression.fp16, BF16, ReduceOp.Sum, "allreduce", "g")
    assert active_compressor(Compression.bf16, BF16, ReduceOp.Sum, "allreduce", "g") is None
    assert not Compression.bf16.applies_to(BF16) and not Compression.fp16.applies_to(BF16)
    values = np.ones(3, BF16)
    wire, context = Compression.bf16.compress(values)
    assert wire is values and Compression.bf16.decompress(wire, context) is values


def test_the_signature_tells_bfloat16_from_float16():
    calls = [Call(collective="allreduce", name="w", dtype=np.dtype(dtype), shape=(3,))
             for dtype in (BF16, np.float16, np.float32)]
    assert len({call.signature for call in calls}) == 3
    assert str(calls[0].fields["dtype"]) == "bfloat16"


def test_bfloat16_reductions_run_in_host_memory_and_travel_as_bits():
    assert BF16 in MPI_CANNOT_REDUCE and np.dtype(np.float16) in MPI_CANNOT_REDUCE
    assert np.dtype(np.float32) not in MPI_CANNOT_REDUCE
    values = np.array([1.0, 2.0], BF16)
    assert HOST.for_mpi(values).dtype == np.uint16
    assert HOST.for_mpi(values, np.uint8).nbytes == 4


def test_the_finisher_divides_and_scales_bfloat16_and_its_bits():
    finish = finisher(3, 2.0, BF16)
    values = np.array([3.0, 1.0, -6.0], BF16)
    finish(values.view(np.uint16))
    want = (np.array([3.0, 1.0, -6.0]) / 3).astype(np.float32).astype(BF16)
    want = (want.astype(np.float32) * np.float32(2.0)).astype(BF16)
    assert values.view(np.uint16).tolist() == want.view(np.uint16).tolist()
    finish(values)
    assert values.dtype == BF16
    assert finisher(1, 1.0, BF16) is None


def test_the_benchmark_takes_bfloat16():
    for name in ("bfloat16", "bf16"):
        assert parse_options(["allreduce", "-d", name, "-o", "avg"]).dtype == BF16
    assert not cases.native_runs(parse_options(["allreduce", "-d", "bf16"]))
    assert not cases.native_runs(parse_options(["reducescatter", "-d", "bf16"]))
    assert cases.native_runs(parse_options(["broadcast", "-d", "bf16"]))
    assert cases.native_runs(parse_options(["allreduce", "-d", "half"]))
    assert cases.check_input(1, 10, BF16, "sum").dtype == BF16
    with pytest.raises(SystemExit):
        parse_options(["allreduce", "-d", "bf16", "--device", "cuda"])
    with pytest.raises(SystemExit):
        parse_options(["allreduce", "-d", "bf16", "--compression", "bf16"])
