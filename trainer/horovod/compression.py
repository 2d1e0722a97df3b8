"""Horovod's ``Compression`` for torch tensors: ``compress(tensor) -> (tensor, ctx)``.

The collectives here call ``compress`` before sending and ``decompress`` on the
result, as Horovod does. :class:`DistributedOptimizer` goes further with the two
built-in compressors: it hands the matching ringtrain compressor (``wire``) to its
gradient buckets, which scale into the 16-bit range before they cast.
"""

from __future__ import annotations

from typing import Any

from ...kernels.compression import Compression as WireCompression
from ...kernels.compression import Compressor as WireCompressor


class Compressor:
    """Turns a tensor into what travels and back; the base class sends tensors as they are.

    Attributes:
        wire: the ringtrain compressor that does the same in a gradient bucket.
    """

    wire: WireCompressor = WireCompression.none

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return the tensor to send and what :meth:`decompress` needs to restore it."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return the received ``tensor`` as the caller's dtype (``ctx`` from compress)."""
        return tensor


class NoneCompressor(Compressor):
    """Sends tensors as they are."""


class FP16Compressor(Compressor):
    """Sends floating tensors as float16 (half the bytes); other dtypes as they are."""

    wire = WireCompression.fp16

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Cast a floating ``tensor`` to float16; the context is its dtype."""
        if tensor.dtype.is_floating_point:
            return tensor.type(_torch().float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Cast back to the dtype ``compress`` saw."""
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.type(ctx)
        return tensor


class Compression:
    """The compressors by name, as in Horovod: ``Compression.none``, ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def _torch() -> Any:
    import torch
    return torch
