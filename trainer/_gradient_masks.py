"""Gradients of pruned weights left out of the buckets: which elements travel, and the copies.

A bucket whose gradients have masks is a flat buffer of only their kept elements, one
gradient after the other without padding, so its message shrinks with the sparsity.
Before the allreduce each gradient's kept elements are gathered into the buffer; after
it they are scattered back and the pruned elements set to zero (what a dense reduction
of the zero gradients of pruned weights gives, whatever a rank held there).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..collectives.errors import InvalidArgumentError, subject


class KeptElements:
    """The flat indices of a gradient's kept elements.

    Attributes:
        kept: int64 indices of the elements that travel, ascending.
    """

    def __init__(self, mask: np.ndarray):
        self.kept = np.flatnonzero(mask.reshape(-1))

    @property
    def count(self) -> int:
        """How many elements travel."""
        return len(self.kept)


def kept_elements(name: str, shape: tuple[int, ...], mask: Any) -> KeptElements | None:
    """The kept elements of gradient ``name`` under ``mask`` (nonzero: kept), or None when
    the mask is None or keeps everything (the gradient travels whole).

    Raises:
        InvalidArgumentError: a mask whose shape is not the gradient's.
    """
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.shape != shape:
        raise InvalidArgumentError(
            f"{subject('set_masks', name)}: the mask has shape {mask.shape}; the gradient "
            f"has {shape}")
    mask = mask != 0
    return None if mask.all() else KeptElements(mask)


def gather_kept(gradient: np.ndarray, kept: KeptElements | None, out: np.ndarray) -> None:
    """Copy the kept elements of ``gradient`` (all of them for None) into flat ``out``."""
    flat = gradient.reshape(-1)
    if kept is None:
        out[...] = flat
    else:
        np.take(flat, kept.kept, out=out)


def scatter_kept(source: np.ndarray, kept: KeptElements | None, gradient: np.ndarray) -> None:
    """Write flat ``source`` back into the kept elements of ``gradient``, zeros into its
    pruned ones."""
    flat = gradient.reshape(-1) if gradient.flags.c_contiguous else None
    target = np.empty(gradient.size, gradient.dtype) if flat is None else flat
    if kept is None:
        target[...] = source
    else:
        target.fill(0)  # a pass over memory costs less than indexing the pruned ones
        target[kept.kept] = source
    if flat is None:
        gradient[...] = target.reshape(gradient.shape)
