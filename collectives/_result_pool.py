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
from typing import Any

import numpy as np

from ..variables import RESULT_POOL_BYTES

MIN_BYTES = 256 << 10
"""Smaller results come from numpy. From about this size glibc may map a new result
afresh, and every page then faults on its first write: its mmap threshold starts at
128 KiB, and heap memory freed at the top beyond twice the threshold goes back to the
system (as when the MPI library frees a buffer of its own beside the result). Measured
on a 2-core EPYC: MPI's own allreduce of 512 KiB at 2 ranks took 333-345 µs into new
numpy arrays, 134-136 into pooled results, 117 into one reused buffer. A pooled result
costs its lease: writing a new 256 KiB result took 9.2 µs pooled against 6.9 from numpy
where glibc reused its heap; 16 MiB, three earlier results still held, 1693 against
4514 µs (1219 into a reused buffer)."""
_BLOCK_GRAIN = 64 << 10
"""Blocks are whole multiples of 64 KiB, so results of nearby sizes share them."""


class _Block:
    """Memory kept for results, with the array interface of its last lease (numpy only
    reads it; results of one size again and again share it)."""

    __slots__ = ("memory", "nbytes", "_interface")

    def __init__(self, nbytes: int):
        self.memory = np.empty(nbytes, np.uint8)
        self.nbytes = nbytes
        self._interface: dict[str, Any] = {"shape": (0,)}

    def interface(self, nbytes: int) -> dict[str, Any]:
        """The array interface of the block's first ``nbytes`` bytes."""
        if self._interface["shape"] != (nbytes,):
            self._interface = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                               "data": (self.memory.ctypes.data, False)}
        return self._interface


class _Lease:
    """One result's hold on a block: the base object of the result's arrays. When the
    last of them is gone the block goes back to its pool."""

    __slots__ = ("__array_interface__", "_block", "_pool")

    def __init__(self, pool: ResultPool, block: _Block, nbytes: int):
        self._pool, self._block = pool, block
        self.__array_interface__ = block.interface(nbytes)

    def __del__(self) -> None:
        self._pool._give_back(self._block)


class ResultPool:
    """Blocks for large results, handed out and taken back.

    Args:
        limit_bytes: idle blocks kept at most, in bytes (0: every result from numpy).
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._idle: list[_Block] = []  # oldest first
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An uninitialised C-contiguous array, from a pooled block when it is large."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or self.limit_bytes == 0:
            return np.empty(shape, dtype)
        lease = _Lease(self, self._take(nbytes), nbytes)
        return np.asarray(lease).view(dtype).reshape(shape)

    def _take(self, nbytes: int) -> _Block:
        """The smallest idle block that holds ``nbytes`` without wasting half of it, or a
        new one."""
        with self._lock:
            best = None
            for block in self._idle:
                if nbytes <= block.nbytes <= 2 * nbytes and \
                        (best is None or block.nbytes < best.nbytes):
                    best = block
            if best is not None:
                self._idle.remove(best)
                self._idle_bytes -= best.nbytes
                return best
        return _Block(-(-nbytes // _BLOCK_GRAIN) * _BLOCK_GRAIN)

    def _give_back(self, block: _Block) -> None:
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
