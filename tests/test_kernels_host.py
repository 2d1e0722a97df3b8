"""Host kernels on numpy arrays: 16-bit casts, fused scales, error feedback, reductions."""

from __future__ import annotations

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from ringtrain import kernels
from ringtrain.kernels import host
from ringtrain.kernels.host import NUMPY_REDUCTIONS

PARALLEL_SIZE = host.PARALLEL_MIN_ELEMENTS + 4099
SIZES = [0, 1, 7, PARALLEL_SIZE]
OPS = sorted(host.OP_CODES)
NATIVE_DTYPES = [np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64]
ALL_HALVES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def hex_ids(value):
    return f"{value:#06x}" if isinstance(value, int) else None


def bits(array):
    array = np.asarray(array)
    return array.view(f"u{array.dtype.itemsize}")


def float32_from_bits(patterns):
    return np.asarray(patterns, np.uint32).view(np.float32)


def assert_same_bits(actual, expected):
    actual, expected = bits(actual).ravel(), bits(expected).ravel()
    assert actual.shape == expected.shape
    wrong = np.flatnonzero(actual != expected)
    assert wrong.size == 0, (
        f"{wrong.size} of {actual.size} differ, first at {wrong[0]}: "
        f"got {actual[wrong[0]]:#x}, expected {expected[wrong[0]]:#x}")


def numpy_half(values):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, np.float32).astype(np.float16)


def signalling_nan32(values):
    patterns = bits(np.asarray(values, np.float32))
    return ((patterns & 0x7F800000) == 0x7F800000) & ((patterns & 0x007FFFFF) != 0) \
        & ((patterns & 0x00400000) == 0)


def signalling_nan16(patterns):
    patterns = bits(patterns)
    return ((patterns & 0x7C00) == 0x7C00) & ((patterns & 0x03FF) != 0) \
        & ((patterns & 0x0200) == 0)


NUMPY_KEEPS_SIGNALLING_NANS = bool(
    bits(numpy_half(float32_from_bits([0x7F800001])))[0] == 0x7C01
    and bits(np.array([0x7C01], np.uint16).view(np.float16).astype(np.float32))[0]
    == 0x7F802000)
"""numpy's software casts keep a signalling NaN signalling; hardware casts would quiet it."""


def assert_half_matches_numpy(values, wire):
    expected = numpy_half(values)
    comparable = np.ones(wire.size, bool) if NUMPY_KEEPS_SIGNALLING_NANS \
        else ~signalling_nan32(values).ravel()
    assert_same_bits(wire.ravel()[comparable], expected.ravel()[comparable])
    assert np.isnan(wire.ravel()[~comparable]).all()


def half_value(patterns):
    """float64 values of float16 bit patterns, from the format's definition."""
    patterns = np.asarray(patterns, np.int64)
    exponent, mantissa = (patterns >> 10) & 0x1F, patterns & 0x3FF
    magnitude = np.where(exponent == 0, np.ldexp(mantissa.astype(np.float64), -24),
                         np.ldexp((1024 + mantissa).astype(np.float64), exponent - 25))
    return np.where(patterns & 0x8000, -magnitude, magnitude)


def bfloat_magnitude(patterns):
    """|value| of bfloat16 bit patterns with exponent field below 255, and 2**128 for 0x7F80."""
    patterns = np.asarray(patterns, np.int64)
    exponent, mantissa = (patterns >> 7) & 0xFF, patterns & 0x7F
    return np.where(exponent == 0, np.ldexp(mantissa.astype(np.float64), -133),
                    np.ldexp((128 + mantissa).astype(np.float64), exponent - 134))


def bfloat_reference(values):
    """Nearest bfloat16 to each float32 (ties to even, overflow to inf), chosen in float64."""
    values = np.ascontiguousarray(values, np.float32).ravel()
    with np.errstate(invalid="ignore"):
        exact = np.abs(values.astype(np.float64))
    sign = (bits(values) >> 16).astype(np.uint16) & 0x8000
    lower = (bits(values) >> 16).astype(np.uint16) & 0x7FFF
    upper = lower + np.uint16(1)
    with np.errstate(invalid="ignore", over="ignore"):
        below = exact - bfloat_magnitude(lower)
        above = bfloat_magnitude(upper) - exact
    round_up = (above < below) | ((above == below) & (lower % 2 == 1))
    result = np.where(round_up, upper, lower)
    result = np.where(np.isinf(values), 0x7F80, result)
    result = np.where(np.isnan(values), 0x7FC0, result)
    return (result | sign).astype(np.uint16)


def bfloat_to_float32(patterns):
    return (np.asarray(patterns, np.uint16).astype(np.uint32) << 16).view(np.float32)


def assert_bfloat_equal(actual, expected):
    actual, expected = bits(actual).ravel(), bits(expected).ravel()
    nan = np.isnan(bfloat_to_float32(expected))
    assert (np.isnan(bfloat_to_float32(actual)) == nan).all()
    assert_same_bits(actual[nan] & 0x8000, expected[nan] & 0x8000)
    assert_same_bits(actual[~nan], expected[~nan])


def encode(kind, values, scale=1.0, residual=None):
    wire = np.empty(np.shape(values), np.float16 if kind == "half" else np.uint16)
    encoder = host.encode_half if kind == "half" else host.encode_bfloat
    encoder(values, wire, scale, residual)
    return wire


def decode(kind, wire, scale=1.0):
    out = np.empty(np.shape(wire), np.float32)
    (host.decode_half if kind == "half" else host.decode_bfloat)(wire, out, scale)
    return out


def wire_to_float32(kind, wire):
    return wire.astype(np.float32) if kind == "half" else bfloat_to_float32(wire)


def random_float32_bits(rng, size):
    return float32_from_bits(rng.integers(0, 1 << 32, size, dtype=np.uint64).astype(np.uint32))


