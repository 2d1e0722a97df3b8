"""The reduction step of the collectives on host arrays: ``out = a (op) b``.

The collectives call the returned function on every received segment, writing straight
into its destination while the segment is still in cache; it allocates nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from . import host
from .dtypes import encoding_of

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
        bfloat16 a compiled loop that computes in float32 and rounds once. A bfloat16
        one takes bfloat16 arrays and their uint16 views alike.
    """
    encoding = encoding or encoding_of(dtype)
    if encoding is None and np.dtype(dtype) != np.float16:
        return host.NUMPY_REDUCTIONS[op]

    def combine(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        host.reduce_into(op, a, b, out, encoding)

    return combine
