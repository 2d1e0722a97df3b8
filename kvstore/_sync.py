"""``dist_sync``, ``dist_device_sync`` and ``horovod``: every worker holds every key, and
pushes are summed over the workers with ringtrain's allreduce.

A push starts grouped allreduces (``op=Sum``) of its keys on the collectives' thread,
in buckets of at most ``fusion_threshold`` bytes, and returns; the worker computes
meanwhile. A pull (or the next push of the key) waits for its bucket, then applies the
sum once: stored, or an optimizer update, the same on every worker since every worker
holds the same sum. Each allreduce is named after its keys, so a worker that pushes keys
the others did not gets a :class:`~ringtrain.MismatchError` from the agreement (on every
worker, at the pull), never a hang. With 2-bit compression each worker's quantized
words are allgathered instead, and every worker dequantizes and sums them in rank order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import collectives as rt
from . import _compression
from ._keys import Key
from ._store import KVStore
from ._table import Table


class _Pending:
    """A bucket's collective in flight, and how to turn its result into each key's sum."""

    def __init__(self, handle: rt.Handle, keys: list[Key], sizes: list[int] | None,
                 threshold: float | None):
        self.handle = handle
        self.keys = keys
        self.sizes = sizes
        self.threshold = threshold
        self.sums: dict[Key, np.ndarray] | None = None

    def sum_of(self, key: Key, shape: tuple[int, ...], dtype: np.dtype,
               num_workers: int) -> np.ndarray:
        """The key's sum over the workers (waits for the bucket the first time)."""
        if self.sums is None:
            result = rt.synchronize(self.handle)
            if self.threshold is None:
                self.sums = dict(zip(self.keys, result))
            else:
                self.sums = {self.keys[0]: _summed_words(result, self.sizes[0], num_workers,
                                                         self.threshold)}
        return self.sums[key].reshape(shape).astype(dtype, copy=False)


def _summed_words(gathered: np.ndarray, count: int, num_workers: int,
                  threshold: float) -> np.ndarray:
    """Each worker's dequantized values, summed in rank order (the same bits everywhere)."""
    per_worker = gathered.view(np.uint32).reshape(num_workers, -1)
    total = np.zeros(count, np.float32)
    for words in per_worker:
        total += _compression.decompress(words, count, threshold)
    return total


class SyncStore(KVStore):
    """The sync modes over ringtrain's collectives (``ringtrain.init`` is called if needed)."""

    def __init__(self, name: str):
        super().__init__()
        if not rt.is_initialized():
            rt.init()
        self.type = name
        self.on_device = name == "dist_device_sync"
        self.rank = rt.rank()
        self.num_workers = rt.size()
        self._table = Table()
        self._pending: dict[Key, _Pending] = {}

    def _refuse(self, operation: str, key: Any, error: rt.RingtrainError) -> None:
        # A collective whose name differs from the others' call: they get a MismatchError
        # that names this rank and the reason, instead of waiting for its part.
        try:
            rt.allreduce(np.zeros(1, np.int8), op=rt.Sum,
                         name=f"kvstore {operation} of {key!r} refused: {error}")
        except rt.MismatchError:
            pass

    def _init(self, items: list[tuple[Key, np.ndarray]]) -> None:
        for key, value in items:
            self._table.add(key, rt.broadcast(value, root_rank=0, name=f"kvstore init {key!r}"))

    def _push(self, items: list[tuple[Key, np.ndarray]]) -> None:
        for key, _ in items:
            self._settle(key)
        if self._compression is not None:
            for key, total in items:
                words = self._compression.compress(key, total)
                # int32: the collectives' dtype of the same width (bits unchanged)
                handle = rt.allgather_async(words.view(np.int32),
                                            name=f"kvstore push {key!r} 2bit")
                self._pending[key] = _Pending(handle, [key], [total.size],
                                              self._compression.threshold)
            return
        for bucket in _buckets(items, rt.current_settings().fusion_threshold):
            keys = [key for key, _ in bucket]
            handle = rt.grouped_allreduce_async([total for _, total in bucket], op=rt.Sum,
                                                name=f"kvstore push {keys!r}")
            pending = _Pending(handle, keys, None, None)
            for key in keys:
                self._pending[key] = pending

    def _settle(self, key: Key) -> None:
        """Apply the key's pushed sum, if one is in flight."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            shape, dtype = self._shapes[key]
            self._table.apply(key, pending.sum_of(key, shape, dtype, self.num_workers))

    def _pull(self, keys: list[Key]) -> list[np.ndarray]:
        for key in keys:
            self._settle(key)
        return [self._table.values[key].copy() for key in keys]

    def _set_optimizer(self, optimizer: Any) -> None:
        self._settle_all()
        self._table.optimizer = optimizer

    def _states(self) -> dict[Any, Any]:
        self._settle_all()
        return dict(self._table.states)

    def _load_states(self, states: dict[Any, Any]) -> None:
        self._settle_all()
        self._table.states = dict(states)

    def _settle_all(self) -> None:
        for key in list(self._pending):
            self._settle(key)

    def barrier(self) -> None:
        """Every worker's pushes so far are applied, then all workers meet."""
        self._settle_all()
        rt.barrier()

    def close(self) -> None:
        """Apply the pushes in flight (raising their errors)."""
        self._settle_all()


def _buckets(items: list[tuple[Key, np.ndarray]], limit: int) -> list[list]:
    """Consecutive items in groups of at most ``limit`` bytes (one item at least)."""
    groups: list[list] = []
    size = 0
    for item in items:
        if not groups or size + item[1].nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1].nbytes
    return groups
