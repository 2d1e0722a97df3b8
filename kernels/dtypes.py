"""bfloat16, the one dtype the kernels take beyond numpy's own.

On the host it is ``ml_dtypes.bfloat16`` (the numpy bfloat16 that JAX and others use);
numba compiles no arithmetic for it and MPI has no datatype for it, so the kernels and
the collectives handle it as its 16 bits, a uint16 array (:func:`bits`). On a GPU,
numba has no bfloat16 type either: a bfloat16 device array is a uint16 device array
whose ``__cuda_array_interface__`` says :data:`BFLOAT16_TYPESTR`, a typestr numpy
maps back to bfloat16.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
"""numpy's bfloat16 dtype (``ml_dtypes.bfloat16``)."""

BFLOAT16_TYPESTR = "bfloat16"
"""The ``__cuda_array_interface__`` typestr of bfloat16 device memory:
``numpy.dtype("bfloat16")`` is :data:`BFLOAT16`."""

BFLOAT16_ENCODING = "bfloat16"
"""The ``encoding`` the reduction kernels take for uint16 arrays that hold bfloat16 bits."""


def is_floating(dtype: Any) -> bool:
    """Whether ``dtype`` holds floating-point numbers: numpy's floats and bfloat16 (whose
    numpy kind is ``V``)."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype == BFLOAT16


def encoding_of(dtype: Any) -> str | None:
    """The kernels' ``encoding`` for arrays of ``dtype``: ``"bfloat16"`` for bfloat16, None
    for numpy's own dtypes."""
    return BFLOAT16_ENCODING if np.dtype(dtype) == BFLOAT16 else None


def bits(array: np.ndarray) -> np.ndarray:
    """A bfloat16 host array as its 16-bit patterns (a uint16 view, no copy): how MPI and
    the compiled loops take it. Any other array is returned as it is."""
    return array.view(np.uint16) if array.dtype == BFLOAT16 else array