def both_paths(values):
    """``values`` as they are and tiled past the size where the parallel loops take over."""
    values = np.ascontiguousarray(values).ravel()
    copies = -(-PARALLEL_SIZE // max(values.size, 1))
    return [values, np.tile(values, copies)]


@pytest.fixture
def restore_host_threads():
    threads = host.host_threads()
    yield
    host.set_host_threads(threads)


# --------------------------------------------------------------------------- float16 decode

@pytest.mark.parametrize("wire_dtype", [np.float16, np.uint16])
@pytest.mark.parametrize("copies", [1, 3])
def test_decode_half_matches_numpy_for_every_bit_pattern(wire_dtype, copies):
    patterns = np.tile(ALL_HALVES, copies)
    out = decode("half", patterns.view(wire_dtype))
    expected = patterns.view(np.float16).astype(np.float32)
    comparable = np.ones(patterns.size, bool) if NUMPY_KEEPS_SIGNALLING_NANS \
        else ~signalling_nan16(patterns)
    assert_same_bits(out[comparable], expected[comparable])
    assert np.isnan(out[~comparable]).all()


def test_decode_half_values_follow_the_format_definition():
    finite = ALL_HALVES[(ALL_HALVES & 0x7C00) != 0x7C00]
    np.testing.assert_array_equal(decode("half", finite.view(np.float16)),
                                  half_value(finite).astype(np.float32))


@pytest.mark.parametrize("pattern, expected", [
    (0x7C00, 0x7F800000), (0xFC00, 0xFF800000), (0x7E00, 0x7FC00000),
    (0x7C01, 0x7F802000), (0xFD00, 0xFFA00000), (0x7FFF, 0x7FFFE000), (0x8000, 0x80000000),
], ids=hex_ids)
def test_decode_half_keeps_infinities_and_nan_payloads(pattern, expected):
    out = decode("half", np.array([pattern], np.uint16))
    assert bits(out)[0] == expected


# --------------------------------------------------------------------------- float16 encode

def float32_exponent_boundaries():
    """Values at, just below and just above every power of two near float16's range."""
    steps = [0, 1, 2] + [step for k in range(1, 23)
                         for step in (1 << k, (1 << k) - 1, (1 << k) + 1)]
    offsets = np.array(sorted({sign * step for step in steps for sign in (1, -1)}), np.int64)
    powers = (np.arange(-28, 18, dtype=np.int64) + 127) << 23
    patterns = (powers[:, None] + offsets[None, :]).ravel()
    values = float32_from_bits(patterns.astype(np.uint32))
    return np.concatenate([values, -values])


def test_encode_half_at_exponent_boundaries_matches_numpy():
    for values in both_paths(float32_exponent_boundaries()):
        assert_half_matches_numpy(values, encode("half", values))


def test_encode_half_subnormal_range_matches_numpy():
    multiples = np.arange(0, 1025, dtype=np.float64)
    values = np.concatenate([multiples, multiples + 0.5, multiples + 0.25, multiples + 0.75])
    values = np.ldexp(values, -24).astype(np.float32)
    values = np.concatenate([values, np.nextafter(values, np.float32(0)),
                             np.nextafter(values, np.float32(1)),
                             np.ldexp(np.float32(1), np.arange(-149, -23)).astype(np.float32),
                             float32_from_bits([1, 0x007FFFFF, 0x00800000])])
    values = np.concatenate([values, -values])
    for each in both_paths(values):
        assert_half_matches_numpy(each, encode("half", each))


@pytest.mark.parametrize("value, expected", [
    (2.0 ** -26, 0x0000), (2.0 ** -25, 0x0000), (np.nextafter(np.float32(2 ** -25), 1), 0x0001),
    (2.0 ** -24, 0x0001), (1.5 * 2 ** -24, 0x0002), (2.5 * 2 ** -24, 0x0002),
    (1022.5 * 2 ** -24, 0x03FE), (1023.5 * 2 ** -24, 0x0400),
    (np.nextafter(np.float32(1023.5 * 2 ** -24), 0), 0x03FF), (2.0 ** -14, 0x0400),
    (-(2.0 ** -25), 0x8000), (-1.5 * 2 ** -24, 0x8002), (1e-45, 0x0000),
])
def test_encode_half_rounds_subnormals_to_nearest_even(value, expected):
    assert bits(encode("half", np.array([value], np.float32)))[0] == expected


def test_encode_half_rounds_every_tie_to_even():
    lower = np.arange(0, 0x7C00, dtype=np.int64)
    midpoints = ((half_value(lower) + half_value(lower + 1)) / 2).astype(np.float32)
    np.testing.assert_array_equal(midpoints.astype(np.float64),
                                  (half_value(lower) + half_value(lower + 1)) / 2)
    even = (lower + (lower & 1)).astype(np.uint16)
    above = np.nextafter(midpoints, np.float32(np.inf))
    below = np.nextafter(midpoints, np.float32(0))
    values = np.concatenate([midpoints, above, below])
    expected = np.concatenate([even, lower + 1, lower]).astype(np.uint16)
    values, expected = np.concatenate([values, -values]), np.concatenate([expected,
                                                                          expected | 0x8000])
    assert values.size > PARALLEL_SIZE
    for count in (values.size, 50_000):
        wire = encode("half", values[:count])
        assert_same_bits(wire, expected[:count])
        assert_half_matches_numpy(values[:count], wire)


@pytest.mark.parametrize("value, expected", [
    (0.0, 0x0000), (-0.0, 0x8000), (np.inf, 0x7C00), (-np.inf, 0xFC00),
    (65504.0, 0x7BFF), (-65504.0, 0xFBFF), (65519.99, 0x7BFF), (-65519.99, 0xFBFF),
    (65520.0, 0x7C00), (-65520.0, 0xFC00), (65535.0, 0x7C00), (65536.0, 0x7C00),
    (1e5, 0x7C00), (3.4e38, 0x7C00), (-3.4e38, 0xFC00), (1.0, 0x3C00), (-2.0, 0xC000),
    (np.nextafter(np.float32(65520), 0), 0x7BFF), (np.nextafter(np.float32(65504), 0), 0x7BFF),
])
def test_encode_half_specials_and_overflow(value, expected):
    values = np.array([value], np.float32)
    wire = encode("half", values)
    assert bits(wire)[0] == expected
    assert_half_matches_numpy(values, wire)


@pytest.mark.parametrize("pattern, expected", [
    (0x7FC00000, 0x7E00), (0xFFC00000, 0xFE00), (0x7FC00001, 0x7E00), (0x7FFFFFFF, 0x7FFF),
    (0xFFE02000, 0xFF01), (0x7F800001, 0x7C01), (0x7F801FFF, 0x7C01), (0x7F802000, 0x7C01),
    (0x7FA00000, 0x7D00), (0x7FBFFFFF, 0x7DFF), (0xFF800001, 0xFC01), (0xFFA02000, 0xFD01),
], ids=hex_ids)
def test_encode_half_keeps_nan_payloads_and_never_makes_infinity(pattern, expected):
    values = float32_from_bits([pattern])
    wire = encode("half", values)
    assert np.isnan(wire[0])
    assert bits(wire)[0] == expected
    assert_half_matches_numpy(values, wire)


@pytest.mark.parametrize("size", [0, 1, 4099, 2_000_000])
def test_encode_half_random_bit_patterns_match_numpy(size):
    values = random_float32_bits(np.random.default_rng(size), size)
    assert_half_matches_numpy(values, encode("half", values))


def test_encode_half_accepts_a_uint16_wire_and_any_shape():
    values = np.random.default_rng(3).standard_normal((4, 5, 6)).astype(np.float32)
    wire = np.empty((120,), np.uint16)
    host.encode_half(values, wire)
    assert_same_bits(wire, numpy_half(values).ravel())


# --------------------------------------------------------------------------- bfloat16

@pytest.mark.parametrize("copies", [1, 3])
def test_decode_bfloat_is_exact_for_every_bit_pattern(copies):
    patterns = np.tile(ALL_HALVES, copies)
    out = decode("bfloat", patterns)
    assert_same_bits(out, patterns.astype(np.uint32) << 16)
    finite = (patterns & 0x7F80) != 0x7F80
    magnitude = bfloat_magnitude(patterns[finite])
    np.testing.assert_array_equal(out[finite].astype(np.float64),
                                  np.where(patterns[finite] & 0x8000, -magnitude, magnitude))


def test_bfloat_reference_on_known_values():
    values = np.array([1.0, 1.00390625, 1.01171875, 1.0 + 2 ** -9, -3.0, 3.4e38, 0.0,
                       np.inf, np.nan], np.float32)
    values = np.concatenate([values, float32_from_bits([0x7F7F7FFF, 0x7F7F8000, 0x3F808000,
                                                        0x3F818000, 0x00008000, 0x00018000])])
    expected = [0x3F80, 0x3F80, 0x3F82, 0x3F80, 0xC040, 0x7F80, 0x0000, 0x7F80, 0x7FC0,
                0x7F7F, 0x7F80, 0x3F80, 0x3F82, 0x0000, 0x0002]
    assert_same_bits(bfloat_reference(values), np.array(expected, np.uint16))


def bfloat_edge_values():
    low_halves = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    high_halves = np.array([0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081, 0x3F80, 0x3F81,
                            0x7F7E, 0x7F7F, 0x7F80, 0x7F81, 0x7FC0, 0x7FFF], np.uint32)
    patterns = (high_halves[:, None] << 16 | low_halves[None, :]).ravel()
    values = float32_from_bits(np.concatenate([patterns, patterns | 0x80000000]))
    return np.concatenate([values, float32_exponent_boundaries()])


@pytest.mark.parametrize("source", ["edges", "random"])
def test_encode_bfloat_matches_the_reference(source):
    if source == "edges":
        candidates = both_paths(bfloat_edge_values())
    else:
        rng = np.random.default_rng(11)
        candidates = [random_float32_bits(rng, 4099), random_float32_bits(rng, 2_000_000)]
    for values in candidates:
        assert_bfloat_equal(encode("bfloat", values), bfloat_reference(values))


@pytest.mark.parametrize("pattern, expected", [
    (0x7F7F7FFF, 0x7F7F), (0x7F7F8000, 0x7F80), (0x7F7FFFFF, 0x7F80), (0xFF7FFFFF, 0xFF80),
    (0x7F800000, 0x7F80), (0xFF800000, 0xFF80), (0x3F808000, 0x3F80), (0x3F818000, 0x3F82),
    (0x00008000, 0x0000), (0x80018000, 0x8002), (0x80000000, 0x8000),
], ids=hex_ids)
def test_encode_bfloat_overflow_ties_and_signs(pattern, expected):
    assert bits(encode("bfloat", float32_from_bits([pattern])))[0] == expected


@pytest.mark.parametrize("pattern", [0x7F800001, 0x7FC00000, 0xFF800001, 0xFFFFFFFF, 0x7FBF0000],
                         ids=hex_ids)
def test_encode_bfloat_keeps_nans_nan_with_their_sign(pattern):
    wire = encode("bfloat", float32_from_bits([pattern]))
    assert np.isnan(bfloat_to_float32(wire))[0]
    assert (bits(wire)[0] & 0x8000) == (pattern >> 16) & 0x8000


# --------------------------------------------------------------------------- fused scales

SCALES = [2.0 ** -20, 0.5, 2.0 ** 10, 3.0, 0.1, 1e-3, 7.25e4]


def scaled_test_values(size):
    rng = np.random.default_rng(size)
    values = (rng.standard_normal(size) * np.exp(rng.uniform(-20, 12, size))).astype(np.float32)
    values[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 1e-8, -1e-30]
    return values


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("size", [4099, PARALLEL_SIZE])
def test_encode_half_with_scale_equals_casting_the_float32_product(scale, size):
    values = scaled_test_values(size)
    with np.errstate(over="ignore", invalid="ignore"):
        product = values * np.float32(scale)
    assert_half_matches_numpy(product, encode("half", values, scale))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("size", [4099, PARALLEL_SIZE])
def test_encode_bfloat_with_scale_equals_rounding_the_float32_product(scale, size):
    values = scaled_test_values(size)
    with np.errstate(over="ignore", invalid="ignore"):
        product = values * np.float32(scale)
    assert_bfloat_equal(encode("bfloat", values, scale), bfloat_reference(product))


@pytest.mark.parametrize("kind", ["half", "bfloat"])
@pytest.mark.parametrize("scale", [2.0 ** -24, 0.5, 3.0, 1e-3, 2.0 ** 20, -1.5])
@pytest.mark.parametrize("copies", [1, 3])
def test_decode_with_scale_equals_the_float32_product(kind, scale, copies):
    patterns = np.tile(ALL_HALVES, copies)
    wire = patterns.view(np.float16) if kind == "half" else patterns
    with np.errstate(over="ignore", invalid="ignore"):
        expected = wire_to_float32(kind, wire) * np.float32(scale)
    assert_same_bits(decode(kind, wire, scale), expected)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("scale", [np.inf, -np.inf, np.nan, 1e39])
def test_scales_that_are_not_finite_float32_are_rejected(scale):
    values = np.ones(3, np.float32)
    for kind in ("half", "bfloat"):
        with pytest.raises(ValueError, match="scale"):
            encode(kind, values, scale)
        with pytest.raises(ValueError, match="scale"):
            decode(kind, encode(kind, values), scale)


# --------------------------------------------------------------------------- error feedback

@pytest.mark.parametrize("kind", ["half", "bfloat"])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 12, 2.0 ** -3])
@pytest.mark.parametrize("size", [1000, PARALLEL_SIZE])
def test_error_feedback_residual_is_what_the_cast_lost(kind, scale, size):
    rng = np.random.default_rng(size)
    source = (rng.standard_normal(size) * 1e-2).astype(np.float32)
    residual = (rng.standard_normal(size) * 1e-5).astype(np.float32)
    value = source + residual
    wire = encode(kind, source, scale, residual)
    assert_same_bits(wire, encode(kind, value, scale))
    expected = value - wire_to_float32(kind, wire) / np.float32(scale)
    assert_same_bits(residual, expected)


