"""broadcast and its in-place and asynchronous forms (run by :mod:`.calls._broadcast_run`)."""

from __future__ import annotations

import numpy as np

from .base._executor import Handle
from .calls._broadcast_run import FORMS
from .world._process_sets import ProcessSet


def broadcast(tensor: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None, *,
              algorithm: str | None = None) -> np.ndarray:
    """Return a new array holding ``root_rank``'s ``tensor`` on every rank.

    Args:
        tensor: on the root, the data; elsewhere an array of the same shape and dtype
            (its values are not used).
        root_rank: world rank of the sender; must be in the process set.
        name: names the tensor in error messages; the same on every rank.
        process_set: the ranks taking part (default: all).
        algorithm: ``binomial``, ``pipeline``, ``hierarchical``, ``native`` or ``auto``.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, roots or names.
    """
    return FORMS.blocking(False, tensor, name, process_set, (root_rank, algorithm))


def broadcast_(tensor: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None, *,
               algorithm: str | None = None) -> np.ndarray:
    """In-place :func:`broadcast`: ``tensor`` receives the root's data and is returned."""
    return FORMS.blocking(True, tensor, name, process_set, (root_rank, algorithm))


def broadcast_async(tensor: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None) -> Handle:
    """Start :func:`broadcast`; ``synchronize(handle)`` returns the new array."""
    return FORMS.start(False, tensor, name, process_set, (root_rank, algorithm))


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None, *,
                     algorithm: str | None = None) -> Handle:
    """Start :func:`broadcast_`."""
    return FORMS.start(True, tensor, name, process_set, (root_rank, algorithm))
