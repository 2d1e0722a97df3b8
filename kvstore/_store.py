"""The KVStore's API (MXNet's names and meanings), and the ``local`` and ``device`` modes.

:class:`KVStore` checks and normalises every call (keys, values, outs) and leaves four
steps to its modes: initialise keys, push summed values, settle and read keys, and the
barrier. :class:`LocalStore` holds every key in this process; the distributed modes
are :mod:`._sync` and :mod:`._async`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..collectives import InvalidArgumentError, RingtrainError, UsageError
from . import _compression
from ._arrays import host_array, summed, write
from ._keys import Key, is_key_list, label, pairs, single_values
from ._table import Table, check_like, dump_states, load_states
from .optimizer import as_optimizer


class KVStore:
    """A key-value store of arrays: workers push gradients and pull weights.

    Create one with :func:`ringtrain.kvstore.create`. Keys are ints or strings; values
    numpy arrays (bfloat16 included) or torch tensors (CPU or CUDA) of a supported dtype.

    Attributes:
        type: the mode's name, e.g. ``"dist_sync"``.
        rank: this worker's rank among the workers.
        num_workers: how many workers push to the store.
    """

    type: str = "local"
    on_device: bool = False

    def __init__(self) -> None:
        self.rank = 0
        self.num_workers = 1
        self._shapes: dict[Key, tuple[tuple[int, ...], np.dtype]] = {}
        self._compression: _compression.TwoBit | None = None
        self._optimizer: Any = None

    # ----------------------------------------------------------------- the API

    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        """Initialise keys with values (in the distributed modes: worker 0's values, on
        every worker; every worker calls ``init`` with the same keys, shapes and dtypes).

        Raises:
            InvalidArgumentError: a key initialised twice, or a bad key or value.
        """
        try:
            items = pairs(key, value, "init")
            single_values(items, "init", "value")
            checked = []
            for k, values in items:
                if k in self._shapes or any(k == seen for seen, _ in checked):
                    raise InvalidArgumentError(f"kvstore init of {label(k)}: the key was "
                                               f"initialised already")
                checked.append((k, np.array(host_array(values[0], k, "init"), copy=True)))
        except RingtrainError as error:
            self._refuse("init", key, error)
            raise
        self._init(checked)
        for k, array in checked:
            self._shapes[k] = (array.shape, array.dtype)

    def push(self, key: Key | Sequence[Key], value: Any, priority: int = 0) -> None:
        """Push values: several values of one key are summed first; the sum over the
        workers (sync modes) or this worker's sum (async modes) is stored, or updates the
        key when an optimizer is set. Returns at once: the sums run in the background.

        Args:
            key: a key or a list of keys.
            value: for each key, a value or a list of values (summed).
            priority: accepted for MXNet's signature; pushes run in program order.

        Raises:
            InvalidArgumentError: a key not initialised, or a value whose shape or dtype
                differs from the key's initial value.
        """
        totals: dict[Key, np.ndarray] = {}
        try:
            for k, values in pairs(key, value, "push"):
                total = summed(values, k, "push", self.on_device)
                check_like(k, total, self._held(k, "push"), "push")
                if k in totals:  # a key listed twice: its values are summed, as MXNet does
                    totals[k] += total
                else:
                    totals[k] = total
        except RingtrainError as error:
            self._refuse("push", key, error)
            raise
        self._push(list(totals.items()))

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> Any:
        """The keys' current values, after this worker's earlier pushes of them.

        Args:
            key: a key or a list of keys.
            out: for each key, an array or a list of arrays to fill (torch tensors on any
                device); None: new host arrays are returned.
            priority, ignore_sparse: accepted for MXNet's signature.

        Returns:
            ``out`` when given, else the value (a list of values for a list of keys).

        Raises:
            InvalidArgumentError: a key not initialised, an ``out`` of another shape.
        """
        keys = list(key) if is_key_list(key) else [key]
        for k in keys:
            self._held(k, "pull")
        values = self._pull(keys)
        if out is None:
            return values if is_key_list(key) else values[0]
        for (k, outs), array in zip(pairs(key, out, "pull", "out"), values):
            for target in outs:
                write(target, array, k, "pull")
        return out

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None,
                 priority: int = 0) -> Any:
        """:meth:`push`, then :meth:`pull` into ``out`` (into ``value`` when ``out`` is None,
        as MXNet does)."""
        self.push(key, value, priority)
        return self.pull(key, value if out is None else out, priority)

    def broadcast(self, key: Key | Sequence[Key], value: Any, out: Any,
                  priority: int = 0) -> Any:
        """:meth:`init` the keys with worker 0's ``value``, then :meth:`pull` into ``out``."""
        self.init(key, value)
        return self.pull(key, out, priority)

    def row_sparse_pull(self, key: Key, out: Any = None, priority: int = 0,
                        row_ids: Any = None) -> Any:
        """Rows of a key's value (an embedding's rows), into a dense ``out``.

        ``out`` (the value's shape) gets the rows ``row_ids`` of the value and zeros
        elsewhere, as MXNet's row-sparse result reads when made dense. The whole value
        is pulled; the rows are selected here.

        Args:
            key: one key whose value has at least one dimension.
            out: an array of the value's shape, or None for a new one.
            row_ids: row indices (any integer array-like; repeats allowed).
        """
        if is_key_list(key):
            raise InvalidArgumentError("kvstore row_sparse_pull takes one key")
        value = self.pull(key)
        if value.ndim == 0:
            raise InvalidArgumentError(f"kvstore row_sparse_pull of {label(key)}: the value "
                                       f"is 0-d; it has no rows")
        rows = np.asarray(row_ids if row_ids is not None else [], dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= value.shape[0]):
            raise InvalidArgumentError(f"kvstore row_sparse_pull of {label(key)}: row ids "
                                       f"must lie in [0, {value.shape[0]}), got "
                                       f"{rows.min()}..{rows.max()}")
        dense = np.zeros_like(value)
        dense[rows] = value[rows]
        if out is None:
            return dense
        write(out, dense, key, "row_sparse_pull")
        return out

    def set_optimizer(self, optimizer: Any) -> None:
        """Run ``optimizer`` where the keys live: each push then updates the key.

        Args:
            optimizer: an object with ``update(index, weight, grad, state)`` and
                ``create_state(index, weight)`` (:mod:`ringtrain.kvstore.optimizer`), a
                torch optimizer class, or a function ``f(key, grad, weight)``.
        """
        self._optimizer = as_optimizer(optimizer)
        self._set_optimizer(self._optimizer)

    def set_gradient_compression(self, compression_params: Mapping[str, Any]) -> None:
        """Compress pushes: ``{'type': '2bit', 'threshold': t}`` (MXNet's 2-bit scheme;
        residuals kept per key on each worker) or ``{'type': 'none'}``.

        Raises:
            InvalidArgumentError: an unknown type, or a threshold that is not > 0.
        """
        self._compression = _compression.from_params(compression_params)

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Write the optimizer's state of every key to ``fname`` (the optimizer too)."""
        if self._optimizer is None:
            raise UsageError("kvstore save_optimizer_states: no optimizer is set")
        data = dump_states(self._states(), self._optimizer)
        with open(fname, "wb") as file:
            file.write(data)

    def load_optimizer_states(self, fname: str) -> None:
        """Replace the optimizer's states by those saved in ``fname``."""
        if self._optimizer is None:
            raise UsageError("kvstore load_optimizer_states: set an optimizer first")
        with open(fname, "rb") as file:
            states, _ = load_states(file.read(), fname)
        known = self._state_keys()
        unknown = [where for where in states if where not in known]
        if unknown:
            raise InvalidArgumentError(
                f"kvstore load_optimizer_states: {fname!r} holds states of {unknown[0]!r}, "
                f"which this store does not have (saved by another mode, with other keys, "
                f"or for another number of servers)")
        self._load_states(states)

    def barrier(self) -> None:
        """Wait until every worker has reached this barrier."""

    def close(self) -> None:
        """Finish this worker's use of the store (pending pushes completed)."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.type!r} rank {self.rank} of {self.num_workers}>"

    # ------------------------------------------------------------ for the modes

    def _held(self, key: Key, operation: str) -> tuple[tuple[int, ...], np.dtype]:
        try:
            return self._shapes[key]
        except (KeyError, TypeError):
            raise InvalidArgumentError(f"kvstore {operation} of {label(key)}: the key was "
                                       f"not initialised (call init first)") from None

    def _refuse(self, operation: str, key: Any, error: RingtrainError) -> None:
        """Tell the other workers that this one refused ``operation`` (where they would
        otherwise wait for it); ``error`` is raised after."""

    def _init(self, items: list[tuple[Key, np.ndarray]]) -> None:
        raise NotImplementedError

    def _push(self, items: list[tuple[Key, np.ndarray]]) -> None:
        raise NotImplementedError

    def _pull(self, keys: list[Key]) -> list[np.ndarray]:
        raise NotImplementedError

    def _set_optimizer(self, optimizer: Any) -> None:
        raise NotImplementedError

    def _states(self) -> dict[Any, Any]:
        raise NotImplementedError

    def _state_keys(self) -> set[Any]:
        """What the optimizer's states are saved under: the keys (the async modes: each
        part's ``(key, start, stop)``)."""
        return set(self._shapes)

    def _load_states(self, states: dict[Any, Any]) -> None:
        raise NotImplementedError


class LocalStore(KVStore):
    """``local`` and ``device``: every key in this process (values summed on the host, or
    on their device for ``device``); compression applies to each push as on a worker."""

    def __init__(self, name: str):
        super().__init__()
        self.type = name
        self.on_device = name == "device"
        self._table = Table()

    def _init(self, items: list[tuple[Key, np.ndarray]]) -> None:
        for key, value in items:
            self._table.add(key, value)

    def _push(self, items: list[tuple[Key, np.ndarray]]) -> None:
        for key, total in items:
            self._table.apply(key, self._through_compression(key, total))

    def _through_compression(self, key: Key, total: np.ndarray) -> np.ndarray:
        if self._compression is None:
            return total
        words = self._compression.compress(key, total)
        return _compression.decompress(words, total.size, self._compression.threshold)

    def _pull(self, keys: list[Key]) -> list[np.ndarray]:
        return [self._table.values[k].copy() for k in keys]

    def _set_optimizer(self, optimizer: Any) -> None:
        self._table.optimizer = optimizer

    def _states(self) -> dict[Any, Any]:
        return dict(self._table.states)

    def _load_states(self, states: dict[Any, Any]) -> None:
        self._table.states = dict(states)
