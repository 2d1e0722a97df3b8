"""Device buffers that the processes of one node share (CUDA IPC).

The one module that needs CUDA's inter-process memory handles (through numba's device
arrays, which :mod:`.device` makes). :func:`shared_buffer` allocates a plain device
buffer (``cuMemAlloc`` through numba's default allocator, never a slice of a framework's
pool: a handle names a whole allocation) and exports its handle, which pickles;
:func:`open_peer` maps another process's buffer into this one, once;
:meth:`PeerBuffer.close` unmaps it. The exporter frees its buffer only after every peer
has closed it.

Under numba's CUDA simulator device memory is host memory, and the buffers are files in
``/dev/shm`` mapped by every process instead: the collectives' IPC path (handle
exchange, caching, schedule) then runs where there is no GPU.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import device
from .device import SIMULATED

SHARED_MEMORY_FOLDER = "/dev/shm"
"""Where the simulator's stand-in buffers live."""


class IpcUnavailableError(RuntimeError):
    """This process cannot share device memory with a peer (the message says why)."""


@dataclass
class SharedBuffer:
    """A device buffer of this process that peers may map.

    Attributes:
        array: the buffer, a 1-D uint8 device array.
        handle: what a peer passes to :func:`open_peer` (picklable).
    """

    array: Any
    handle: Any
    _release: Callable[[], None]

    def free(self) -> None:
        """Release the buffer; every peer must have closed it first."""
        self.array = None
        self._release()


@dataclass
class PeerBuffer:
    """Another process's :class:`SharedBuffer`, mapped into this one.

    Attributes:
        array: the peer's buffer, a 1-D uint8 device array kernels and copies can use.
    """

    array: Any
    _close: Callable[[], None]

    def close(self) -> None:
        """Unmap the buffer."""
        self.array = None
        self._close()


def unavailable_reason() -> str | None:
    """Why this process cannot share device memory at all, or None when it can."""
    if SIMULATED:
        return None if os.path.isdir(SHARED_MEMORY_FOLDER) else \
            f"the simulator's stand-in needs {SHARED_MEMORY_FOLDER}"
    if not device.ipc_supported():
        return "CUDA IPC is not supported on this platform"
    return None


def shared_buffer(nbytes: int) -> SharedBuffer:
    """A new device buffer of ``nbytes`` bytes on the current device, exportable."""
    if SIMULATED:
        return _simulated_buffer(nbytes)
    array = device.empty((max(nbytes, 1),), np.uint8)
    return SharedBuffer(array, array.get_ipc_handle(), lambda: None)


def open_peer(handle: Any) -> PeerBuffer:
    """Map a peer's buffer, given its :attr:`SharedBuffer.handle`, into this process.

    Raises:
        IpcUnavailableError: this GPU cannot reach the peer's memory directly.
    """
    if SIMULATED:
        return _simulated_peer(handle)
    context = device.current_context()
    if not handle._ipc_handle.can_access_peer(context):
        raise IpcUnavailableError(
            f"GPU {context.device.id} has no peer access to the GPU of the buffer")
    try:
        array = handle.open()
    except Exception as error:  # the driver refuses: another process's IPC is not for us
        raise IpcUnavailableError(f"opening the peer's IPC handle failed: {error}") from error
    return PeerBuffer(array, handle.close)


# ------------------------------------------------------------ the simulator's stand-in

_counter = itertools.count()
_created: set[str] = set()


def _simulated_buffer(nbytes: int) -> SharedBuffer:
    path = os.path.join(SHARED_MEMORY_FOLDER, f"ringtrain-ipc-{os.getpid()}-{next(_counter)}")
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(descriptor, max(nbytes, 1))
        mapped = mmap.mmap(descriptor, max(nbytes, 1))
    finally:
        os.close(descriptor)
    _created.add(path)

    def release() -> None:
        _created.discard(path)
        os.unlink(path)

    array = device.simulated_array(np.frombuffer(mapped, np.uint8, nbytes))
    return SharedBuffer(array, (path, nbytes), release)


def _simulated_peer(handle: tuple[str, int]) -> PeerBuffer:
    path, nbytes = handle
    try:
        descriptor = os.open(path, os.O_RDWR)
    except OSError as error:
        raise IpcUnavailableError(f"cannot open the peer's buffer {path}: {error}") from error
    try:
        mapped = mmap.mmap(descriptor, max(nbytes, 1))
    finally:
        os.close(descriptor)
    return PeerBuffer(device.simulated_array(np.frombuffer(mapped, np.uint8, nbytes)),
                      lambda: None)


@atexit.register
def _remove_created() -> None:
    for path in list(_created):
        try:
            os.unlink(path)
        except OSError:
            pass
