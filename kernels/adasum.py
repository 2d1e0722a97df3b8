"""The arithmetic of Adasum's pairwise combination, on host arrays (float32 or float64).

Compiled loops rather than numpy: one pass gives the dot product and both squared norms
in float64 without a float64 copy of the inputs, and stays on the calling thread (numpy's
``@`` hands float64 dot products to a multithreaded BLAS, whose threads fight the MPI
ranks for the cores). Host memory only: the collectives combine device tensors in host
copies.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _sums(a, b):
    dot = 0.0
    norm_a = 0.0
    norm_b = 0.0
    for i in range(a.size):
        x = np.float64(a[i])
        y = np.float64(b[i])
        dot += x * y
        norm_a += x * x
        norm_b += y * y
    return dot, norm_a, norm_b


@numba.njit(cache=True, nogil=True)
def _scaled_add(a, a_scale, b, b_scale):
    for i in range(a.size):
        a[i] = a_scale * np.float64(a[i]) + b_scale * np.float64(b[i])


def dot_and_norms(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    """``(a.b, |a|^2, |b|^2)`` of two 1-D arrays of one size, accumulated in float64."""
    return _sums(a, b)


def scaled_add(a: np.ndarray, a_scale: float, b: np.ndarray, b_scale: float) -> None:
    """``a = a_scale * a + b_scale * b`` in place, computed in float64 and rounded once to
    ``a``'s dtype."""
    _scaled_add(a, float(a_scale), b, float(b_scale))


__all__ = ["dot_and_norms", "scaled_add"]
