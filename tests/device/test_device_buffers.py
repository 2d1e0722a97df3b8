"""The buffer adapter and the staging helpers on device arrays (no MPI ranks needed).

Under the simulator the device arrays are the simulator's and objects exposing
``__cuda_array_interface__`` over host memory; on a GPU, numba device arrays, and torch
CUDA tensors and CuPy arrays when those libraries are installed.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.collectives import InvalidArgumentError
from ringtrain.collectives.base._buffers import TorchBfloat16Memory, device_tensor
from ringtrain.collectives.memory._device_memory import MPIMemory
from ringtrain.collectives.memory._staging import PinnedPool, host_array, to_device
from ringtrain.kernels import BFLOAT16


ON_SIMULATOR = "needs a real GPU: the simulator has no"


class InterfaceObject:
    """A bare ``__cuda_array_interface__`` over ``values`` copied to the device: over host
    memory under the simulator (where that is device memory), else over a numba array's."""

    def __init__(self, values: np.ndarray, device_mode: str, strides=None):
        if device_mode == "simulator":
            self.keep = values
            address = values.ctypes.data
        else:
            from numba import cuda
            self.keep = cuda.to_device(values.view(np.uint16) if values.dtype == BFLOAT16
                                       else values)
            address = self.keep.__cuda_array_interface__["data"][0]
        shape = values.shape if strides is None else (values.shape[0] // 2,)
        # bfloat16's own typestr ("<V2") means raw bytes; its name maps back to bfloat16
        typestr = "bfloat16" if values.dtype == BFLOAT16 else values.dtype.str
        self.__cuda_array_interface__ = {
            "version": 3, "data": (address, False), "shape": shape,
            "typestr": typestr, "strides": strides, "stream": None}


def test_host_tensors_are_not_device_tensors():
    assert device_tensor(np.zeros(3), "allreduce", "x") is None
    torch = pytest.importorskip("torch")
    assert device_tensor(torch.zeros(3), "allreduce", "x") is None


def test_a_numba_array_is_described_and_results_are_numba_arrays(cuda):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    array = cuda.to_device(values)
    described = device_tensor(array, "allreduce", "w")
    assert (described.kind, described.shape, described.dtype) == ("numba", (3, 4), np.float32)
    assert (described.size, described.nbytes) == (12, 48)
    assert described.owner is array
    described.wait_for_producer()
    new = described.new((5,), np.int16)
    assert type(new) is type(array) and new.shape == (5,) and new.dtype == np.int16


def test_bare_interface_objects_come_back_as_numba_arrays(device_mode):
    values = np.arange(6, dtype=np.int32)
    described = device_tensor(InterfaceObject(values, device_mode), "broadcast", "ids")
    assert (described.kind, described.shape, described.dtype) == ("numba", (6,), np.int32)
    back = to_device(described, values * 2)
    assert np.array_equal(back.copy_to_host(), values * 2)


def test_a_strided_interface_object_is_refused_by_name(device_mode):
    strided = InterfaceObject(np.zeros(8, np.float32), device_mode, strides=(8,))
    with pytest.raises(InvalidArgumentError, match="'grads'.*contiguous"):
        device_tensor(strided, "allreduce", "grads")


def test_torch_cuda_tensors(device_mode):
    if device_mode != "gpu":
        pytest.skip(f"{ON_SIMULATOR} torch CUDA tensors")
    torch = pytest.importorskip("torch")
    tensor = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    described = device_tensor(tensor, "allreduce", "t")
    assert (described.kind, described.shape, described.dtype) == ("torch", (3, 4), np.float32)
    assert described.device == tensor.device.index
    result = described.new((2,))
    assert isinstance(result, torch.Tensor) and result.device == tensor.device
    transposed = device_tensor(tensor.t(), "allreduce", "t")
    assert transposed.memory.is_contiguous() and transposed.shape == (4, 3)
    with pytest.raises(InvalidArgumentError, match="'t'.*contiguous"):
        device_tensor(tensor.t(), "allreduce_", "t", in_place=True)
    bfloat = device_tensor(tensor.to(torch.bfloat16), "allreduce", "b")
    assert (bfloat.kind, bfloat.shape, bfloat.dtype) == ("torch", (3, 4), BFLOAT16)
    assert bfloat.memory.__cuda_array_interface__["typestr"] == "bfloat16"
    made = bfloat.new((2,))
    assert isinstance(made, TorchBfloat16Memory) and made.tensor.dtype == torch.bfloat16
    assert made.__cuda_array_interface__["shape"] == (2,)


def test_bfloat16_interface_objects_and_results(device, device_mode):
    """An interface whose typestr numpy maps to bfloat16 is a bfloat16 tensor; results are
    ringtrain's bfloat16 device arrays, and MPI sees their bits as uint16."""
    values = (np.arange(6) - 2.5).astype(BFLOAT16)
    described = device_tensor(InterfaceObject(values, device_mode), "allreduce", "bf")
    assert (described.kind, described.shape, described.dtype) == ("numba", (6,), BFLOAT16)
    assert described.nbytes == 12
    back = to_device(described, values * 2)
    assert isinstance(back, device.BfloatDeviceArray) and back.shape == (6,)
    assert np.array_equal(back.copy_to_host().view(np.uint16), (values * 2).view(np.uint16))
    face = MPIMemory(back).__cuda_array_interface__
    assert (face["shape"], face["typestr"]) == ((6,), np.dtype(np.uint16).str)
    again = device_tensor(back, "allreduce", "bf")
    assert (again.kind, again.dtype) == ("numba", BFLOAT16)
    if device_mode == "simulator":  # the simulator's arrays can hold bfloat16 host memory
        from numba import cuda
        simulated = device_tensor(cuda.to_device(values), "allreduce", "bf")
        assert (simulated.kind, simulated.dtype) == ("numba", BFLOAT16)


def test_cupy_arrays(device_mode):
    if device_mode != "gpu":
        pytest.skip(f"{ON_SIMULATOR} CuPy arrays")
    cupy = pytest.importorskip("cupy")
    array = cupy.arange(10, dtype=cupy.float64)[::2]
    described = device_tensor(array, "allgather", "c")
    assert (described.kind, described.shape, described.dtype) == ("cupy", (5,), np.float64)
    assert described.memory.flags.c_contiguous
    assert isinstance(described.new((3,)), cupy.ndarray)
    with pytest.raises(InvalidArgumentError, match="'c'.*contiguous"):
        device_tensor(array, "broadcast_", "c", in_place=True)


def test_mpi_sees_device_memory_through_the_interface(cuda, device):
    array = cuda.to_device(np.arange(10, dtype=np.float64))
    face = MPIMemory(array).__cuda_array_interface__
    assert face["data"] == (device.address_of(array), False)
    assert (face["shape"], face["typestr"]) == ((10,), np.dtype(np.float64).str)
    assert MPIMemory(array, np.uint8).__cuda_array_interface__["shape"] == (80,)


def test_the_pinned_pool_reuses_buffers_by_size_class(device_mode):
    pool = PinnedPool(per_class=1)
    first = pool.take(5000)
    assert first.nbytes == 8192 and first.dtype == np.uint8
    pool.give(first)
    assert pool.take(6000) is first
    second, third = pool.take(8192), pool.take(100)
    assert second is not first and third.nbytes == 4096
    pool.give(first)
    pool.give(second)  # one free buffer per class is kept: this one is dropped
    assert pool.take(8000) is first and pool.take(8000) is not second
    large = PinnedPool(largest_kept=8192)
    big = large.take(8193)
    large.give(big)
    assert large.take(8193) is not big
    shaped = host_array(first, (2, 3), np.dtype(np.float32))
    assert shaped.shape == (2, 3) and np.shares_memory(shaped, first)
