"""Large host results in memory that is already mapped.

glibc serves an allocation above its mmap threshold (which never exceeds 32 MiB) with
fresh pages, and the first write to each 4 KiB page then faults: for an out-of-place
broadcast of 32 MiB at 2 ranks the faults cost about as much as the transfer (0.64 of
MPI's own time on a buffer it reuses; 0.91 with the result's memory reused). So a result
of at least :data:`MIN_BYTES` is carved from a block ringtrain keeps. The result's base
object is a lease on the block, kept alive by the result and by every view of it
(numpy's, torch's ``from_numpy``); when the last of them is gone the block comes back,
and the next result it can hold reuses its pages. Idle blocks are kept up to
``RINGTRAIN_RESULT_POOL_BYTES`` in all, the oldest dropped first.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Any

import numpy as np

from ..variables import RESULT_POOL_BYTES

MIN_BYTES = 4 << 20
"""Smaller results come from numpy, whose memory glibc's heap reuses while pooling would
cost a lease and a finalizer (Python that runs cold after the transfer has swept the
caches). Measured on a 2-core EPYC, writing a new result (µs, the previous 0 / 1 / 3
results still held): 1 MiB from numpy 51 / 72 / 82, pooled 90 / 102 / 113; 4 MiB 345 /
406 / 505 and 374 / 406 / 449; 16 MiB 1232 / 2946 / 5383 and 1306 / 1442 / 1661, where
glibc hands memory back and maps it again; into a reused buffer 46, 320 and 1210."""
_BLOCK_GRAIN = 1 << 20
"""Blocks are whole MiB, so results of nearby sizes share them."""


class _Lease:
    """One result's hold on a block: the base object of the result's arrays."""

    __slots__ = ("__array_interface__", "block", "__weakref__")

    def __init__(self, block: np.ndarray, nbytes: int):
        self.block = block
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (block.__array_interface__["data"][0], False)}


class ResultPool:
    """Blocks for large results, handed out and taken back.

    Args:
        limit_bytes: idle blocks kept at most, in bytes (0: every result from numpy).
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._idle: list[np.ndarray] = []  # oldest first
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array, from a pooled block when it is large."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or self.limit_bytes == 0:
            return np.empty(shape, dtype)
        block = self._take(nbytes)
        lease = _Lease(block, nbytes)
        weakref.finalize(lease, self._give_back, block)
        return np.asarray(lease).view(dtype).reshape(shape)

    def _take(self, nbytes: int) -> np.ndarray:
        """The smallest idle block that holds ``nbytes`` without wasting half of it, or a
        new one."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if nbytes <= b.nbytes <= 2 * nbytes]
            if fitting:
                block = self._idle.pop(min(fitting, key=lambda i: self._idle[i].nbytes))
                self._idle_bytes -= block.nbytes
                return block
        return np.empty(-(-nbytes // _BLOCK_GRAIN) * _BLOCK_GRAIN, np.uint8)

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            self._idle.append(block)
            self._idle_bytes += block.nbytes
            while self._idle_bytes > self.limit_bytes:
                self._idle_bytes -= self._idle.pop(0).nbytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of the blocks waiting for a result."""
        return self._idle_bytes


RESULTS = ResultPool(RESULT_POOL_BYTES.read())
"""The pool every host result of the collectives comes from."""
