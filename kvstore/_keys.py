"""Keys and the values given with them: MXNet's forms, normalised to (key, values) pairs.

``push(3, a)``, ``push(3, [a, b])`` (several values of one key, summed),
``push([3, 'w'], [a, b])`` and ``push([3, 'w'], [[a1, a2], [b1, b2]])`` all become a list
of ``(key, [value, ...])``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from ..collectives import InvalidArgumentError

Key = Union[int, str]


def label(key: Key) -> str:
    """How messages name a key: ``key 3`` or ``key 'w'``."""
    return f"key {key!r}"


def check_key(key: Any, operation: str) -> Key:
    """``key`` if it is an int or a str; else an InvalidArgumentError."""
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise InvalidArgumentError(f"kvstore {operation}: keys are ints or strings, got "
                                   f"{type(key).__name__} {key!r}")
    return key


def is_key_list(keys: Any) -> bool:
    """Whether ``keys`` is a list (or tuple) of keys rather than one key."""
    return isinstance(keys, (list, tuple))


def pairs(keys: Any, values: Any, operation: str, what: str = "value") -> list[tuple[Key, list]]:
    """``(key, [value, ...])`` for each key, in order.

    Args:
        keys: one key or a list of keys.
        values: for one key, a value or a list of values; for a list of keys, a list of
            the same length of those.
        operation: names the call in errors.
        what: names the values in errors (``value``, ``out``).
    """
    if not is_key_list(keys):
        return [(check_key(keys, operation), _values_of(values))]
    checked = [check_key(key, operation) for key in keys]
    if not isinstance(values, (list, tuple)) or len(values) != len(checked):
        count = len(values) if isinstance(values, (list, tuple)) else "not a list"
        raise InvalidArgumentError(f"kvstore {operation}: {len(checked)} keys need a list of "
                                   f"{len(checked)} {what}s, got {count}")
    return [(key, _values_of(value)) for key, value in zip(checked, values)]


def _values_of(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def single_values(items: Sequence[tuple[Key, list]], operation: str, what: str) -> None:
    """Refuse several values for one key where only one makes sense (``init``)."""
    for key, values in items:
        if len(values) != 1:
            raise InvalidArgumentError(f"kvstore {operation} of {label(key)}: one {what} per "
                                       f"key, got {len(values)}")
