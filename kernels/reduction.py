"""The reduction step of the collectives on host arrays: ``out = a (op) b``.

The collectives call the returned function on every received segment, writing straight
into its destination while the segment is still in cache; it allocates nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import host
from .dtypes import BFLOAT16, encoding_of
from .elementwise import BFLOAT, HALF

# A float sum or product that overflows gives inf (and inf - inf gives NaN), as MPI's
# own reductions do; numpy would also warn, from inside ringtrain's code, where the
# user can do nothing about it. np.errstate around each step would cost a context
# manager's entry and exit on every call; this filter costs nothing until a warning is
# raised.
warnings.filterwarnings("ignore", r"(overflow|invalid value) encountered in "
                        r"(add|multiply|minimum|maximum)", RuntimeWarning, r"ringtrain\.")

Combine = Callable[..., None]
"""``combine(a, b, out=out)``: sets ``out = a (op) b``; ``out`` may be ``a`` or ``b``."""


def reducer(op: str, dtype: Any, encoding: str | None = None) -> Combine:
    """The function that combines two ranks' host arrays of ``dtype`` under ``op``.

    Args:
        op: ``sum``, ``average`` (sums; the caller divides), ``min``, ``max``, ``product``.
        dtype: the arrays' dtype.
        encoding: ``"bfloat16"`` when uint16 arrays hold bfloat16 bits (implied by a
            bfloat16 ``dtype``).

    Returns:
        numpy's ufunc for native dtypes (already at memory speed); for float16 and
        bfloat16 a :class:`SixteenBitReduction`, compiled loops that compute in float32
        and round once. A bfloat16 one takes bfloat16 arrays and their uint16 views alike.
    """
    encoding = encoding or encoding_of(dtype)
    if encoding is None and np.dtype(dtype) != np.float16:
        return host.NUMPY_REDUCTIONS[op]
    return SixteenBitReduction(op, encoding)


@dataclass(frozen=True)
class SixteenBitReduction:
    """``combine(a, b, out=out)`` for 16-bit floats: float16 arrays (``encoding`` None),
    or bfloat16 arrays and uint16 arrays of their bits (``encoding="bfloat16"``)."""

    op: str
    encoding: str | None

    def __call__(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        host.reduce_into(self.op, a, b, out, self.encoding)

    @property
    def code(self) -> int:
        """The value code (:mod:`.elementwise`) of this reduction on uint16 bits."""
        return host.OP_CODES[self.op] + (BFLOAT if self.encoding else HALF)


_NATIVE_CODES: dict[Callable, int] = {host.NUMPY_REDUCTIONS[op]: code
                                      for op, code in host.OP_CODES.items()}
_NATIVE_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.uint8,
                                                 np.int16, np.int32, np.int64))


def value_code(dtype: Any, combine: Combine) -> int | None:
    """How compiled code (:mod:`.elementwise`) combines values of ``dtype`` by
    ``combine`` (what :func:`reducer` returns), or None where it does not: numpy's own
    dtypes other than these, numpy functions other than the four reductions. 16-bit
    floats it takes as uint16 bits."""
    if isinstance(combine, SixteenBitReduction):
        return combine.code
    return _NATIVE_CODES.get(combine) if np.dtype(dtype) in _NATIVE_DTYPES else None


def compiled_dtype(dtype: Any) -> np.dtype:
    """The dtype compiled code holds values of ``dtype`` as: uint16 for the 16-bit floats
    (numba has no float16 or bfloat16 type on the host), else ``dtype``."""
    dtype = np.dtype(dtype)
    return _UINT16 if dtype in _SIXTEEN_BIT_DTYPES else dtype


def compiled_view(array: np.ndarray) -> np.ndarray:
    """``array`` as compiled code takes it (:func:`compiled_dtype`; no copy)."""
    return array.view(np.uint16) if array.dtype in _SIXTEEN_BIT_DTYPES else array


_SIXTEEN_BIT_DTYPES = frozenset((np.dtype(np.float16), BFLOAT16))
_UINT16 = np.dtype(np.uint16)