@pytest.mark.parametrize("kind", ["half", "bfloat"])
def test_error_feedback_with_a_scale_that_is_not_a_power_of_two(kind):
    rng = np.random.default_rng(5)
    source = rng.standard_normal(5000).astype(np.float32)
    residual = np.zeros_like(source)
    wire = encode(kind, source, 3.0, residual)
    expected = source.astype(np.float64) - wire_to_float32(kind, wire).astype(np.float64) / 3
    assert (np.abs(residual - expected) <= 4 * np.spacing(np.abs(source))).all()
    assert (residual != 0).mean() > 0.9


@pytest.mark.parametrize("kind, wire_ulp", [("half", 2.0 ** -23), ("bfloat", 2.0 ** -20)])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 12])
def test_error_feedback_keeps_a_running_sum_on_track(kind, wire_ulp, scale):
    step = np.random.default_rng(9).uniform(1e-4, 2e-4, 1000).astype(np.float32)
    steps = 100
    exact = steps * step.astype(np.float64)
    residual = np.zeros_like(step)
    with_feedback = np.zeros(step.size)
    without_feedback = np.zeros(step.size)
    for _ in range(steps):
        with_feedback += decode(kind, encode(kind, step, scale, residual), 1 / scale)
        without_feedback += decode(kind, encode(kind, step, scale), 1 / scale)
    error_with = np.abs(with_feedback - exact)
    error_without = np.abs(without_feedback - exact)
    assert error_with.max() <= wire_ulp
    assert error_without.max() > 20 * wire_ulp
    assert error_without.mean() > 20 * error_with.mean()
    np.testing.assert_allclose(with_feedback - exact, -residual, rtol=0, atol=1e-9)


