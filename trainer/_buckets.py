"""Which gradients travel together: the fusion buckets, assigned once per model.

Gradients become ready during the backward pass roughly in the reverse of the order in
which their parameters were registered (the last layer's first). Buckets are therefore
filled in that reverse order, so the first bucket completes early and its allreduce
overlaps the rest of the backward pass. The first bucket is kept small (its
allreduce should start as soon as possible); the others grow up to the fusion
threshold, large enough that per-message costs vanish, small enough that
communication starts long before the backward pass ends. A bucket holds one dtype.
Large gradients travel alone, reduced in place: fusion pays off for small tensors, whose
messages cost more than their bytes, not for large ones, whose copies into and out of
a bucket would cost more than their message. The kept elements of masked gradients
(pruning) are copied in any case, so they fuse whatever their size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..collectives.config import current_settings
from ..collectives.errors import InvalidArgumentError
from ..common.environment import FUSION_THRESHOLD

DEFAULT_FUSION_THRESHOLD: int = FUSION_THRESHOLD.default
"""Bytes per bucket unless told otherwise (see docs/trainer.md for the measurement)."""

DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
"""The first bucket's limit: small, so communication starts early in the backward pass."""

DEFAULT_ALONE_BYTES = 256 << 10
"""Gradients this large are never copied into a bucket: on the host, copying one in and
out costs more than the message it would save (see docs/trainer.md)."""


@dataclasses.dataclass(frozen=True)
class GradientSpec:
    """What the reducer knows of one gradient before it exists: name, shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the gradient."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def fusion_threshold(explicit: int | None = None) -> int:
    """The bucket size limit in bytes: ``explicit``, else the ``fusion_threshold`` setting
    (``ringtrain.configure(fusion_threshold=...)``, else ``RINGTRAIN_FUSION_THRESHOLD``,
    else :data:`DEFAULT_FUSION_THRESHOLD`). 0 turns fusion off (one gradient per bucket).

    Raises:
        InvalidArgumentError: ``explicit`` is negative or not an integer.
    """
    if explicit is not None:
        if not isinstance(explicit, int) or isinstance(explicit, bool) or explicit < 0:
            raise InvalidArgumentError(
                f"fusion_threshold must be a number of bytes >= 0, got {explicit!r}")
        return explicit
    return current_settings().fusion_threshold


def assign_buckets(specs: Sequence[GradientSpec], threshold: int,
                   first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                   alone_bytes: int = DEFAULT_ALONE_BYTES,
                   copied: Sequence[bool] | None = None) -> list[list[int]]:
    """Group gradients (given in registration order) into buckets.

    Gradients are taken in reverse registration order. One of ``alone_bytes`` or more
    (or as large as the bucket limit) is a bucket of its own, reduced where it lies,
    unless ``copied`` says it is copied into a buffer anyway (a masked gradient's kept
    elements): then only the bucket limit sends it alone.
    Each other one joins the open bucket of its dtype, unless it would take that bucket
    past its limit (``first_bucket_bytes`` for the first bucket closed, ``threshold``
    afterwards): then the open bucket is closed first. With ``threshold`` 0 every
    gradient is a bucket of its own.

    Returns:
        Buckets as lists of indices into ``specs``, ordered by when they are expected to
        be complete (their last gradient ready): the order in which every rank
        launches them.
    """
    closed: list[list[int]] = []
    open_buckets: dict[np.dtype, list[int]] = {}
    open_bytes: dict[np.dtype, int] = {}

    def limit() -> int:
        return min(first_bucket_bytes, threshold) if not closed else threshold

    def close(dtype: np.dtype) -> None:
        closed.append(open_buckets.pop(dtype))
        del open_bytes[dtype]

    for index in reversed(range(len(specs))):
        spec = specs[index]
        alone = limit() if copied is not None and copied[index] else min(alone_bytes, limit())
        if spec.nbytes >= alone:
            closed.append([index])
            continue
        if spec.dtype in open_buckets and open_bytes[spec.dtype] + spec.nbytes > limit():
            close(spec.dtype)
        open_buckets.setdefault(spec.dtype, []).append(index)
        open_bytes[spec.dtype] = open_bytes.get(spec.dtype, 0) + spec.nbytes
        if open_bytes[spec.dtype] >= limit():
            close(spec.dtype)
    closed.extend(open_buckets.values())
    return sorted(closed, key=lambda bucket: -bucket[-1])
