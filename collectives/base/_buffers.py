"""The caller's tensors and the collectives' buffers: the one module that knows where
memory lives.

Host tensors are numpy arrays and torch CPU tensors; the collectives work on numpy
arrays, over a torch tensor's memory when given one (no copy), and return torch tensors
over their numpy results (no copy either); an in-place call returns the caller's own
tensor.

Device tensors are torch CUDA tensors, CuPy arrays, numba device arrays and any other
object exposing ``__cuda_array_interface__``. :func:`device_tensor` describes one; a
collective's result is a new tensor of the same kind on the same device (numba device
arrays for objects of other kinds). torch and CuPy are never imported here: a tensor
can only exist once the caller has imported its library.

bfloat16 is numpy's ``ml_dtypes.bfloat16`` (``kernels.BFLOAT16``). numpy cannot hold a
torch bfloat16 tensor and torch's ``__cuda_array_interface__`` refuses it, so both go
through torch's int16 view of the same memory: a CPU tensor as a numpy int16 array seen
as bfloat16, a CUDA tensor as :class:`TorchBfloat16Memory`. Other device arrays are
bfloat16 when numpy maps their interface's typestr to it (``"bfloat16"``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernels.dtypes import BFLOAT16, BFLOAT16_TYPESTR
from ..errors import InvalidArgumentError, UnsupportedDtypeError, subject

Restore = Callable[[Any], Any]


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (torch already imported by the caller)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_cupy_array(value: Any) -> bool:
    """Whether ``value`` is a CuPy array (CuPy already imported by the caller)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def torch_view(tensor: Any, collective: str, name: str | None) -> np.ndarray:
    """A numpy array over a torch CPU tensor's memory (bfloat16 as ``ml_dtypes.bfloat16``).

    Raises:
        UnsupportedDtypeError: a tensor on a device other than the CPU or a CUDA GPU, or
            of a dtype neither numpy nor ringtrain has (complex32, float8, ...).
    """
    if not tensor.is_cpu:
        raise UnsupportedDtypeError(
            f"{subject(collective, name)}: the tensor is on {tensor.device}; the "
            f"collectives take CPU and CUDA tensors")
    detached = tensor.detach() if tensor.requires_grad else tensor
    torch = sys.modules["torch"]
    if detached.dtype is torch.bfloat16:
        return detached.view(torch.int16).numpy().view(BFLOAT16)
    try:
        return detached.numpy()
    except TypeError:
        raise UnsupportedDtypeError(
            f"{subject(collective, name)}: dtype {tensor.dtype} is not supported") from None


class TorchBfloat16Memory:
    """A torch bfloat16 CUDA tensor's memory as the kernels and MPI take it: torch's
    ``__cuda_array_interface__`` refuses bfloat16, so this one is its int16 view's, with
    the typestr ``bfloat16``.

    Attributes:
        tensor: the bfloat16 tensor (contiguous).
    """

    def __init__(self, tensor: Any):
        self.tensor = tensor
        self._bits = tensor.view(sys.modules["torch"].int16)

    @property
    def __cuda_array_interface__(self) -> dict:
        return dict(self._bits.__cuda_array_interface__, typestr=BFLOAT16_TYPESTR)


