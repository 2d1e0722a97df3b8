"""reducescatter: the reduction over all ranks, each rank keeping its share of axis 0
(run by :mod:`.calls._reducescatter_run`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kernels import Compression, Compressor
from .base._executor import Handle
from .base._ops import ReduceOp
from .calls._reducescatter_run import FORMS
from .world._process_sets import ProcessSet


def reducescatter(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None, *,
                  algorithm: str | None = None,
                  compression: Compressor = Compression.none,
                  splits: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Reduce ``tensor`` over all ranks and return this rank's share of axis 0.

    Axis 0 is split as ``splits`` says, else as evenly as possible, the earlier ranks
    taking the extra rows (the ``numpy.array_split`` convention): with 10 rows on 4 ranks,
    ranks get 3, 3, 2, 2.

    Args:
        tensor: this rank's array, at least 1-D; same shape and dtype on every rank.
        op, name, prescale_factor, postscale_factor, process_set: as for
            :func:`~ringtrain.allreduce`.
        algorithm: ``ring``, ``hierarchical``, ``recursive_doubling``, ``native`` or
            ``auto`` (``hierarchical``: inside the nodes, then between them; on nodes
            of unequal size the ring).
        compression: ``Compression.fp16`` or ``Compression.bf16`` send float32 tensors
            as 16-bit floats, as :func:`~ringtrain.allreduce` does (the result is
            float32); a compressed reduce-scatter runs the ring, or ``hierarchical``
            where ``auto`` or the call chooses it.
        splits: the rows each rank keeps, in rank order (non-negative integers summing
            to ``tensor.shape[0]``; zeros allowed); the same on every rank.

    Returns:
        A new array of shape ``(rows of this rank, *tensor.shape[1:])``.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops, names or splits.
    """
    return FORMS.blocking(False, tensor, name, process_set,
                          (op, prescale_factor, postscale_factor, algorithm, compression, splits))


def reducescatter_async(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                        name: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
                        *, algorithm: str | None = None,
                        compression: Compressor = Compression.none,
                        splits: Sequence[int] | np.ndarray | None = None) -> Handle:
    """Start :func:`reducescatter`; ``synchronize(handle)`` returns this rank's share."""
    return FORMS.start(False, tensor, name, process_set,
                       (op, prescale_factor, postscale_factor, algorithm, compression, splits))
