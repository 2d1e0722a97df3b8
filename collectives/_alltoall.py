"""alltoall: each rank sends a block of rows to every rank (run by
:mod:`.calls._alltoall_run`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base._executor import Handle
from .calls._alltoall_run import FORMS
from .world._process_sets import ProcessSet


def alltoall(tensor: np.ndarray, splits: Sequence[int] | np.ndarray | None = None,
             name: str | None = None, process_set: ProcessSet | None = None, *,
             algorithm: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` of ``tensor`` to rank j; receive every rank's rows for us.

    Args:
        tensor: this rank's rows, at least 1-D.
        splits: how many rows go to each rank, in rank order, summing to
            ``tensor.shape[0]``; default: as even as possible, earlier ranks one more.
        name: names the tensor in error messages; the same on every rank.
        process_set: the ranks taking part (default: all).
        algorithm: ``recursive_doubling`` (small alltoalls, in the agreement's own
            messages), ``pairwise``, ``native`` or ``auto``.

    Returns:
        ``(received, received_splits)``: the rows from every rank concatenated in rank
        order, and how many rows came from each rank (int64).
    """
    return FORMS.blocking(False, tensor, name, process_set, (splits, algorithm))


def alltoall_async(tensor: np.ndarray, splits: Sequence[int] | np.ndarray | None = None,
                   name: str | None = None, process_set: ProcessSet | None = None, *,
                   algorithm: str | None = None) -> Handle:
    """Start :func:`alltoall`; ``synchronize(handle)`` returns ``(received, received_splits)``."""
    return FORMS.start(False, tensor, name, process_set, (splits, algorithm))
