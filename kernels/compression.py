"""Gradient compression: the 16-bit wire formats a float32 tensor can travel in.

A compressor is a small strategy object. The collectives use :meth:`Compressor.encode`
and :meth:`Compressor.decode` around a reduction of the wire buffer; users of Horovod's
interface call ``compress(t) -> (t, ctx)`` and ``decompress(t, ctx)``.

Numerics. float16 holds magnitudes up to 65504 and flushes those below 6e-8 to zero;
gradients are often far smaller (std 1e-6 loses a few percent of its values in a plain
cast). :class:`FP16Compressor` therefore multiplies by a power of two chosen from the
largest magnitude over all ranks, so that the sum of every rank's values stays below
2**15 (no overflow at any step of the reduction) while small values move up, out of the
flush-to-zero range; a power of two changes no significant bit, and dividing it out is
exact. bfloat16 has float32's range and 8 significant bits: no scale is needed, but
rounding is ~8x coarser than float16's. With ``error_feedback`` the part of each value
that the cast lost is kept (per tensor name) and added before the next cast, so repeated
rounding does not bias training.

Only float32 tensors are compressed; other dtypes travel as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import dispatch

HALF_SUM_LIMIT = 2.0 ** 15
"""float16 scaling keeps the sum over all ranks below this (float16 max is 65504)."""

_SCALE_EXPONENTS = (-126, 100)


@dataclass(frozen=True)
class CompressionContext:
    """What :meth:`Compressor.decompress` needs to undo :meth:`Compressor.compress`.

    Attributes:
        dtype: the original dtype.
        scale: the factor applied before the cast.
        nonfinite: whether the original held inf or NaN (they pass through the cast).
    """

    dtype: np.dtype
    scale: float = 1.0
    nonfinite: bool = False


class Compressor:
    """No compression: the tensor travels as it is. Base of the 16-bit compressors.

    Attributes:
        name: how errors and call signatures name the format.
        wire_dtype: the storage dtype on the wire (None: the tensor's own).
        encoding: what :func:`ringtrain.kernels.reduce_into` needs to know of it.
        needs_range: whether encoding needs the largest magnitude over all ranks.
        error_feedback: whether residuals are kept per tensor name.
    """

    name = "none"
    wire_dtype: np.dtype | None = None
    encoding: str | None = None
    needs_range = False

    def __init__(self, error_feedback: bool = False):
        self.error_feedback = error_feedback
        self._residuals: dict[str, Any] = {}

    def applies_to(self, dtype: Any) -> bool:
        """Whether tensors of ``dtype`` travel compressed (float32 only)."""
        return self.wire_dtype is not None and np.dtype(dtype) == np.float32

    def scale_for(self, abs_max: float, ranks: int) -> float:
        """The factor applied before the cast, given the largest magnitude over all ranks."""
        return 1.0

    def encode(self, source: Any, wire: Any, scale: float, key: str | None = None) -> None:
        """Write ``source * scale`` into ``wire`` in the wire format.

        Args:
            source: float32, host or device.
            wire: the wire buffer, same size.
            scale: as :meth:`scale_for` chose it (times any prescale).
            key: names the tensor's residual; required with error feedback.

        Raises:
            ValueError: error feedback without a key.
        """
        raise NotImplementedError

    def decode(self, wire: Any, out: Any, scale: float) -> None:
        """Write ``wire * scale`` into float32 ``out``."""
        raise NotImplementedError

    def residual(self, key: str) -> Any:
        """The error-feedback residual kept for ``key`` (None before its first encode)."""
        return self._residuals.get(key)

    def reset(self) -> None:
        """Forget every residual (e.g. after loading a checkpoint)."""
        self._residuals.clear()

    def _residual_for(self, key: str | None, source: Any) -> Any:
        if not self.error_feedback:
            return None
        if key is None:
            raise ValueError(f"{self.name} compression with error feedback keeps a residual "
                             f"per tensor: give the tensor a name")
        residual = self._residuals.get(key)
        if residual is None or residual.shape != source.shape:
            residual = self._residuals[key] = dispatch.zeros_like(source)
        return residual

    def compress(self, tensor: Any) -> tuple[Any, CompressionContext]:
        """Horovod's interface: the tensor in the wire format, and how to undo it.

        The scale comes from this tensor alone (as if it were the only rank's).
        Tensors this compressor does not apply to are returned as they are.
        """
        dtype = dispatch.dtype_of(tensor)
        if not self.applies_to(dtype):
            return tensor, CompressionContext(dtype)
        abs_max, nonfinite = dispatch.abs_max(tensor) if self.needs_range else (0.0, False)
        scale = self.scale_for(abs_max, 1)
        wire = dispatch.empty_like(tensor, self.wire_dtype)
        self.encode(tensor, wire, scale)
        return wire, CompressionContext(dtype, scale, nonfinite)

    def decompress(self, tensor: Any, ctx: CompressionContext) -> Any:
        """Horovod's interface: undo :meth:`compress` (a new array of the original dtype)."""
        if dispatch.dtype_of(tensor) == ctx.dtype:
            return tensor
        out = dispatch.empty_like(tensor, ctx.dtype)
        self.decode(tensor, out, 1.0 / ctx.scale)
        return out

    def __repr__(self) -> str:
        feedback = ", error_feedback=True" if self.error_feedback else ""
        return f"{type(self).__name__}({feedback.lstrip(', ')})"


class NoneCompressor(Compressor):
    """Horovod's ``Compression.none``: nothing is compressed."""


class FP16Compressor(Compressor):
    """float16 on the wire, with a power-of-two scale from the largest magnitude."""

    name = "fp16"
    wire_dtype = np.dtype(np.float16)
    needs_range = True

    def scale_for(self, abs_max: float, ranks: int) -> float:
        """The largest power of two keeping ``ranks * abs_max * scale`` below 2**15."""
        if not abs_max > 0.0 or not math.isfinite(abs_max):
            return 1.0
        low, high = _SCALE_EXPONENTS
        ratio = HALF_SUM_LIMIT / (ranks * abs_max)
        if not math.isfinite(ratio):
            return math.ldexp(1.0, high)
        _, exponent = math.frexp(ratio)
        return math.ldexp(1.0, min(max(exponent - 1, low), high))

    def encode(self, source: Any, wire: Any, scale: float, key: str | None = None) -> None:
        """float32 -> float16 (see :meth:`Compressor.encode`)."""
        dispatch.encode_half(source, wire, scale, self._residual_for(key, source))

    def decode(self, wire: Any, out: Any, scale: float) -> None:
        """float16 -> float32 (see :meth:`Compressor.decode`)."""
        dispatch.decode_half(wire, out, scale)


class BF16Compressor(Compressor):
    """bfloat16 on the wire (uint16 bits): float32's range, no scale needed."""

    name = "bf16"
    wire_dtype = np.dtype(np.uint16)
    encoding = "bfloat16"

    def encode(self, source: Any, wire: Any, scale: float, key: str | None = None) -> None:
        """float32 -> bfloat16 (see :meth:`Compressor.encode`)."""
        dispatch.encode_bfloat(source, wire, scale, self._residual_for(key, source))

    def decode(self, wire: Any, out: Any, scale: float) -> None:
        """bfloat16 -> float32 (see :meth:`Compressor.decode`)."""
        dispatch.decode_bfloat(wire, out, scale)


class Compression:
    """The compressors by Horovod's names, plus ``bf16``.

    ``Compression.fp16`` and ``Compression.bf16`` keep no state; for error feedback
    make your own: ``FP16Compressor(error_feedback=True)``.
    """

    none = NoneCompressor()
    fp16 = FP16Compressor()
    bf16 = BF16Compressor()
