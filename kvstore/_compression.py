"""Gradient compression of pushes: MXNet's 2-bit scheme.

A worker quantizes each pushed gradient plus the residual it kept from the earlier
pushes of that key to +t, -t or 0, 16 elements per 32-bit word (16 times fewer bytes than
float32), and keeps what was not sent as the new residual; the values are dequantized
where they are summed (every worker in the sync modes, the server in the async ones).
The kernels are :func:`ringtrain.kernels.quantize_2bit` / ``dequantize_2bit``. Floating
values are quantized in float32; integer keys cannot be compressed.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..collectives import InvalidArgumentError, UnsupportedDtypeError
from ..kernels import dequantize_2bit, quantize_2bit
from ..kernels.two_bit import words_for
from ._keys import label

TYPES = ("none", "2bit")
DEFAULT_THRESHOLD = 0.5


class TwoBit:
    """The 2-bit compressor of one worker: its threshold and its residual per key.

    Args:
        threshold: t > 0.
    """

    def __init__(self, threshold: float):
        self.threshold = float(threshold)
        self.residuals: dict[Any, np.ndarray] = {}

    def compress(self, key: Any, gradient: np.ndarray, shown: Any = None) -> np.ndarray:
        """The uint32 words of ``gradient`` (any float dtype), updating the key's residual.

        Args:
            key: what the residual is kept under (a key, or a key and its part).
            shown: the key as errors name it (default ``key``).
        """
        if gradient.dtype.kind != "f" and str(gradient.dtype) != "bfloat16":
            raise UnsupportedDtypeError(
                f"kvstore push of {label(key if shown is None else shown)}: 2-bit "
                f"compression takes floating values, got {gradient.dtype}")
        flat = np.ascontiguousarray(gradient, dtype=np.float32).reshape(-1)
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = np.zeros(flat.size, np.float32)
        words = np.empty(words_for(flat.size), np.uint32)
        quantize_2bit(flat, residual, words, self.threshold)
        return words


def decompress(words: np.ndarray, count: int, threshold: float) -> np.ndarray:
    """The float32 values (``count`` of them) that 2-bit ``words`` stand for."""
    out = np.empty(count, np.float32)
    dequantize_2bit(np.ascontiguousarray(words, dtype=np.uint32).reshape(-1), out, threshold)
    return out


def from_params(params: Mapping[str, Any]) -> TwoBit | None:
    """The compressor MXNet's ``set_gradient_compression`` parameters ask for (None: none).

    Raises:
        InvalidArgumentError: an unknown type, or a threshold that is not a number > 0.
    """
    if not isinstance(params, Mapping):
        raise InvalidArgumentError(f"kvstore set_gradient_compression: expected a dict like "
                                   f"{{'type': '2bit', 'threshold': 0.5}}, got {params!r}")
    kind = params.get("type", "none")
    if kind not in TYPES:
        raise InvalidArgumentError(f"kvstore set_gradient_compression: unknown type {kind!r}; "
                                   f"the types are {', '.join(TYPES)}")
    unknown = sorted(set(params) - {"type", "threshold"})
    if unknown:
        raise InvalidArgumentError(f"kvstore set_gradient_compression: unknown parameters "
                                   f"{unknown}; it takes 'type' and 'threshold'")
    if kind == "none":
        return None
    threshold = params.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or \
            not np.isfinite(threshold) or threshold <= 0:
        raise InvalidArgumentError(f"kvstore set_gradient_compression: the 2-bit threshold "
                                   f"must be a number > 0, got {threshold!r}")
    return TwoBit(threshold)
