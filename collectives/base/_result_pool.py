"""Large host results in memory that is already mapped.

glibc serves an allocation above its mmap threshold (which never exceeds 32 MiB) with
fresh pages, and the first write to each 4 KiB page then faults: for a large
out-of-place result the faults cost about as much as the transfer
(docs/lab/2026-11-25-result-pool.md). So a result of at least :data:`MIN_BYTES` is an
array over a block ringtrain keeps. Every array that
uses a block's memory (the result, numpy's views of it, torch's ``from_numpy``, a
``memoryview``) holds a reference to the block's own array, so a block is free when
nothing but the pool refers to it: the next result it can hold then reuses its pages.
Nothing runs when a result is dropped; the pool looks when it hands out a result.

Free blocks are kept up to ``RINGTRAIN_RESULT_POOL_BYTES`` in all: when the pool makes a
new block, the free blocks beyond that are dropped, those handed out longest ago first.
"""

from __future__ import annotations

import bisect
import math
import sys
import threading

import numpy as np

from ...common.environment import RESULT_POOL_BYTES

MIN_BYTES = 256 << 10
"""Smaller results come from numpy. From about this size glibc may map a new result
afresh, and every page then faults on its first write: its mmap threshold starts at
128 KiB, and heap memory freed at the top beyond twice the threshold goes back to the
system (as when the MPI library frees a buffer of its own beside the result). A pooled
result then costs little more than a buffer reused at every call, a new numpy array
far more (docs/lab/2026-11-25-result-pool.md)."""
_BLOCK_GRAIN = 64 << 10
"""Blocks are whole multiples of 64 KiB, so results of nearby sizes share them."""
_LAST_KEPT = 64
"""Result sizes whose last block the pool remembers, so that a call made again with the
same size finds its block without a search."""
_FREE_REFERENCES = 2
"""``sys.getrefcount`` of a free block's array: the pool's reference and the call's."""


class _Block:
    """Memory kept for results, and when it was last handed out (the pool's count)."""

    __slots__ = ("memory", "nbytes", "handed_out")

    def __init__(self, nbytes: int):
        self.memory = np.empty(nbytes, np.uint8)
        self.nbytes = nbytes
        self.handed_out = 0

    def is_free(self) -> bool:
        """Whether no array but the pool's own uses the block."""
        return sys.getrefcount(self.memory) == _FREE_REFERENCES


class ResultPool:
    """Blocks for large results, handed out again once nothing uses them.

    Args:
        limit_bytes: free blocks kept at most, in bytes (0: every result from numpy).
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._blocks: dict[int, list[_Block]] = {}  # by size
        self._sizes: list[int] = []  # the keys of _blocks, ascending
        self._handed_out = 0
        self._last: dict[int, _Block] = {}  # by result size: the block it had last
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An uninitialised C-contiguous array, over a pooled block when it is large."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < MIN_BYTES or nbytes > self.limit_bytes:
            return np.empty(shape, dtype)
        with self._lock:
            self._handed_out += 1
            block = self._last.get(nbytes)
            if block is None or not block.is_free():
                block = self._free_block(nbytes) or self._new_block(nbytes)
                if len(self._last) >= _LAST_KEPT:
                    self._last.clear()
                self._last[nbytes] = block
            block.handed_out = self._handed_out
            return np.ndarray(shape, dtype, block.memory)

    def _free_block(self, nbytes: int) -> _Block | None:
        """The smallest free block that holds ``nbytes`` without wasting half of it,
        moved to the end of its size's list (which the pool searches from the block
        handed out longest ago, the likeliest to be free)."""
        sizes = self._sizes
        for index in range(bisect.bisect_left(sizes, nbytes), len(sizes)):
            if sizes[index] > 2 * nbytes:
                break
            blocks = self._blocks[sizes[index]]
            for block in blocks:
                if block.is_free():
                    blocks.remove(block)
                    blocks.append(block)
                    return block
        return None

    def _new_block(self, nbytes: int) -> _Block:
        """A new block for ``nbytes``, after dropping the free blocks beyond the limit."""
        free = sorted((block for blocks in self._blocks.values() for block in blocks
                       if block.is_free()), key=lambda block: block.handed_out)
        free_bytes = sum(block.nbytes for block in free)
        for block in free:
            if free_bytes <= self.limit_bytes:
                break
            free_bytes -= block.nbytes
            self._forget(block)
        size = -(-nbytes // _BLOCK_GRAIN) * _BLOCK_GRAIN
        block = _Block(size)
        if size not in self._blocks:
            bisect.insort(self._sizes, size)
        self._blocks.setdefault(size, []).append(block)
        return block

    def _forget(self, block: _Block) -> None:
        self._last = {nbytes: kept for nbytes, kept in self._last.items() if kept is not block}
        blocks = self._blocks[block.nbytes]
        blocks.remove(block)
        if not blocks:
            del self._blocks[block.nbytes]
            self._sizes.remove(block.nbytes)

    @property
    def idle_bytes(self) -> int:
        """Bytes of the blocks that nothing uses now."""
        with self._lock:
            return sum(block.nbytes for blocks in self._blocks.values() for block in blocks
                       if block.is_free())


RESULTS = ResultPool(RESULT_POOL_BYTES.read())
"""The pool every host result of the collectives comes from."""
