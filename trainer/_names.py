"""The check that the names given to gradients and parameters are unique."""

from __future__ import annotations

from collections.abc import Iterable


def repeated_names(names: Iterable[str]) -> list[str]:
    """The names that occur more than once in ``names``, each once, in the order in
    which they first repeat."""
    seen: set[str] = set()
    repeated: dict[str, None] = {}
    for name in names:
        if name in seen:
            repeated[name] = None
        else:
            seen.add(name)
    return list(repeated)
