"""Gradients of pruned weights left out of the buckets: which elements travel, and the copies.

A bucket whose gradients have masks is a flat buffer of only their kept elements, one
gradient after the other without padding, so its message shrinks with the sparsity.
Before the allreduce each gradient's kept elements are gathered into the buffer; after
it they are scattered back and the pruned elements set to zero (what a dense reduction
of the zero gradients of pruned weights gives, whatever a rank held there).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..collectives.errors import InvalidArgumentError, subject
from ..kernels import gather_indexed, scatter_indexed


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


def kept_name(name: str, kept: Sequence[np.ndarray | None]) -> str:
    """``name`` of a bucket with a digest of which elements of its members travel (each
    member's kept flat indices; None: all). The collectives compare the names, so ranks
    whose masks differ fail the bucket on every rank, also where the masks keep as many
    elements."""
    digest = hashlib.blake2b(digest_size=4)
    for indices in kept:
        digest.update(b"all" if indices is None else indices.tobytes())
        digest.update(b"|")
    return f"{name}, kept elements {digest.hexdigest()}"


def gather_kept(gradient: np.ndarray, kept: KeptElements | None, out: np.ndarray) -> None:
    """Copy the kept elements of ``gradient`` (all of them for None) into flat ``out``."""
    if kept is None:
        out[...] = gradient.reshape(-1)
    else:
        gather_indexed(np.ascontiguousarray(gradient), kept.kept, out)


def scatter_kept(source: np.ndarray, kept: KeptElements | None, gradient: np.ndarray) -> None:
    """Write flat ``source`` back into the kept elements of ``gradient``, zeros into its
    pruned ones."""
    if kept is None:
        gradient[...] = source.reshape(gradient.shape)
    elif gradient.flags.c_contiguous:
        scatter_indexed(source, kept.kept, gradient)
    else:
        target = np.empty(gradient.shape, gradient.dtype)
        scatter_indexed(source, kept.kept, target)
        gradient[...] = target
