"""Elementwise steps for compiled callers: combine two ranks' values, prescale them, finish
a sum, inside machine code that moves the data (the collectives' compiled exchange and
ring), on every payload dtype.

A *value code* says how: an op code (:data:`.host.OP_CODES`: 0 add, 1 minimum, 2 maximum,
3 multiply) for numpy's own dtypes; plus :data:`HALF` or :data:`BFLOAT` for the 16-bit
floats, which compiled code holds as their uint16 bit patterns and computes in float32,
rounding once, as the host kernels do (bit for bit: these steps run the host kernels'
serial loops). Each function is compiled for the arrays it is given: the 16-bit loops
only where they are uint16.

Native values combine as numpy's ufuncs do, except that a minimum or maximum of +0 and
-0 is -0 or +0 whatever the operands' order (numpy returns its second operand on a tie).
The 16-bit loops return their first operand on that tie, as the host kernels do: the
exchanges combine the lower ranks' values first, so that every rank gets the same bits.
Factors are those of :func:`factors_for`.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import overload, register_jitable

from .host import SERIAL_SIXTEEN_BIT_LOOPS

HALF = 4
"""Added to an op code: float16 values, as uint16 bits."""
BFLOAT = 8
"""Added to an op code: bfloat16 values, as uint16 bits."""

_LOOPS = SERIAL_SIXTEEN_BIT_LOOPS
_add_half, _minimum_half, _maximum_half, _multiply_half = (
    _LOOPS[f"{name}_half"] for name in ("add", "minimum", "maximum", "multiply"))
_add_bfloat, _minimum_bfloat, _maximum_bfloat, _multiply_bfloat = (
    _LOOPS[f"{name}_bfloat"] for name in ("add", "minimum", "maximum", "multiply"))
_scale_half, _divide_half = _LOOPS["scale_half"], _LOOPS["divide_half"]
_scale_bfloat, _divide_bfloat = _LOOPS["scale_bfloat"], _LOOPS["divide_bfloat"]


def factors_for(code: int, dtype: np.dtype, values: tuple[float, ...]) -> np.ndarray:
    """``values`` (a prescale, a divisor, a postscale) as the compiled steps take them:
    in ``dtype`` for native values; as float32 for 16-bit ones, each first rounded as the
    host's arithmetic rounds it (to float16 for float16 values, as numpy casts a Python
    float; straight to float32 for bfloat16, as :func:`.host.scale_into` does)."""
    if code >= BFLOAT:
        return np.array(values, np.float32)
    if code >= HALF:
        return np.array(values, np.float16).astype(np.float32)
    return np.array(values).astype(dtype)


@numba.njit(cache=True, nogil=True, inline="always")
def pick(op: int, a, b):
    """``a`` and ``b`` combined by op code ``op`` (native values; see the module's note
    on minimum and maximum)."""
    if op == 0:
        return a + b
    if op == 3:
        return a * b
    if a != a:
        return a
    if b != b:
        return b
    if a == b:
        if a == 0:  # +0 and -0: -0 for the minimum, +0 for the maximum, in either order
            return -((-a) + (-b)) if op == 1 else a + b
        return a
    if op == 1:
        return a if a < b else b
    return a if a > b else b


def combine_values(code: int, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a (code) b`` elementwise; ``out`` may be ``a`` or ``b``. Compiled code
    only (defined for each array type below)."""
    raise TypeError("combine_values is called from compiled code")


def scale_values(code: int, a: np.ndarray, factor, out: np.ndarray) -> None:
    """``out = a * factor``, rounded to the values' type; ``out`` may be ``a``. Compiled
    code only."""
    raise TypeError("scale_values is called from compiled code")


def finish_values(code: int, a: np.ndarray, factors: np.ndarray, out: np.ndarray) -> None:
    """``out = a / factors[1] * factors[2]``, each operation rounded to the values' type
    and skipped where its factor is 1; ``out`` may be ``a``. Compiled code only."""
    raise TypeError("finish_values is called from compiled code")