# --------------------------------------------------------------------------- reductions

def random_operand(rng, dtype, size):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True)
    values = (rng.standard_normal(size) * 100).astype(dtype)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype)
    where = rng.integers(0, max(size, 1), min(size, 3 * len(specials)))
    values[where] = np.resize(specials, where.size)
    return values


def numpy_combine(op, a, b):
    with np.errstate(all="ignore"):
        return NUMPY_REDUCTIONS[op](a, b)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_reduce_into_native_dtypes_match_numpy(op, dtype, size):
    rng = np.random.default_rng(size + 17)
    a, b = random_operand(rng, dtype, size), random_operand(rng, dtype, size)
    expected = numpy_combine(op, a, b)
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        host.reduce_into(op, a, b, out)
        assert_same_bits(out, expected)
        first, second = a.copy(), b.copy()
        host.reduce_into(op, first, b, first)
        host.reduce_into(op, a, second, second)
    assert_same_bits(first, expected)
    assert_same_bits(second, expected)


def half_operands(rng, size):
    a = rng.integers(0, 1 << 16, size, dtype=np.uint32).astype(np.uint16)
    b = rng.integers(0, 1 << 16, size, dtype=np.uint32).astype(np.uint16)
    specials = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0xBC00,
                         0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7D55],
                        np.uint16)
    pairs = np.stack(np.meshgrid(specials, specials), -1).reshape(-1, 2)[:size]
    a[:len(pairs)], b[:len(pairs)] = pairs[:, 0], pairs[:, 1]
    return a.view(np.float16), b.view(np.float16)


def assert_half_combination(op, a, b, out):
    expected = numpy_combine(op, a, b)
    both_nan = np.isnan(a) & np.isnan(b)
    assert_same_bits(out[~both_nan], expected[~both_nan])
    assert np.isnan(out[both_nan]).all()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("size", SIZES + [1 << 16])
def test_reduce_into_float16_matches_numpy_bit_for_bit(op, size):
    a, b = half_operands(np.random.default_rng(size), size)
    out = np.empty_like(a)
    host.reduce_into(op, a, b, out)
    assert_half_combination(op, a, b, out)
    first, second = a.copy(), b.copy()
    host.reduce_into(op, first, b, first)
    host.reduce_into(op, a, second, second)
    assert_half_combination(op, a, b, first)
    assert_half_combination(op, a, b, second)


