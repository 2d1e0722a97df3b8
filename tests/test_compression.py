"""Compressors on host arrays: Horovod's compress/decompress, fp16 scaling, error feedback."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from ringtrain.kernels import (BF16Compressor, Compression, CompressionContext, FP16Compressor,
                               NoneCompressor, reduce_into)
from ringtrain.kernels.compression import HALF_SUM_LIMIT

HALF_EPSILON = 2.0 ** -11
BFLOAT_EPSILON = 2.0 ** -8


def numpy_half(values):
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, np.float32).astype(np.float16)


def bfloat_to_float32(patterns):
    return (np.asarray(patterns, np.uint16).astype(np.uint32) << 16).view(np.float32)


def is_power_of_two(value):
    mantissa, _ = math.frexp(value)
    return value > 0 and mantissa == 0.5


def gradients(seed, shape, std=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * std).astype(np.float32)


# --------------------------------------------------------------------------- Horovod interface

def test_compression_names():
    assert isinstance(Compression.none, NoneCompressor)
    assert isinstance(Compression.fp16, FP16Compressor)
    assert isinstance(Compression.bf16, BF16Compressor)
    for compressor in (Compression.none, Compression.fp16, Compression.bf16):
        assert compressor.error_feedback is False
    assert Compression.fp16.needs_range and not Compression.bf16.needs_range
    assert Compression.fp16.wire_dtype == np.float16 and Compression.bf16.wire_dtype == np.uint16
    assert Compression.bf16.encoding == "bfloat16" and Compression.fp16.encoding is None
    assert repr(FP16Compressor(error_feedback=True)) == "FP16Compressor(error_feedback=True)"
    assert repr(Compression.bf16) == "BF16Compressor()"


def test_none_returns_the_tensor_itself():
    tensor = gradients(0, (4, 5))
    wire, ctx = Compression.none.compress(tensor)
    assert wire is tensor
    assert ctx == CompressionContext(np.dtype(np.float32))
    assert Compression.none.decompress(wire, ctx) is tensor
    assert not Compression.none.applies_to(np.float32)


@pytest.mark.parametrize("shape", [(1000,), (3, 50), (2, 3, 4), (0,), (1,)])
def test_fp16_round_trip(shape):
    tensor = gradients(1, shape, 3.0)
    wire, ctx = Compression.fp16.compress(tensor)
    assert wire.dtype == np.float16 and wire.shape == tensor.shape
    assert ctx.dtype == np.float32 and ctx.nonfinite is False
    assert is_power_of_two(ctx.scale)
    if tensor.size:
        assert HALF_SUM_LIMIT / 2 < np.abs(tensor).max() * ctx.scale <= HALF_SUM_LIMIT
    np.testing.assert_array_equal(wire, numpy_half(tensor * np.float32(ctx.scale)))
    out = Compression.fp16.decompress(wire, ctx)
    assert out.dtype == np.float32 and out.shape == tensor.shape
    np.testing.assert_array_equal(out, wire.astype(np.float32) * np.float32(1 / ctx.scale))
    assert (np.abs(out - tensor) <= np.abs(tensor) * HALF_EPSILON).all()


@pytest.mark.parametrize("shape", [(1000,), (3, 50), (0,)])
def test_bf16_round_trip(shape):
    tensor = gradients(2, shape, 1e-3)
    wire, ctx = Compression.bf16.compress(tensor)
    assert wire.dtype == np.uint16 and wire.shape == tensor.shape
    assert ctx == CompressionContext(np.dtype(np.float32), 1.0, False)
    out = Compression.bf16.decompress(wire, ctx)
    assert out.dtype == np.float32 and out.shape == tensor.shape
    np.testing.assert_array_equal(out, bfloat_to_float32(wire))
    assert (np.abs(out - tensor) <= np.abs(tensor) * BFLOAT_EPSILON).all()
    assert np.count_nonzero(out != tensor) >= 0.9 * tensor.size


@pytest.mark.parametrize("compressor", [Compression.fp16, Compression.bf16])
@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.int64, np.uint8])
def test_other_dtypes_pass_through_untouched(compressor, dtype):
    tensor = (np.arange(12).reshape(3, 4) - 5).astype(dtype)
    before = tensor.copy()
    assert not compressor.applies_to(dtype)
    wire, ctx = compressor.compress(tensor)
    assert wire is tensor
    assert ctx.dtype == np.dtype(dtype) and ctx.scale == 1.0
    assert compressor.decompress(wire, ctx) is tensor
    np.testing.assert_array_equal(tensor, before)


@pytest.mark.parametrize("compressor", [Compression.fp16, Compression.bf16])
def test_inf_and_nan_survive_and_are_reported(compressor):
    tensor = gradients(3, 200)
    tensor[[3, 50, 120]] = [np.inf, -np.inf, np.nan]
    wire, ctx = compressor.compress(tensor)
    assert ctx.nonfinite is compressor.needs_range
    out = compressor.decompress(wire, ctx)
    assert out[3] == np.inf and out[50] == -np.inf and np.isnan(out[120])
    finite = np.isfinite(tensor)
    epsilon = HALF_EPSILON if compressor is Compression.fp16 else BFLOAT_EPSILON
    assert (np.abs(out[finite] - tensor[finite]) <= np.abs(tensor[finite]) * epsilon).all()
    if compressor is Compression.fp16:
        assert np.abs(tensor[finite]).max() * ctx.scale > HALF_SUM_LIMIT / 2


def test_all_zero_tensor_keeps_scale_one():
    tensor = np.zeros((4, 4), np.float32)
    wire, ctx = Compression.fp16.compress(tensor)
    assert ctx.scale == 1.0
    assert not Compression.fp16.decompress(wire, ctx).any()


# --------------------------------------------------------------------------- fp16 scale

@pytest.mark.parametrize("ranks", [1, 2, 3, 7, 64, 1000, 4096])
def test_scale_for_is_the_largest_power_of_two_that_fits(ranks):
    rng = np.random.default_rng(ranks)
    maxima = np.exp(rng.uniform(math.log(1e-20), math.log(1e30), 2000)).tolist()
    maxima += [2.0 ** k for k in range(-60, 80)] + [3 * 2.0 ** k for k in range(-60, 80)]
    maxima += [65504.0, 1.0, 1e-8, float(np.float32(3.4e38)) / 2 ** 20]
    for abs_max in maxima:
        scale = FP16Compressor().scale_for(abs_max, ranks)
        assert is_power_of_two(scale), (abs_max, ranks, scale)
        total = Fraction(ranks) * Fraction(abs_max) * Fraction(scale)
        assert Fraction(2 ** 14) < total <= Fraction(2 ** 15), (abs_max, ranks, scale)


def test_scale_for_exact_powers_of_two():
    fp16 = FP16Compressor()
    assert fp16.scale_for(2.0 ** 14, 1) == 2.0
    assert fp16.scale_for(1.0, 2) == 2.0 ** 14
    assert fp16.scale_for(2.0 ** 15, 1) == 1.0
    assert fp16.scale_for(1.5, 4) == 2.0 ** 12
    assert fp16.scale_for(65504.0, 1) == 0.5


@pytest.mark.parametrize("abs_max", [0.0, -0.0, math.inf, math.nan, -1.0, -math.inf])
def test_scale_for_without_a_usable_range_is_one(abs_max):
    assert FP16Compressor().scale_for(abs_max, 8) == 1.0


def test_scale_for_clamps_to_the_exponent_range():
    fp16 = FP16Compressor()
    assert fp16.scale_for(1e-40, 1) == 2.0 ** 100
    assert fp16.scale_for(3e38, 2 ** 30) == 2.0 ** -126
    assert np.isfinite(np.float32(fp16.scale_for(3e38, 2 ** 30)))
    assert np.float32(fp16.scale_for(3e38, 2 ** 30)) > 0


def test_bf16_and_none_need_no_scale():
    assert Compression.bf16.scale_for(1e-30, 8) == 1.0
    assert Compression.none.scale_for(1e30, 8) == 1.0


# --------------------------------------------------------------------------- numerics

def flushed(decoded, tensor):
    return int(np.count_nonzero((decoded == 0) & (tensor != 0)))


def test_tiny_gradients_keep_their_values_with_fp16_compression():
    tensor = gradients(4, 100_000, 1e-6)
    assert np.count_nonzero(tensor) == tensor.size
    plain = numpy_half(tensor).astype(np.float32)
    wire, ctx = Compression.fp16.compress(tensor)
    compressed = Compression.fp16.decompress(wire, ctx)
    assert flushed(plain, tensor) > 0.01 * tensor.size
    assert flushed(compressed, tensor) == 0
    assert (np.abs(compressed - tensor) <= np.abs(tensor) * HALF_EPSILON).all()
    plain_error = np.abs(plain - tensor) / np.abs(tensor)
    assert np.median(plain_error) > 50 * np.median(np.abs(compressed - tensor) / np.abs(tensor))


def test_large_gradients_do_not_overflow_with_fp16_compression():
    tensor = gradients(5, 10_000, 1e5)
    plain = numpy_half(tensor)
    assert np.isinf(plain).sum() > 0.1 * tensor.size
    wire, ctx = Compression.fp16.compress(tensor)
    assert np.isfinite(wire).all()
    out = Compression.fp16.decompress(wire, ctx)
    assert np.isfinite(out).all()
    assert (np.abs(out - tensor) <= np.abs(tensor) * HALF_EPSILON).all()


def test_fp16_scale_leaves_room_for_the_sum_over_ranks():
    ranks = 8
    parts = [gradients(10 + rank, 5000, 3e4) for rank in range(ranks)]
    abs_max = max(float(np.abs(part).max()) for part in parts)
    for part in parts:
        part[0], part[1] = abs_max, -abs_max
    scale = Compression.fp16.scale_for(abs_max, ranks)
    wires = [np.empty(5000, np.float16) for _ in parts]
    for part, wire in zip(parts, wires):
        Compression.fp16.encode(part, wire, scale)
    total = wires[0].copy()
    for wire in wires[1:]:
        reduce_into("sum", total, wire, total)
        assert np.isfinite(total).all()
    out = np.empty(5000, np.float32)
    Compression.fp16.decode(total, out, 1 / scale)
    exact = np.sum(parts, axis=0, dtype=np.float64)
    assert HALF_SUM_LIMIT / 2 < abs(float(total[0])) <= HALF_SUM_LIMIT
    assert (np.abs(out - exact) <= ranks * abs_max * 2 ** -8).all()


# --------------------------------------------------------------------------- error feedback

@pytest.mark.parametrize("compressor_type", [FP16Compressor, BF16Compressor])
def test_error_feedback_needs_a_key(compressor_type):
    compressor = compressor_type(error_feedback=True)
    tensor = gradients(6, 10)
    wire = np.empty(10, compressor.wire_dtype)
    with pytest.raises(ValueError, match="name"):
        compressor.encode(tensor, wire, 1.0)
    with pytest.raises(ValueError, match="name"):
        compressor.compress(tensor)
    compressor_type().encode(tensor, wire, 1.0)


def wire_values(compressor, wire):
    return wire.astype(np.float32) if compressor.wire_dtype == np.float16 \
        else bfloat_to_float32(wire)


@pytest.mark.parametrize("compressor_type, scale", [(FP16Compressor, 2.0 ** 10),
                                                    (FP16Compressor, 1.0),
                                                    (BF16Compressor, 1.0)])
def test_error_feedback_keeps_one_residual_per_key(compressor_type, scale):
    compressor = compressor_type(error_feedback=True)
    first, second = gradients(7, (3, 40), 1e-2), gradients(8, 25, 1e-2)
    assert compressor.residual("first") is None
    first_wire = np.empty(first.shape, compressor.wire_dtype)
    compressor.encode(first, first_wire, scale, key="first")
    residual = compressor.residual("first")
    assert residual.shape == first.shape and residual.dtype == np.float32
    np.testing.assert_array_equal(
        residual, first - wire_values(compressor, first_wire) / np.float32(scale))
    assert np.count_nonzero(residual) > 0.9 * residual.size
    kept = residual.copy()

    second_wire = np.empty(second.shape, compressor.wire_dtype)
    compressor.encode(second, second_wire, scale, key="second")
    assert compressor.residual("second").shape == second.shape
    np.testing.assert_array_equal(compressor.residual("first"), kept)

    again = np.empty(first.shape, compressor.wire_dtype)
    compressor.encode(first, again, scale, key="first")
    value = first + kept
    reference = compressor_type()
    expected_wire = np.empty(first.shape, compressor.wire_dtype)
    reference.encode(value, expected_wire, scale)
    assert again.tobytes() == expected_wire.tobytes()
    np.testing.assert_array_equal(
        compressor.residual("first"), value - wire_values(compressor, again) / np.float32(scale))


def test_error_feedback_residual_is_replaced_when_the_shape_changes():
    compressor = FP16Compressor(error_feedback=True)
    compressor.encode(gradients(9, 30, 1e-2), np.empty(30, np.float16), 1.0, key="w")
    tensor = gradients(10, (5, 4), 1e-2)
    wire = np.empty((5, 4), np.float16)
    compressor.encode(tensor, wire, 1.0, key="w")
    assert compressor.residual("w").shape == (5, 4)
    np.testing.assert_array_equal(wire, numpy_half(tensor))


def test_reset_forgets_every_residual():
    compressor = BF16Compressor(error_feedback=True)
    for key in ("a", "b"):
        compressor.encode(gradients(11, 16), np.empty(16, np.uint16), 1.0, key=key)
    assert compressor.residual("a") is not None and compressor.residual("b") is not None
    compressor.reset()
    assert compressor.residual("a") is None and compressor.residual("b") is None


def test_without_error_feedback_keys_keep_nothing():
    compressor = FP16Compressor()
    compressor.encode(gradients(12, 16), np.empty(16, np.float16), 1.0, key="a")
    assert compressor.residual("a") is None


@pytest.mark.parametrize("compressor_type", [FP16Compressor, BF16Compressor])
def test_error_feedback_makes_repeated_rounding_unbiased(compressor_type):
    step = np.random.default_rng(13).uniform(1e-3, 2e-3, 2000).astype(np.float32)
    with_feedback, without_feedback = compressor_type(error_feedback=True), compressor_type()
    totals = {"with": np.zeros(step.size), "without": np.zeros(step.size)}
    wire = np.empty(step.size, compressor_type.wire_dtype)
    out = np.empty(step.size, np.float32)
    for _ in range(64):
        for name, compressor in (("with", with_feedback), ("without", without_feedback)):
            compressor.encode(step, wire, 1.0, key="step")
            compressor.decode(wire, out, 1.0)
            totals[name] += out
    exact = 64 * step.astype(np.float64)
    error_with = np.abs(totals["with"] - exact)
    error_without = np.abs(totals["without"] - exact)
    assert error_without.mean() > 20 * error_with.mean()
    np.testing.assert_allclose(totals["with"] - exact, -with_feedback.residual("step"),
                               rtol=0, atol=1e-8)


def test_fp16_scale_clamps_when_the_ratio_overflows():
    scale = FP16Compressor().scale_for(5e-324, 1)
    assert scale == 2.0 ** 100
