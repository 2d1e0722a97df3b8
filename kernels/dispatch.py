"""The kernels' entry points: each call runs the host twin or the device twin.

numpy arrays go to :mod:`.host`; device arrays (``__cuda_array_interface__``, or the
CUDA simulator's arrays) to :mod:`.device`, imported on first use. Arguments and
results are documented on the host twins.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from . import host
from .layout import FusionLayout


def twin_for(array: Any) -> ModuleType:
    """The module whose kernels take ``array``: :mod:`.host` or :mod:`.device`.

    Raises:
        TypeError: ``array`` is neither a numpy array nor a device array.
    """
    if isinstance(array, np.ndarray):
        return host
    from . import device
    if device.is_device_array(array):
        return device
    raise TypeError(f"expected a numpy array or a device array, got {type(array).__name__}")


def pack(layout: FusionLayout, tensors: Sequence[Any], buffer: Any,
         scale: float = 1.0) -> None:
    """Copy ``tensors`` into ``buffer`` at the layout's offsets, times ``scale``."""
    twin_for(buffer).pack(layout, tensors, buffer, scale)


def unpack(layout: FusionLayout, buffer: Any, tensors: Sequence[Any],
           scale: float = 1.0) -> None:
    """Copy ``buffer`` back out into ``tensors``, times ``scale``."""
    twin_for(buffer).unpack(layout, buffer, tensors, scale)


def encode_half(source: Any, wire: Any, scale: float = 1.0, residual: Any = None) -> None:
    """float32 -> float16 with a fused scale and optional error feedback."""
    twin_for(source).encode_half(source, wire, scale, residual)


def decode_half(wire: Any, out: Any, scale: float = 1.0) -> None:
    """float16 -> float32 with a fused scale."""
    twin_for(wire).decode_half(wire, out, scale)


def encode_bfloat(source: Any, wire: Any, scale: float = 1.0, residual: Any = None) -> None:
    """float32 -> bfloat16 bits (uint16) with a fused scale and optional error feedback."""
    twin_for(source).encode_bfloat(source, wire, scale, residual)


def decode_bfloat(wire: Any, out: Any, scale: float = 1.0) -> None:
    """bfloat16 bits (uint16) -> float32 with a fused scale."""
    twin_for(wire).decode_bfloat(wire, out, scale)


def quantize_2bit(gradient: Any, residual: Any, words: Any, threshold: float) -> None:
    """MXNet's 2-bit quantization of ``gradient + residual``, 16 elements per uint32 word."""
    twin_for(gradient).quantize_2bit(gradient, residual, words, threshold)


def dequantize_2bit(words: Any, out: Any, threshold: float) -> None:
    """The +t, -t or 0 each element of 2-bit ``words`` stands for, into float32 ``out``."""
    twin_for(out).dequantize_2bit(words, out, threshold)


def gather_indexed(source: Any, indices: Any, out: Any) -> None:
    """``out[j] = source.flat[indices[j]]``: the chosen elements, packed."""
    twin_for(source).gather_indexed(source, indices, out)


def scatter_indexed(source: Any, indices: Any, out: Any) -> None:
    """``out.flat[indices[j]] = source[j]``, zero elsewhere in ``out``."""
    twin_for(out).scatter_indexed(source, indices, out)


def reduce_into(op: str, a: Any, b: Any, out: Any, encoding: str | None = None) -> None:
    """``out = a (op) b`` elementwise; 16-bit floats computed in float32."""
    twin_for(out).reduce_into(op, a, b, out, encoding)


def scale_into(a: Any, factor: float, out: Any, encoding: str | None = None) -> None:
    """``out = a * factor``; bfloat16 computed in float32."""
    twin_for(out).scale_into(a, factor, out, encoding)


def divide_into(a: Any, divisor: int, out: Any, encoding: str | None = None) -> None:
    """``out = a / divisor``, correctly rounded; bfloat16 computed in float32."""
    twin_for(out).divide_into(a, divisor, out, encoding)


def abs_max(values: Any) -> tuple[float, bool]:
    """Largest finite magnitude, and whether any value is inf or NaN."""
    return twin_for(values).abs_max(values)


def empty_like(array: Any, dtype: Any) -> Any:
    """A new array of ``array``'s shape and kind (host or device) and the given dtype."""
    return twin_for(array).empty_like(array, dtype)


def zeros_like(array: Any) -> Any:
    """A new zeroed array like ``array`` (same shape, dtype and kind)."""
    return twin_for(array).zeros_like(array)


def dtype_of(array: Any) -> np.dtype:
    """The numpy dtype of a host or device array (torch tensors included)."""
    return twin_for(array).dtype_of(array)
