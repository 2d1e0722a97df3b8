"""GPU buffers for ``--device cuda``: the library that makes them, and the copies between
them and host memory.

CuPy, torch and numba's CUDA module are imported only by :func:`open_device`, which
``--device cuda`` calls; a CPU run never imports them. numba's device arrays are made
through :mod:`ringtrain.kernels.device`, ringtrain's one module that imports
``numba.cuda``. Under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1`` before numba is
imported) numba's arrays live in host memory and are the only device arrays the
collectives take there, so the simulator uses numba whatever the library asked for
(``auto``), and refuses CuPy and torch by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels.dtypes import BFLOAT16

LIBRARIES = ("auto", "cupy", "torch", "numba")
"""``--device-library`` choices; ``auto`` takes CuPy if it sees a GPU, else numba."""

LIBRARY_NAMES = {"cupy": "CuPy", "torch": "torch", "numba": "numba"}


class NoDevice(Exception):
    """No usable CUDA device through the library asked for (the message says why, in
    one line)."""


class DeviceArrays:
    """Device arrays of one library on this rank's GPU.

    Attributes:
        library: ``cupy``, ``torch`` or ``numba``.
        description: what the arrays are and where, for the report's header.
        simulated: True under numba's CUDA simulator (host memory behind the arrays).
    """

    library = ""

    def __init__(self, module: Any, description: str, simulated: bool = False):
        self.module = module
        self.description = description
        self.simulated = simulated

    def from_host(self, values: np.ndarray) -> Any:
        """A new device array holding a copy of ``values`` (same shape and dtype)."""
        raise NotImplementedError

    def copy_from_host(self, values: np.ndarray, target: Any) -> None:
        """Overwrite the device array ``target`` with ``values`` (same shape and dtype)."""
        raise NotImplementedError

    def to_host(self, array: Any) -> np.ndarray:
        """A numpy copy of the device array ``array`` (once its pending work is done)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until all work queued on this rank's GPU is done."""
        raise NotImplementedError

    def bytes_of(self, array: Any) -> Any:
        """The device array ``array`` (C-contiguous) as one of bytes over its memory."""
        return array.view(self.module.uint8)


class CupyArrays(DeviceArrays):
    """``cupy.ndarray`` buffers on CuPy's current device and stream."""

    library = "cupy"

    def from_host(self, values: np.ndarray) -> Any:
        """A new CuPy array holding a copy of ``values``."""
        return self.module.array(values)

    def copy_from_host(self, values: np.ndarray, target: Any) -> None:
        """``target.set(values)``."""
        target.set(values)

    def to_host(self, array: Any) -> np.ndarray:
        """``array.get()``."""
        return array.get()

    def synchronize(self) -> None:
        """Synchronise the current device."""
        self.module.cuda.Device().synchronize()


class TorchArrays(DeviceArrays):
    """CUDA tensors on torch's current device."""

    library = "torch"

    def from_host(self, values: np.ndarray) -> Any:
        """``torch.from_numpy(values)`` copied to the current CUDA device."""
        return self._tensor(values).to(device="cuda")

    def copy_from_host(self, values: np.ndarray, target: Any) -> None:
        """``target.copy_(torch.from_numpy(values))``."""
        target.copy_(self._tensor(values))

    def to_host(self, array: Any) -> np.ndarray:
        """``array.cpu().numpy()`` (bfloat16 through its int16 view)."""
        host = array.detach().cpu()
        if host.dtype is self.module.bfloat16:
            return host.view(self.module.int16).numpy().view(BFLOAT16)
        return host.numpy()

    def _tensor(self, values: np.ndarray) -> Any:
        """A CPU tensor over ``values`` (bfloat16 through its int16 view)."""
        values = np.ascontiguousarray(values)
        if values.dtype == BFLOAT16:
            return self.module.from_numpy(values.view(np.int16)).view(self.module.bfloat16)
        return self.module.from_numpy(values)

    def synchronize(self) -> None:
        """``torch.cuda.synchronize()``."""
        self.module.cuda.synchronize()


class NumbaArrays(DeviceArrays):
    """numba device arrays (``cuda.to_device``), on a GPU or under the simulator."""

    library = "numba"

    def from_host(self, values: np.ndarray) -> Any:
        """``cuda.to_device(values)``; bfloat16, which numba lacks, as ringtrain's
        :class:`~ringtrain.kernels.device.BfloatDeviceArray`."""
        values = np.ascontiguousarray(values)
        if values.dtype == BFLOAT16:
            from ...kernels import device
            return device.BfloatDeviceArray(self.module.to_device(values.view(np.uint16)))
        return self.module.to_device(values)

    def copy_from_host(self, values: np.ndarray, target: Any) -> None:
        """``target.copy_to_device(values)``."""
        target.copy_to_device(np.ascontiguousarray(values))

    def to_host(self, array: Any) -> np.ndarray:
        """``array.copy_to_host()``."""
        return array.copy_to_host()

    def bytes_of(self, array: Any) -> Any:
        """A uint8 view of ``array`` (of a bfloat16 array's bits)."""
        return getattr(array, "bits", array).view(np.uint8)

    def synchronize(self) -> None:
        """``cuda.synchronize()``."""
        self.module.synchronize()


