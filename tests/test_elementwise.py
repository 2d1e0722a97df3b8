"""The elementwise steps of compiled callers (ringtrain/kernels/elementwise.py) against the
host kernels and numpy: the same bits, in place and out of place, for every op, on the
16-bit floats' bits and on numpy's own dtypes."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from ringtrain.collectives.base._finishing import Finisher
from ringtrain.kernels import BFLOAT16, host, reducer
from ringtrain.kernels.elementwise import (combine_values, factors_for, finish_values,
                                           scale_values)
from ringtrain.kernels.reduction import compiled_dtype, compiled_view, value_code

SIXTEEN_BIT = (np.dtype(np.float16), BFLOAT16)
OPS = ("sum", "min", "max", "product")


@numba.njit(cache=False)
def _combine(code, a, b, out):
    combine_values(code, a, b, out)


@numba.njit(cache=False)
def _scale(code, a, factor, out):
    scale_values(code, a, factor, out)


@numba.njit(cache=False)
def _finish(code, a, factors, out):
    finish_values(code, a, factors, out)


def _operands(dtype: np.dtype, size: int = 37) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(size)
    a, b = ((rng.standard_normal(size) * 4).astype(np.float32).astype(dtype) for _ in "ab")
    a[:6] = np.array([0.0, -0.0, np.inf, -np.inf, 1.0, np.nan], np.float32).astype(dtype)
    b[:6] = np.array([-0.0, 0.0, 2.0, np.inf, 1.0, 3.0], np.float32).astype(dtype)
    return a, b


def _bits(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_16_bit_values_combine_as_the_host_kernels_do(dtype, op):
    a, b = _operands(dtype)
    combine = reducer(op, dtype)
    expected = np.empty_like(a)
    combine(a, b, out=expected)
    code = value_code(dtype, combine)
    out = np.empty_like(a)
    _combine(code, compiled_view(a), compiled_view(b), compiled_view(out))
    assert np.array_equal(_bits(out), _bits(expected))
    in_place = a.copy()
    _combine(code, compiled_view(in_place), compiled_view(b), compiled_view(in_place))
    assert np.array_equal(_bits(in_place), _bits(expected))
    into_second = b.copy()
    _combine(code, compiled_view(a), compiled_view(into_second), compiled_view(into_second))
    assert np.array_equal(_bits(into_second), _bits(expected))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.uint8], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_native_values_combine_as_numpy_does_but_zero_ties(dtype, op):
    a, b = (_operands(dtype) if np.dtype(dtype).kind == "f" else
            (np.arange(37).astype(dtype), (np.arange(37)[::-1] % 7).astype(dtype)))
    with np.errstate(all="ignore"):
        expected = host.NUMPY_REDUCTIONS[op](a, b)
    if op in ("min", "max") and np.dtype(dtype).kind == "f":
        expected[:2] = -0.0 if op == "min" else 0.0  # either order; numpy keeps the second
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        _combine(value_code(dtype, reducer(op, dtype)), a, b, out)
    assert np.array_equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
@pytest.mark.parametrize("divisor, postscale", [(3, 1.0), (1, 0.3), (4, 1.7), (1, 1.0)])
def test_16_bit_values_finish_as_the_finisher_does(dtype, divisor, postscale):
    a, _ = _operands(dtype)
    code = value_code(dtype, reducer("sum", dtype))
    expected = a.copy()
    if divisor != 1 or postscale != 1.0:
        Finisher(divisor, postscale, "bfloat16" if dtype == BFLOAT16 else None)(expected)
    factors = factors_for(code, dtype, (1.0, divisor, postscale))
    assert factors.dtype == np.float32
    out = np.empty_like(a)
    _finish(code, compiled_view(a), factors, compiled_view(out))
    assert np.array_equal(_bits(out), _bits(expected))
    _finish(code, compiled_view(a), factors, compiled_view(a))
    assert np.array_equal(_bits(a), _bits(expected))


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_16_bit_values_scale_as_the_host_does(dtype):
    a, _ = _operands(dtype)
    code = value_code(dtype, reducer("sum", dtype))
    expected = np.empty_like(a)
    host.scale_into(a, 0.3, expected, "bfloat16" if dtype == BFLOAT16 else None)
    if dtype == np.float16:
        expected = a * 0.3  # numpy rounds the factor to float16 first
    factor = factors_for(code, dtype, (0.3,))[0]
    out = np.empty_like(a)
    _scale(code, compiled_view(a), factor, compiled_view(out))
    assert np.array_equal(_bits(out), _bits(expected))


def test_compiled_code_holds_16_bit_floats_as_their_bits():
    for dtype in SIXTEEN_BIT:
        assert compiled_dtype(dtype) == np.uint16
        assert compiled_view(np.zeros(3, dtype)).dtype == np.uint16
    for dtype in (np.float32, np.uint16, np.int8):
        assert compiled_dtype(dtype) == dtype
    x = np.zeros(3, np.float32)
    assert compiled_view(x) is x


def test_value_codes_name_what_compiled_code_combines_and_nothing_else():
    assert value_code(np.float32, np.add) == 0
    assert value_code(np.float16, np.add) is None  # numpy's float16 add: not compiled
    assert value_code(np.uint16, np.add) is None
    assert value_code(np.float32, np.subtract) is None
    codes = {value_code(dtype, reducer(op, dtype)) for op in OPS for dtype in SIXTEEN_BIT}
    assert len(codes) == 8 and min(codes) > 3


def test_factors_round_as_the_host_arithmetic_does():
    half = factors_for(value_code(np.float16, reducer("sum", np.float16)), np.float16,
                       (0.1, 3, 1.7))
    assert half.tolist() == np.array([0.1, 3, 1.7], np.float16).astype(np.float32).tolist()
    bfloat = factors_for(value_code(BFLOAT16, reducer("sum", BFLOAT16)), BFLOAT16, (0.1,))
    assert bfloat.tolist() == [np.float32(0.1)]
    assert factors_for(0, np.dtype(np.int32), (1.0, 2, 1.0)).dtype == np.int32
