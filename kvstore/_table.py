"""The values a store holds, and how a push changes them: MXNet's server-side updater.

Without an optimizer a key holds what was last pushed (the sum over the values of one
push, and over the workers in the sync modes); with one, each push runs
``optimizer.update(key, weight, grad, state)`` on the held value. Used by the local and
sync stores (every worker holds every key) and by the async servers (each holds its
parts).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ..collectives import InvalidArgumentError
from ._keys import Key, label

STATES_FORMAT = "ringtrain.kvstore optimizer states 1"
"""Written first in a states file; a file without it is refused."""


class Table:
    """Values by key (or by key part), with the optimizer's state of each.

    Attributes:
        values: the held values (host arrays) by key.
        optimizer: the optimizer, or None.
        states: the optimizer's state by key (made at a key's first update).
    """

    def __init__(self) -> None:
        self.values: dict[Any, np.ndarray] = {}
        self.optimizer: Any = None
        self.states: dict[Any, Any] = {}

    def add(self, key: Any, value: np.ndarray) -> None:
        """Hold a copy of ``value`` under ``key``."""
        self.values[key] = np.array(value, copy=True)

    def apply(self, key: Any, grad: np.ndarray, index: Key | None = None) -> None:
        """A push of ``grad`` (summed already) to ``key``: stored, or an update.

        Args:
            index: the key the optimizer sees (default ``key``; a server holding a part
                of a key passes the key itself).
        """
        weight = self.values[key]
        if self.optimizer is None:
            np.copyto(weight, grad.reshape(weight.shape), casting="unsafe")
            return
        if key not in self.states:
            self.states[key] = self.optimizer.create_state(index if index is not None
                                                           else key, weight)
        self.optimizer.update(index if index is not None else key, weight,
                              grad.reshape(weight.shape), self.states[key])


def pickled(obj: Any) -> bytes:
    """``obj`` pickled, with cloudpickle where installed, so that the optimizers given as
    lambdas or local classes travel to the servers and into states files too."""
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def dump_states(states: dict[Any, Any], optimizer: Any) -> bytes:
    """The bytes of a states file (the optimizer pickled too, as MXNet's ``dump_optimizer``)."""
    return pickled((STATES_FORMAT, states, optimizer))


def load_states(data: bytes, fname: str) -> tuple[dict[Any, Any], Any]:
    """``(states, optimizer)`` from the bytes of a states file.

    Raises:
        InvalidArgumentError: not a states file.
    """
    try:
        loaded = pickle.loads(data)
    except Exception as error:  # any unpickling failure means: not our file
        raise InvalidArgumentError(f"kvstore load_optimizer_states: {fname!r} is not an "
                                   f"optimizer states file ({error})") from error
    if not (isinstance(loaded, tuple) and len(loaded) == 3 and loaded[0] == STATES_FORMAT):
        raise InvalidArgumentError(f"kvstore load_optimizer_states: {fname!r} is not an "
                                   f"optimizer states file")
    return loaded[1], loaded[2]


def check_like(key: Key, value: np.ndarray, held: tuple[tuple[int, ...], np.dtype],
               operation: str) -> None:
    """Refuse a value whose shape or dtype differ from the key's initial value."""
    shape, dtype = held
    if value.shape != shape or value.dtype != dtype:
        raise InvalidArgumentError(
            f"kvstore {operation} of {label(key)}: shape {list(value.shape)} and dtype "
            f"{value.dtype} differ from the key's initial value (shape {list(shape)}, dtype "
            f"{dtype})")