@dataclass(frozen=True)
class DeviceTensor:
    """A tensor of the caller's in GPU memory.

    Attributes:
        owner: what the caller passed (returned as is by in-place calls).
        memory: an object exposing ``__cuda_array_interface__`` over the same memory,
            C-contiguous (for torch, the detached tensor).
        kind: ``torch``, ``cupy`` or ``numba``: the type of the results.
        shape: the tensor's shape.
        dtype: its numpy dtype.
        device: the ordinal of its GPU.
        wait_for_producer: waits until the stream that produced the tensor, as it was
            current when the call was made, has finished its work.
    """

    owner: Any
    memory: Any
    kind: str
    shape: tuple[int, ...]
    dtype: np.dtype
    device: int
    wait_for_producer: Callable[[], None]

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        """Number of bytes."""
        return self.size * self.dtype.itemsize

    def new(self, shape: Sequence[int], dtype: Any = None) -> Any:
        """A new uninitialised tensor of this kind on this device (for torch bfloat16, its
        :class:`TorchBfloat16Memory`: results pass through :func:`results_like`)."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if self.kind == "torch":
            torch = sys.modules["torch"]
            if dtype == BFLOAT16:
                return TorchBfloat16Memory(torch.empty(tuple(shape), dtype=torch.bfloat16,
                                                       device=self.owner.device))
            torch_dtype = torch.from_numpy(np.empty(0, dtype)).dtype
            return torch.empty(tuple(shape), dtype=torch_dtype, device=self.owner.device)
        if self.kind == "cupy":
            cupy = sys.modules["cupy"]
            with cupy.cuda.Device(self.device):
                return cupy.empty(tuple(shape), dtype)
        from ...kernels import device
        with device.on_device(self.device):
            return device.empty(shape, dtype)


def device_tensor(tensor: Any, collective: str, name: str | None,
                  in_place: bool = False) -> DeviceTensor | None:
    """Describe ``tensor`` if it lives in GPU memory; None for host tensors.

    A non-contiguous torch or CuPy input is copied first (on its device); an in-place
    call needs a contiguous tensor.

    Raises:
        InvalidArgumentError: a non-contiguous device tensor that cannot be copied
            (in place, or of another kind).
        UnsupportedDtypeError: a torch dtype neither numpy nor ringtrain has.
    """
    if isinstance(tensor, np.ndarray):
        return None
    if is_torch_tensor(tensor):
        if tensor.device.type != "cuda":
            return None
        return _torch_tensor(tensor, collective, name, in_place)
    if is_cupy_array(tensor):
        return _cupy_array(tensor, collective, name, in_place)
    if hasattr(tensor, "__cuda_array_interface__") or _is_simulated_device_array(tensor):
        return _interface_array(tensor, collective, name)
    return None


def _torch_tensor(tensor: Any, collective: str, name: str | None,
                  in_place: bool) -> DeviceTensor:
    torch = sys.modules["torch"]
    memory = tensor.detach()
    if not memory.is_contiguous():
        _refuse_non_contiguous(in_place, collective, name)
        memory = memory.contiguous()
    if memory.dtype is torch.bfloat16:
        exposed, dtype = TorchBfloat16Memory(memory), BFLOAT16
    else:
        try:
            exposed = memory
            dtype = np.dtype(memory.__cuda_array_interface__["typestr"])
        except TypeError:
            raise UnsupportedDtypeError(
                f"{subject(collective, name)}: dtype {tensor.dtype} is not supported"
            ) from None
    stream = torch.cuda.current_stream(tensor.device)
    return DeviceTensor(tensor, exposed, "torch", tuple(memory.shape), dtype,
                        tensor.device.index, stream.synchronize)


def _cupy_array(array: Any, collective: str, name: str | None,
                in_place: bool) -> DeviceTensor:
    cupy = sys.modules["cupy"]
    memory = array
    if not array.flags.c_contiguous:
        _refuse_non_contiguous(in_place, collective, name)
        with array.device:
            memory = cupy.ascontiguousarray(array)
    stream = cupy.cuda.get_current_stream()
    return DeviceTensor(array, memory, "cupy", tuple(array.shape), np.dtype(array.dtype),
                        array.device.id, stream.synchronize)


def _interface_array(array: Any, collective: str, name: str | None) -> DeviceTensor:
    from ...kernels import device
    try:
        dtype = device.dtype_of(array)
        shape = tuple(device._described(array).shape)
        device.byte_view(array)  # checks that the memory is one contiguous block
    except ValueError as error:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: the device array cannot be used: {error}"
        ) from None
    return DeviceTensor(array, array, "numba", shape, dtype, device.current_device(),
                        lambda: device.wait_for_producer(array))


def _refuse_non_contiguous(in_place: bool, collective: str, name: str | None) -> None:
    if in_place:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: works in place and needs a contiguous "
            f"tensor; this one has strides (call .contiguous() first)")


def _is_simulated_device_array(value: Any) -> bool:
    """The CUDA simulator's arrays (host memory posing as device memory)."""
    if not isinstance(getattr(value, "_ary", None), np.ndarray):
        return False
    from ...kernels import device
    return device.SIMULATED


def results_like(tensor: Any) -> Restore | None:
    """How an out-of-place call returns its results to a caller who passed ``tensor``
    (or a list of them): None for numpy and device tensors, torch tensors for torch."""
    if isinstance(tensor, np.ndarray):
        return None
    first = tensor[0] if isinstance(tensor, Sequence) and len(tensor) else tensor
    return _as_torch if is_torch_tensor(first) else None


def returns_itself(tensor: Any) -> Restore | None:
    """How an in-place call returns: the caller's own tensor (or list of them)."""
    if isinstance(tensor, np.ndarray):
        return None
    first = tensor[0] if isinstance(tensor, Sequence) and len(tensor) else tensor
    if not is_torch_tensor(first):
        return None
    same = list(tensor) if isinstance(tensor, Sequence) else tensor
    return lambda _: same


def torch_from_host(array: np.ndarray) -> Any:
    """A torch CPU tensor over a host array's memory (no copy); ``ml_dtypes.bfloat16``
    arrays become bfloat16 tensors."""
    torch = sys.modules["torch"]
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _as_torch(result: Any) -> Any:
    if isinstance(result, np.ndarray):
        return torch_from_host(result)
    if isinstance(result, TorchBfloat16Memory):
        return result.tensor
    if isinstance(result, (list, tuple)):
        return type(result)(_as_torch(item) for item in result)
    return result