@pytest.mark.parametrize("op", ["sum", "product"])
def test_reduce_into_float16_rounds_once_from_float32(op):
    a = np.array([2048.0, 1.0, 65504.0, 2.0 ** -24, 300.0], np.float16)
    b = np.array([1.0, 2.0 ** -11, 16.0, 2.0 ** -24, 300.0], np.float16)
    expected = (a.astype(np.float32) + b.astype(np.float32) if op == "sum"
                else a.astype(np.float32) * b.astype(np.float32))
    out = np.empty_like(a)
    host.reduce_into(op, a, b, out)
    assert_same_bits(out, numpy_half(expected))


def bfloat_combine_reference(op, a, b):
    x, y = bfloat_to_float32(a), bfloat_to_float32(b)
    with np.errstate(all="ignore"):
        combined = NUMPY_REDUCTIONS[op](x, y)
    return bfloat_reference(combined)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("size", SIZES)
def test_reduce_into_bfloat16_matches_the_reference(op, size):
    operands = half_operands(np.random.default_rng(size), size)
    a, b = (operand.view(np.uint16) for operand in operands)
    a[:8] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F7F, 0x3F80, 0x0001][:min(size, 8)]
    expected = bfloat_combine_reference(op, a, b)
    for target in ("new", "a", "b"):
        first, second = a.copy(), b.copy()
        out = {"new": np.empty_like(a), "a": first, "b": second}[target]
        host.reduce_into(op, first, second, out, encoding="bfloat16")
        got, want = bfloat_to_float32(out), bfloat_to_float32(expected)
        if op in ("min", "max"):
            assert ((got == want) | (np.isnan(got) & np.isnan(want))).all()
            assert ((out == a) | (out == b)).all()
        else:
            both_nan = np.isnan(bfloat_to_float32(a)) & np.isnan(bfloat_to_float32(b))
            assert_bfloat_equal(out[~both_nan], expected[~both_nan])
            assert np.isnan(got[both_nan]).all()


def test_bfloat16_sum_rounds_to_nearest_even():
    a = np.array([0x3F80, 0x3F81, 0x7F7F, 0x3F80], np.uint16)  # 1, 1+2**-7, max, 1
    b = np.array([0x3B80, 0x3B80, 0x7F7F, 0x3B00], np.uint16)  # 2**-8, 2**-8, max, 2**-9
    out = np.empty_like(a)
    host.reduce_into("sum", a, b, out, encoding="bfloat16")
    assert_same_bits(out, np.array([0x3F80, 0x3F82, 0x7F80, 0x3F80], np.uint16))


def test_average_sums():
    a, b = np.array([1.0, 2.0], np.float16), np.array([3.0, 5.0], np.float16)
    out = np.empty_like(a)
    host.reduce_into("average", a, b, out)
    np.testing.assert_array_equal(out, [4.0, 7.0])


@pytest.mark.parametrize("op", sorted(NUMPY_REDUCTIONS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int8, np.uint8,
                                   np.int32, np.int64])
def test_reduce_into(op, dtype):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 5, 11).astype(dtype)
    b = rng.integers(0, 5, 11).astype(dtype)
    expected = {"sum": a + b, "average": a + b, "min": np.minimum(a, b),
                "max": np.maximum(a, b), "product": a * b}[op]
    out = np.empty_like(a)
    kernels.reduce_into(op, a, b, out)
    np.testing.assert_array_equal(out, expected)
    kernels.reduce_into(op, a, b, a)
    np.testing.assert_array_equal(a, expected)


def test_divide_into_rounds_once():
    a = np.array([1.0, 2.0, -7.0, 10.0], np.float32)
    out = np.empty_like(a)
    kernels.divide_into(a, 3, out)
    np.testing.assert_array_equal(out, (a.astype(np.float64) / 3).astype(np.float32))
    kernels.divide_into(a, 3, a)
    np.testing.assert_array_equal(a, out)


def test_scale_into():
    a = np.arange(5, dtype=np.float32)
    out = np.empty_like(a)
    kernels.scale_into(a, 1.0, out)
    np.testing.assert_array_equal(out, a)
    kernels.scale_into(a, 0.5, out)
    np.testing.assert_array_equal(out, a * 0.5)
    kernels.scale_into(a, 2.0, a)
    np.testing.assert_array_equal(a, np.arange(5, dtype=np.float32) * 2)
    h = np.ones(3, np.float16)
    kernels.scale_into(h, 3.0, h)
    assert h.dtype == np.float16 and (h == 3).all()


# --------------------------------------------------------------------------- bfloat16 arrays

BF16 = kernels.BFLOAT16


def bfloat16_values(size, seed=3):
    """bfloat16 values of every magnitude, infinities and NaNs among them."""
    patterns = np.random.default_rng(seed).integers(0, 1 << 16, size).astype(np.uint16)
    return patterns.view(BF16)


def finite(values):
    return np.isfinite(values.astype(np.float32))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("size", SIZES)
def test_bfloat16_arrays_reduce_as_their_bits(op, size):
    """A bfloat16 array needs no encoding; its result has the bits of the uint16 path."""
    a, b = bfloat16_values(size, 1), bfloat16_values(size, 2)
    through_bits = np.empty(size, np.uint16)
    host.reduce_into(op, bits(a), bits(b), through_bits, encoding="bfloat16")
    for target in ("new", "a", "b"):
        first, second = a.copy(), b.copy()
        out = {"new": np.empty_like(a), "a": first, "b": second}[target]
        host.reduce_into(op, first, second, out)
        assert out.dtype == BF16
        assert_same_bits(out, through_bits)
    combine = kernels.reducer(op, BF16)
    for x, y in ((a, b), (bits(a), bits(b))):
        out = np.empty_like(x)
        combine(x, y, out=out)
        assert_same_bits(out, through_bits)


@pytest.mark.parametrize("factor", [0.5, 3.0, 0.1, -1e-30])
@pytest.mark.parametrize("size", SIZES)
def test_bfloat16_scale_rounds_once_from_float32(factor, size):
    values = bfloat16_values(size)
    with np.errstate(all="ignore"):
        expected = (values.astype(np.float32) * np.float32(factor)).astype(BF16)
    keep = finite(values)
    for in_place in (False, True):
        out = values.copy() if in_place else np.empty_like(values)
        kernels.scale_into(out if in_place else values, factor, out)
        assert_same_bits(out[keep], expected[keep])
        assert np.isnan(out[np.isnan(values.astype(np.float32))].astype(np.float32)).all()
    as_bits = np.empty(size, np.uint16)
    host.scale_into(bits(values), factor, as_bits, encoding="bfloat16")
    assert_same_bits(as_bits[keep], expected[keep])
    copied = np.empty_like(values)
    kernels.scale_into(values, 1.0, copied)
    assert_same_bits(copied, values)


