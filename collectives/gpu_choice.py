"""Which GPU this rank uses: the one at its local rank, unless the user already chose one.

With several GPUs visible, every rank would otherwise start on device 0. At ``init`` the
collectives ask the CUDA driver through ctypes (``libcuda.so.1``; importing torch, CuPy
or numba here would be slow and create contexts of their own):

* no driver, or fewer than two devices visible: nothing to choose (with one device, e.g.
  ``CUDA_VISIBLE_DEVICES`` set per rank, every rank uses it);
* a context already current on the calling thread, or torch's CUDA already initialized:
  the user (or a framework) chose; it is left as it is;
* otherwise device ``local_rank % count``: its primary context is retained and made
  current on the calling thread. The CUDA runtime (torch's, CuPy's) and numba adopt the
  primary context current on the thread, so this is what ``cudaSetDevice`` would do.

``RINGTRAIN_GPU_BY_LOCAL_RANK=0`` turns the choice off (default ``1``).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..common.environment import GPU_BY_LOCAL_RANK

GPU_CHOICE_VARIABLE = GPU_BY_LOCAL_RANK.name
LIBCUDA = "libcuda.so.1"

_CONTEXT = ctypes.c_void_p  # CUcontext (a pointer to an opaque struct)
_DEVICE = ctypes.c_int  # CUdevice
_SIGNATURES = {  # every entry returns a CUresult (0 is CUDA_SUCCESS)
    "cuInit": [ctypes.c_uint],
    "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
    "cuCtxGetCurrent": [ctypes.POINTER(_CONTEXT)],
    "cuCtxGetDevice": [ctypes.POINTER(_DEVICE)],
    "cuDeviceGet": [ctypes.POINTER(_DEVICE), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_CONTEXT), _DEVICE],
    "cuCtxSetCurrent": [_CONTEXT],
}


@dataclass(frozen=True)
class GpuChoice:
    """The device this rank uses, and how that was decided.

    Attributes:
        device: the device ordinal (among the visible ones); None when nothing was chosen.
        how: why, for the log.
        count: the number of visible devices, when the device was chosen among them.
    """

    device: int | None
    how: str
    count: int | None = None

    def __str__(self) -> str:
        if self.device is None:
            return f"none ({self.how})"
        among = "" if self.count is None else f" of {self.count}"
        return f"device {self.device}{among} ({self.how})"


class DriverError(RuntimeError):
    """A CUDA driver call returned an error.

    Attributes:
        call: the driver function, e.g. ``"cuCtxSetCurrent"``.
        code: its ``CUresult``.
    """

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} failed with CUDA error {code}")
        self.call = call
        self.code = code


class Driver:
    """The few CUDA driver calls the choice needs; every ``CUresult`` is checked.

    Raises:
        AttributeError: ``library`` lacks one of the functions.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[str, Callable[..., int]] = {}
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
            self._functions[name] = function

    @classmethod
    def load(cls, name: str = LIBCUDA) -> Driver | None:
        """The driver, initialized; None when it cannot be loaded or ``cuInit`` fails."""
        return _open_driver(name)[0]

    def init(self) -> None:
        """``cuInit(0)``: needed once per process before any other call."""
        self._call("cuInit", 0)

    def device_count(self) -> int:
        """The number of visible devices."""
        count = ctypes.c_int(0)
        self._call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def current_device(self) -> int | None:
        """The device of the context current on the calling thread; None when none is."""
        context = _CONTEXT()
        self._call("cuCtxGetCurrent", ctypes.byref(context))
        if not context.value:
            return None
        device = _DEVICE(0)
        self._call("cuCtxGetDevice", ctypes.byref(device))
        return device.value

    def make_current(self, ordinal: int) -> None:
        """Retain device ``ordinal``'s primary context and make it current on this thread.

        The context is never released: it is the one the process computes in.
        """
        device = _DEVICE(0)
        self._call("cuDeviceGet", ctypes.byref(device), ordinal)
        context = _CONTEXT()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        self._call("cuCtxSetCurrent", context)

    def _call(self, name: str, *args: object) -> None:
        code = self._functions[name](*args)
        if code != 0:
            raise DriverError(name, code)


def _open_driver(name: str) -> tuple[Driver | None, str]:
    """The initialized driver, or None and why not."""
    try:
        library = ctypes.CDLL(name)
    except OSError:
        return None, "no CUDA driver"
    try:
        driver = Driver(library)
    except AttributeError as error:
        return None, f"{name} is too old: {error}"
    try:
        driver.init()
    except DriverError as error:
        return None, str(error)
    return driver, ""


def _torch_choice() -> GpuChoice | None:
    """What torch chose, when its CUDA is initialized already (torch is never imported)."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
    except Exception:  # a torch still importing, or without CUDA support built in
        return None
    try:
        device = int(torch.cuda.current_device())
    except Exception:
        device = None
    return GpuChoice(device, "torch's CUDA initialized before init")


def choose_gpu(local_rank: int, environ: Mapping[str, str] = os.environ,
               driver: Driver | None = None) -> GpuChoice:
    """Make device ``local_rank % count`` current on the calling thread, unless there is
    nothing to choose or the user already chose.

    Args:
        local_rank: this process's rank among the ranks on its node.
        environ: where ``RINGTRAIN_GPU_BY_LOCAL_RANK`` is read.
        driver: the CUDA driver, initialized (default: ``libcuda.so.1``, if it loads).

    Returns:
        The device and how it was decided; a failing driver call gives no device and
        names the call, it never raises.

    Raises:
        ValueError: ``RINGTRAIN_GPU_BY_LOCAL_RANK`` is malformed (nothing was done).
    """
    if not GPU_BY_LOCAL_RANK.read(environ):
        value = (GPU_BY_LOCAL_RANK.text(environ) or "").strip()
        return GpuChoice(None, f"turned off by {GPU_CHOICE_VARIABLE}={value}")
    by_torch = _torch_choice()
    if by_torch is not None:
        return by_torch
    if driver is None:
        driver, why_not = _open_driver(LIBCUDA)
        if driver is None:
            return GpuChoice(None, why_not)
    try:
        count = driver.device_count()
        if count < 2:
            return GpuChoice(None, f"{count} device{'' if count == 1 else 's'} visible")
        current = driver.current_device()
        if current is not None:
            return GpuChoice(current, "already current before init")
        ordinal = local_rank % count
        driver.make_current(ordinal)
    except DriverError as error:
        return GpuChoice(None, str(error))
    return GpuChoice(ordinal, f"by local rank {local_rank}", count)
