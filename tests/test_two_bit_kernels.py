"""MXNet's 2-bit quantizer and dequantizer (host twins) against a numpy model of its rule;
the device twins are compared with these in tests/device/test_device_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from mpi.kvstore_model import two_bit_model, two_bit_words
from ringtrain.kernels import dequantize_2bit, quantize_2bit
from ringtrain.kernels.host import PARALLEL_MIN_ELEMENTS
from ringtrain.kernels.two_bit import words_for

SIZES = [1, 15, 16, 17, 100, 1001, PARALLEL_MIN_ELEMENTS + 33]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("threshold", [0.5, 0.1, 3.0])
def test_quantize_and_dequantize_follow_mxnets_rule(size, threshold):
    rng = np.random.default_rng(size)
    residual = np.zeros(size, np.float32)
    expected_residual = residual.copy()
    for step in range(3):
        gradient = rng.standard_normal(size).astype(np.float32)
        gradient[::7] = threshold  # exactly at the threshold: sent
        gradient[1::11] = -threshold
        words = np.full(words_for(size), 0xFFFFFFFF, np.uint32)  # overwritten, not or-ed
        quantize_2bit(gradient, residual, words, threshold)
        sent, expected_residual = two_bit_model(gradient, expected_residual, threshold)
        assert np.array_equal(words, two_bit_words(sent, threshold)), step
        assert np.array_equal(residual, expected_residual), step
        out = np.full(size, np.nan, np.float32)
        dequantize_2bit(words, out, threshold)
        assert np.array_equal(out, sent), step
        assert {np.float32(threshold), np.float32(-threshold)} <= set(out.tolist()) or size < 20


def test_sixteen_elements_per_word_in_mxnets_bit_order():
    sent = np.zeros(16, np.float32)
    sent[0], sent[3], sent[4], sent[15] = 1.0, -1.0, -1.0, 1.0
    words = np.empty(1, np.uint32)
    quantize_2bit(sent, np.zeros(16, np.float32), words, 1.0)
    data = words.view(np.uint8)
    # byte 0: elements 0..3, element 0 in the top two bits (11), element 3 the lowest (10)
    assert data[0] == 0b11000010 and data[1] == 0b10000000 and data[3] == 0b00000011


@pytest.mark.parametrize("threshold", [0.0, -1.0, float("nan"), float("inf")])
def test_a_threshold_must_be_positive_and_finite(threshold):
    with pytest.raises(ValueError, match="threshold"):
        quantize_2bit(np.zeros(4, np.float32), np.zeros(4, np.float32),
                      np.empty(1, np.uint32), threshold)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="float32"):
        quantize_2bit(np.zeros(4), np.zeros(4, np.float32), np.empty(1, np.uint32), 1.0)
    with pytest.raises(ValueError, match="words"):
        quantize_2bit(np.zeros(17, np.float32), np.zeros(17, np.float32),
                      np.empty(1, np.uint32), 1.0)
    with pytest.raises(ValueError, match="residual"):
        quantize_2bit(np.zeros(4, np.float32), np.zeros(3, np.float32),
                      np.empty(1, np.uint32), 1.0)
    with pytest.raises(ValueError, match="uint32"):
        dequantize_2bit(np.empty(1, np.int64), np.zeros(4, np.float32), 1.0)