@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 255])
@pytest.mark.parametrize("size", SIZES)
def test_bfloat16_divide_is_correctly_rounded(divisor, size):
    """float32 division then one rounding: float32 holds more than twice bfloat16's bits
    plus two, so the double rounding gives the correctly rounded quotient."""
    values = bfloat16_values(size)
    with np.errstate(all="ignore"):
        expected = (values.astype(np.float64) / divisor).astype(np.float32).astype(BF16)
    keep = finite(values)
    out = np.empty_like(values)
    kernels.divide_into(values, divisor, out)
    assert_same_bits(out[keep], expected[keep])
    host.divide_into(bits(values), divisor, bits(values), encoding="bfloat16")
    assert_same_bits(values[keep], expected[keep])


@pytest.mark.parametrize("size", [6, 7, PARALLEL_SIZE])
def test_bfloat16_loops_take_arrays_at_any_element_offset(size):
    """The loops read two elements a word: arrays that start mid-word, each at its own
    offset, give the bits of aligned copies."""
    a, b = bfloat16_values(size, 1), bfloat16_values(size, 2)
    sums, quotients = np.empty_like(a), np.empty_like(a)
    kernels.reduce_into("sum", a, b, sums)
    kernels.divide_into(a, 3, quotients)
    for a_offset, b_offset, out_offset in ((1, 0, 0), (0, 1, 1), (1, 1, 0)):
        shifted_a = np.empty(size + 1, BF16)[a_offset:a_offset + size]
        shifted_b = np.empty(size + 1, BF16)[b_offset:b_offset + size]
        shifted_a[...], shifted_b[...] = a, b
        out = np.empty(size + 1, BF16)[out_offset:out_offset + size]
        kernels.reduce_into("sum", shifted_a, shifted_b, out)
        assert_same_bits(out, sums)
        kernels.reduce_into("sum", shifted_a, shifted_b, shifted_a)
        assert_same_bits(shifted_a, sums)
        shifted_b[...] = a
        kernels.divide_into(shifted_b, 3, out)
        assert_same_bits(out, quotients)
        kernels.divide_into(shifted_b, 3, shifted_b)
        assert_same_bits(shifted_b, quotients)


def test_bfloat16_small_integer_average_is_exact_rounding():
    sums = np.arange(-32, 33, dtype=np.float64)
    for ranks in (2, 3, 4):
        out = np.empty(sums.size, BF16)
        kernels.divide_into(sums.astype(BF16), ranks, out)
        np.testing.assert_array_equal(out.astype(np.float64),
                                      (sums / ranks).astype(np.float32).astype(BF16)
                                      .astype(np.float64))


def test_bfloat16_kernels_refuse_other_dtypes():
    with pytest.raises(ValueError):
        host.scale_into(np.zeros(4, np.float16), 2.0, np.zeros(4, np.uint16), "bfloat16")
    with pytest.raises(ValueError):
        host.divide_into(np.zeros(4, BF16), 2, np.zeros(5, BF16))
    with pytest.raises(ValueError, match="encoding"):
        host.scale_into(np.zeros(4, np.uint16), 2.0, np.zeros(4, np.uint16), "bfloat8")


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.1])
def test_bfloat16_pack_and_unpack_scale_in_float32(scale):
    values = bfloat16_values(400)
    base = values[:300].reshape(20, 15)
    tensors = [values[300:310], base[::2, 1:], base.T, values[310:311].reshape(())]
    layout = kernels.FusionLayout.of(tensors)
    buffer = np.full(layout.total_size, np.nan, np.float32).astype(BF16)
    kernels.pack(layout, tensors, buffer, scale)
    for tensor, view in zip(tensors, layout.views(buffer)):
        want = (tensor.astype(np.float32) * np.float32(scale)).astype(BF16)
        keep = finite(tensor)
        assert_same_bits(view[keep], want[keep])
    for start, stop in layout.padding:
        assert not bits(buffer[start:stop]).any()
    outputs = [np.empty(t.shape, BF16) for t in tensors]
    outputs[1] = np.empty((20, 28), BF16)[::2, ::2]  # a strided destination
    kernels.unpack(layout, buffer, outputs, scale)
    for output, view in zip(outputs, layout.views(buffer)):
        want = (view.astype(np.float32) * np.float32(scale)).astype(BF16)
        keep = finite(view)
        assert_same_bits(output[keep], want[keep])


def test_bfloat16_helpers():
    assert kernels.is_floating(BF16) and kernels.is_floating(np.float16)
    assert not kernels.is_floating(np.int32) and not kernels.is_floating(np.uint16)
    assert kernels.encoding_of(BF16) == "bfloat16" and kernels.encoding_of(np.float16) is None
    x = np.ones(3, BF16)
    assert kernels.bits(x).dtype == np.uint16 and kernels.bits(x).base is x
    y = np.ones(3, np.float32)
    assert kernels.bits(y) is y


def test_numpy_arrays_run_on_the_host_twin():
    assert kernels.twin_for(np.zeros(3, np.float32)) is host


# --------------------------------------------------------------------------- abs_max

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 7, 4099, PARALLEL_SIZE])
def test_abs_max_of_finite_values(dtype, size):
    rng = np.random.default_rng(size)
    values = rng.standard_normal(size).astype(dtype)
    values[rng.integers(0, size)] = -1234.5
    assert host.abs_max(values) == (float(np.abs(values).max()), False)
    assert host.abs_max(values) == (1234.5, False)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [7, PARALLEL_SIZE])