def simulator_requested() -> bool:
    """Whether numba is set to use its CUDA simulator (``NUMBA_ENABLE_CUDASIM``), read
    from numba's configuration without importing ``numba.cuda``."""
    try:
        from numba.core import config
    except ImportError:
        return False
    return bool(getattr(config, "ENABLE_CUDASIM", False))


def open_device(library: str, local_rank: int) -> DeviceArrays:
    """Device arrays of ``library`` (one of :data:`LIBRARIES`) on GPU
    ``local_rank % GPUs on this node``.

    Raises:
        NoDevice: the library cannot be imported, sees no GPU, or cannot run under the
            simulator; ``auto`` when neither CuPy nor numba sees a GPU.
    """
    if simulator_requested():
        if library in ("auto", "numba"):
            return _numba(local_rank)
        raise NoDevice(f"numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) takes numba "
                       f"device arrays, not {LIBRARY_NAMES[library]}'s; use "
                       f"--device-library numba")
    if library == "cupy":
        return _cupy(local_rank)
    if library == "torch":
        return _torch(local_rank)
    if library == "numba":
        return _numba(local_rank)
    reasons = []
    for opener in (_cupy, _numba):
        try:
            return opener(local_rank)
        except NoDevice as error:
            reasons.append(str(error))
    raise NoDevice(f"no CUDA device found ({'; '.join(reasons)})")


def _cupy(local_rank: int) -> DeviceArrays:
    try:
        import cupy
    except Exception as error:  # not installed, or built for another CUDA
        raise NoDevice(_not_imported("CuPy", "cupy", error)) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver reads as no device
        raise NoDevice(f"CuPy sees no GPU ({_brief(error)})") from None
    if count < 1:
        raise NoDevice("CuPy sees no GPU")
    index = local_rank % count
    cupy.cuda.Device(index).use()
    name = _text(cupy.cuda.runtime.getDeviceProperties(index)["name"])
    return CupyArrays(cupy, f"CuPy {cupy.__version__} arrays on {_gpus(index, count, name)}")


def _torch(local_rank: int) -> DeviceArrays:
    try:
        import torch
    except Exception as error:
        raise NoDevice(_not_imported("torch", "torch", error)) from None
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise NoDevice(f"torch {torch.__version__} sees no CUDA GPU")
    count = torch.cuda.device_count()
    index = local_rank % count
    torch.cuda.set_device(index)
    name = torch.cuda.get_device_name(index)
    return TorchArrays(torch, f"torch {torch.__version__} CUDA tensors on "
                              f"{_gpus(index, count, name)}")


def _numba(local_rank: int) -> DeviceArrays:
    try:
        from ...kernels import device
    except Exception as error:  # numba-cuda missing, or a broken CUDA install
        raise NoDevice(_not_imported("numba.cuda", "numba", error)) from None
    cuda = device.cuda
    if device.SIMULATED:
        return NumbaArrays(cuda, "numba device arrays under numba's CUDA simulator "
                                 "(NUMBA_ENABLE_CUDASIM=1: host memory, times are not "
                                 "a GPU's)", simulated=True)
    try:
        available = cuda.is_available()
        count = len(cuda.gpus) if available else 0
    except Exception as error:  # a broken driver install reads as no device
        raise NoDevice(f"numba sees no GPU ({_brief(error)})") from None
    if count < 1:
        raise NoDevice("numba sees no GPU")
    index = local_rank % count
    cuda.select_device(index)
    name = _text(cuda.get_current_device().name)
    return NumbaArrays(cuda, f"numba device arrays on {_gpus(index, count, name)}")


def _gpus(index: int, count: int, name: str) -> str:
    return f"{name} (GPU {index} of {count}; each rank takes GPU local_rank % {count})"


def _not_imported(label: str, package: str, error: BaseException) -> str:
    missing = getattr(error, "name", None) or ""
    if isinstance(error, ModuleNotFoundError) and missing.split(".")[0] == package:
        return f"{label} is not installed"
    return f"{label} cannot be imported ({_brief(error)})"


def _text(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def _brief(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