def _holds_bits(array: types.Type) -> bool:
    return isinstance(array, types.Array) and array.dtype == types.uint16


@overload(combine_values, jit_options={"nogil": True})
def _combine_values(code, a, b, out):
    return _combine_bits if _holds_bits(out) else _combine_native


@overload(scale_values, jit_options={"nogil": True})
def _scale_values(code, a, factor, out):
    return _scale_bits if _holds_bits(out) else _scale_native


@overload(finish_values, jit_options={"nogil": True})
def _finish_values(code, a, factors, out):
    return _finish_bits if _holds_bits(out) else _finish_native


def _combine_native(code, a, b, out):
    # Each form names two arrays apart, so that the compiler's check for overlapping
    # arrays passes and the loop runs on vectors (with out an alias of a or b, three
    # names would fail it, and the loop run one element at a time).
    count = out.size
    if out.ctypes.data == a.ctypes.data:
        if code == 0:
            for i in range(count):
                out[i] += b[i]
        elif code == 3:
            for i in range(count):
                out[i] *= b[i]
        else:
            for i in range(count):
                out[i] = pick(code, out[i], b[i])
    elif out.ctypes.data == b.ctypes.data:
        if code == 0:
            for i in range(count):
                out[i] = a[i] + out[i]
        elif code == 3:
            for i in range(count):
                out[i] = a[i] * out[i]
        else:
            for i in range(count):
                out[i] = pick(code, a[i], out[i])
    elif code == 0:
        for i in range(count):
            out[i] = a[i] + b[i]
    elif code == 3:
        for i in range(count):
            out[i] = a[i] * b[i]
    else:
        for i in range(count):
            out[i] = pick(code, a[i], b[i])


def _combine_bits(code, a, b, out):
    if code == HALF:
        _add_half(a, b, out)
    elif code == HALF + 1:
        _minimum_half(a, b, out)
    elif code == HALF + 2:
        _maximum_half(a, b, out)
    elif code == HALF + 3:
        _multiply_half(a, b, out)
    elif code == BFLOAT:
        _add_bfloat(a, b, out)
    elif code == BFLOAT + 1:
        _minimum_bfloat(a, b, out)
    elif code == BFLOAT + 2:
        _maximum_bfloat(a, b, out)
    else:
        _multiply_bfloat(a, b, out)


def _scale_native(code, a, factor, out):
    for i in range(out.size):
        out[i] = a[i] * factor


@register_jitable
def _scale_bits(code, a, factor, out):
    if code >= BFLOAT:
        _scale_bfloat(a, np.float32(factor), out)
    else:
        _scale_half(a, np.float32(factor), out)


@register_jitable
def _divide_bits(code, a, divisor, out):
    if code >= BFLOAT:
        _divide_bfloat(a, np.float32(divisor), out)
    else:
        _divide_half(a, np.float32(divisor), out)


def _finish_native(code, a, factors, out):
    divisor, postscale = factors[1], factors[2]
    if divisor != 1 and postscale != 1:
        for i in range(out.size):
            out[i] = a[i] / divisor * postscale
    elif divisor != 1:
        for i in range(out.size):
            out[i] = a[i] / divisor
    elif postscale != 1:
        for i in range(out.size):
            out[i] = a[i] * postscale
    elif out.ctypes.data != a.ctypes.data:
        for i in range(out.size):
            out[i] = a[i]


def _finish_bits(code, a, factors, out):
    divisor, postscale = factors[1], factors[2]
    if divisor != 1:
        _divide_bits(code, a, divisor, out)
        if postscale != 1:
            _scale_bits(code, out, postscale, out)
    elif postscale != 1:
        _scale_bits(code, a, postscale, out)
    elif out.ctypes.data != a.ctypes.data:
        for i in range(out.size):
            out[i] = a[i]