@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
def test_abs_max_flags_inf_and_nan_and_skips_them(dtype, size, special):
    values = np.random.default_rng(size).uniform(-3, 3, size).astype(dtype)
    values[size // 2] = special
    largest, nonfinite = host.abs_max(values)
    assert nonfinite is True
    assert largest == float(np.abs(values[np.isfinite(values)]).max())


def test_abs_max_edge_cases():
    assert host.abs_max(np.zeros(0, np.float32)) == (0.0, False)
    assert host.abs_max(np.zeros((0, 3), np.float64)) == (0.0, False)
    assert host.abs_max(np.array([np.nan, -np.inf], np.float32)) == (0.0, True)
    assert host.abs_max(np.array([-0.0, 0.0], np.float32)) == (0.0, False)
    assert host.abs_max(np.array([[1e300], [-2e300]])) == (2e300, False)
    largest = float(np.float32(3.4e38))
    assert host.abs_max(np.array([3.4e38, -1e-45], np.float32)) == (largest, False)
    assert kernels.abs_max(np.array([-2.5, 1.0], np.float32)) == (2.5, False)


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.float16, np.uint16])
def test_abs_max_rejects_other_dtypes(dtype):
    with pytest.raises(ValueError, match="float32 or float64"):
        host.abs_max(np.ones(4, dtype))


def test_abs_max_rejects_non_contiguous_arrays():
    with pytest.raises(ValueError, match="contiguous"):
        host.abs_max(np.ones(8, np.float32)[::2])


# --------------------------------------------------------------------------- argument errors

