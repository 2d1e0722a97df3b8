"""allgather: every rank's rows, concatenated along axis 0 in rank order (run by
:mod:`.calls._allgather_run`)."""

from __future__ import annotations

import numpy as np

from .base._executor import Handle
from .calls._allgather_run import FORMS
from .world._process_sets import ProcessSet


def allgather(tensor: np.ndarray, name: str | None = None,
              process_set: ProcessSet | None = None, *,
              algorithm: str | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along axis 0, in rank order.

    The first dimension may differ between ranks; the other dimensions and the dtype
    must not. A 0-d array counts as one row.

    Args:
        tensor: this rank's rows.
        name: names the tensor in error messages; the same on every rank.
        process_set: the ranks taking part (default: all).
        algorithm: ``ring``, ``pairwise``, ``hierarchical``, ``native`` or ``auto``
            (the tuning table's choice for the gathered size).

    Returns:
        A new array of shape ``(sum of first dimensions, *tensor.shape[1:])``.
    """
    return FORMS.blocking(False, tensor, name, process_set, (algorithm,))


def allgather_async(tensor: np.ndarray, name: str | None = None,
                    process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None) -> Handle:
    """Start :func:`allgather`; ``synchronize(handle)`` returns the new array."""
    return FORMS.start(False, tensor, name, process_set, (algorithm,))