@pytest.mark.parametrize("kind", ["half", "bfloat"])
def test_encode_rejects_bad_arguments(kind):
    encoder = host.encode_half if kind == "half" else host.encode_bfloat
    source, wire = np.ones(6, np.float32), np.empty(6, np.uint16)
    with pytest.raises(ValueError, match="float32"):
        encoder(source.astype(np.float64), wire)
    with pytest.raises(ValueError, match="elements"):
        encoder(source, np.empty(5, np.uint16))
    with pytest.raises(ValueError, match="contiguous"):
        encoder(np.ones(12, np.float32)[::2], wire)
    with pytest.raises(ValueError, match="contiguous"):
        encoder(source, np.empty(12, np.uint16)[::2])
    with pytest.raises(ValueError, match="float32"):
        encoder(source, wire, residual=np.zeros(6, np.float64))
    with pytest.raises(ValueError, match="residual"):
        encoder(source, wire, residual=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        encoder(source, wire, residual=np.zeros(12, np.float32)[::2])


@pytest.mark.parametrize("kind", ["half", "bfloat"])
def test_decode_rejects_bad_arguments(kind):
    decoder = host.decode_half if kind == "half" else host.decode_bfloat
    wire, out = np.zeros(6, np.uint16), np.empty(6, np.float32)
    with pytest.raises(ValueError, match="float32"):
        decoder(wire, np.empty(6, np.float64))
    with pytest.raises(ValueError, match="elements"):
        decoder(wire, np.empty(7, np.float32))
    with pytest.raises(ValueError, match="contiguous"):
        decoder(np.zeros(12, np.uint16)[::2], out)
    with pytest.raises(ValueError, match="contiguous"):
        decoder(wire, np.empty(12, np.float32)[::2])


@pytest.mark.parametrize("encoding, dtype", [(None, np.float16), ("bfloat16", np.uint16)])
def test_sixteen_bit_reductions_reject_bad_arguments(encoding, dtype):
    a, b, out = np.zeros(6, dtype), np.zeros(6, dtype), np.zeros(6, dtype)
    for bad in ([np.zeros(5, dtype), b, out], [a, np.zeros(7, dtype), out],
                [a.astype(np.float32), b, out], [a, b.astype(np.int16), out],
                [np.zeros(12, dtype)[::2], b, out], [a, b, np.zeros(12, dtype)[::2]]):
        with pytest.raises(ValueError):
            host.reduce_into("sum", *bad, encoding=encoding)
    if encoding:
        with pytest.raises(ValueError):
            host.reduce_into("sum", a.view(np.float16), b.view(np.float16), out.view(np.float16),
                             encoding=encoding)
    with pytest.raises(ValueError, match="encoding"):
        host.reduce_into("sum", a, b, out, encoding="float8")


@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_native_reductions_reject_mismatched_sizes(dtype):
    with pytest.raises(ValueError):
        host.reduce_into("sum", np.zeros(5, dtype), np.zeros(7, dtype), np.zeros(7, dtype))


def test_native_reductions_accept_strided_arrays():
    a = np.arange(20, dtype=np.float64)[::2]
    b = np.arange(30, dtype=np.float64).reshape(10, 3)[:, 1]
    out = np.empty(20)[::2]
    host.reduce_into("max", a, b, out)
    np.testing.assert_array_equal(out, np.maximum(a, b))


# --------------------------------------------------------------------------- threads

def run_every_kernel(values):
    a, b = numpy_half(values[::-1]), numpy_half(values)
    results = [encode("half", values), encode("bfloat", values),
               decode("half", numpy_half(values), 0.25), decode("bfloat", encode("bfloat", values)),
               np.array(host.abs_max(values))]
    residual = np.full(values.size, 1e-3, np.float32)
    results += [encode("half", values, 8.0, residual), residual]
    for op in OPS:
        out = np.empty_like(a)
        host.reduce_into(op, a, b, out)
        results.append(out)
        out = np.empty(a.size, np.uint16)
        host.reduce_into(op, bits(a), bits(b), out, encoding="bfloat16")
        results.append(out)
    return results


def test_one_host_thread_gives_the_same_bits(restore_host_threads):
    values = scaled_test_values(PARALLEL_SIZE * 2)
    default = run_every_kernel(values)
    host.set_host_threads(1)
    assert host.host_threads() == 1
    for single, parallel in zip(run_every_kernel(values), default):
        assert_same_bits(single, parallel)


def test_set_host_threads_clamps(restore_host_threads):
    host.set_host_threads(0)
    assert kernels.host_threads() == 1
    kernels.set_host_threads(10 ** 6)
    assert host.host_threads() == numba.config.NUMBA_NUM_THREADS


def test_a_loop_runs_serially_while_another_thread_runs_a_parallel_one(restore_host_threads):
    host.set_host_threads(2)
    calls = []
    loop = host._SizedLoop(lambda *a: calls.append("serial"), lambda *a: calls.append("parallel"))
    loop(PARALLEL_SIZE)
    with host._PARALLEL_LOOP:  # as while another thread is inside a parallel loop
        loop(PARALLEL_SIZE)
    loop(PARALLEL_SIZE)
    loop(5)
    assert calls == ["parallel", "serial", "parallel", "serial"]


@pytest.mark.processes
def test_threads_calling_parallel_loops_at_once_do_not_abort_the_process():
    """numba's workqueue threading layer (where neither TBB nor OpenMP is installed)
    aborts the process when two threads run parallel loops at once."""
    probe = """
import concurrent.futures
import numpy as np
from ringtrain.kernels import host
host.set_host_threads(2)
n = host.PARALLEL_MIN_ELEMENTS * 8
source = np.linspace(-2, 2, n).astype(np.float32)
expected = np.empty(n, np.uint16)
host.encode_bfloat(source, expected, 2.0)
def encode(_):
    out = np.empty(n, np.uint16)
    for _ in range(50):
        host.encode_bfloat(source, out, 2.0)
    return bool((out == expected).all())
with concurrent.futures.ThreadPoolExecutor(2) as pool:
    print(all(pool.map(encode, range(8))))
import numba
print(numba.threading_layer())
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NUMBA_THREADING_LAYER": "workqueue"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "workqueue"]


@pytest.mark.processes
def test_every_host_kernel_compiles_to_the_disk_cache():
    """Compiled once, every kernel loads from numba's disk cache in the next process:
    numba warns when a function cannot be cached, and compiles one again at every start
    whose cache key differs between processes (a closure over a compiled function). The
    cache is the one the other tests use, which the first run fills where it is cold."""
    probe = """
import warnings
from numba.core.errors import NumbaWarning
warnings.simplefilter("error", NumbaWarning)
from ringtrain.kernels import host
host.compile_every_kernel()
print("cached")
"""
    environment = {**os.environ, "NUMBA_DEBUG_CACHE": "1"}
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           timeout=600, env=environment) for _ in range(2)]
    for result in runs:
        assert result.returncode == 0 and result.stdout.splitlines()[-1] == "cached", \
            result.stderr[-3000:]
    compiled_again = [line for line in runs[1].stdout.splitlines() if "data saved" in line]
    assert not compiled_again, "\n".join(compiled_again)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [0, 1, 7, 1000])
def test_adasum_kernels_accumulate_and_combine_in_float64(dtype, size):
    """Sums in float64 (float32 inputs exact in it: within n·2^-53 of numpy's float64 dot);
    the combination computed in float64 and rounded once, so it equals numpy's float64
    arithmetic rounded to the dtype."""
    from ringtrain.kernels.adasum import dot_and_norms, scaled_add
    g = np.random.default_rng(size)
    a = g.uniform(-1, 1, size).astype(dtype)
    b = g.uniform(-1, 1, size).astype(dtype)
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    expected = (wide_a @ wide_b, wide_a @ wide_a, wide_b @ wide_b)
    assert np.allclose(dot_and_norms(a, b), expected, rtol=1e-13, atol=1e-13)
    combined = a.copy()
    scaled_add(combined, 0.75, b, 1.25)
    assert np.array_equal(combined, (0.75 * wide_a + 1.25 * wide_b).astype(dtype))
    assert combined.dtype == dtype


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, kernels.BFLOAT16,
                                   np.int8, np.int64])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kept_share", [0.0, 0.3, 1.0])
def test_gather_and_scatter_indexed_move_the_chosen_elements(dtype, size, kept_share):
    rng = np.random.default_rng(size)
    whole = (rng.standard_normal((size,)) * 50).astype(dtype).reshape(-1, 1)
    indices = np.flatnonzero(rng.random(size) < kept_share)
    packed = np.empty(indices.size, dtype)
    host.gather_indexed(whole, indices, packed)
    assert bits(packed).tolist() == bits(whole.reshape(-1)[indices]).tolist()
    out = np.full_like(whole, 7)
    host.scatter_indexed(packed, indices, out)
    expected = np.zeros_like(whole.reshape(-1))
    expected[indices] = whole.reshape(-1)[indices]
    assert bits(out.reshape(-1)).tolist() == bits(expected).tolist()


@pytest.mark.parametrize("indices, packed, message", [
    (np.array([0, 9], np.int64), np.empty(2, np.float32), "outside 9 elements"),
    (np.array([-1, 3], np.int64), np.empty(2, np.float32), "outside 9 elements"),
    (np.array([0, 3], np.int32), np.empty(2, np.float32), "int64"),
    (np.array([0, 3], np.int64), np.empty(3, np.float32), "must hold 2 float32"),
    (np.array([0, 3], np.int64), np.empty(2, np.float64), "must hold 2 float32"),
])
def test_gather_and_scatter_indexed_refuse_what_does_not_fit(indices, packed, message):
    whole = np.zeros(9, np.float32)
    with pytest.raises(ValueError, match=message):
        host.gather_indexed(whole, indices, packed)
    with pytest.raises(ValueError, match=message):
        host.scatter_indexed(packed, indices, whole)


CACHED_LOOP = """
import sys
import numpy as np
from ringtrain.kernels import host
loops = host._gather_loop
loop = loops.parallel if sys.argv[1] == "parallel" else loops.serial
loop(np.arange(9, dtype=np.uint32), np.arange(0, 9, 2), np.empty(5, np.uint32))
print(sum(loop.stats.cache_hits.values()))
"""


@pytest.mark.processes
def test_serial_loops_never_load_the_parallel_compilation_from_the_cache(tmp_path):
    def cache_hits(variant):
        run = subprocess.run([sys.executable, "-c", CACHED_LOOP, variant], check=True,
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)})
        return int(run.stdout.split()[-1])

    assert cache_hits("parallel") == 0
    assert cache_hits("serial") == 0  # compiled anew: the parallel one is filed apart
    assert cache_hits("serial") == 1
