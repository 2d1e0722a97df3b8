"""Scalar conversions between float32 and the 16-bit float formats, on bit patterns.

Plain Python on integers, so the same source compiles for the host (``numba.njit``) and
for the GPU (``numba.cuda.jit(device=True)``) and runs as it is under the CUDA
simulator: numba's CPU target has no float16 type, and integer code gives the same bits
on every target. Arithmetic is done in int64 whatever the argument's type.

float16 follows numpy's conversions bit for bit: round to nearest, ties to even;
subnormals kept; overflow to signed infinity; NaN payloads kept (their top bits), a NaN
never becoming infinity. bfloat16 is the upper half of a float32 rounded to nearest,
ties to even; NaNs stay NaN (quieted).
"""

import numpy as np


def half_bits_from_float_bits(bits):
    """float16 bits nearest to the float32 with bits ``bits`` (ties to even)."""
    f = np.int64(bits) & 0xFFFFFFFF
    sign = (f >> 16) & 0x8000
    exponent = f & 0x7F800000
    mantissa = f & 0x007FFFFF
    if exponent >= 0x47800000:  # |x| >= 65536, inf or NaN
        if exponent == 0x7F800000 and mantissa != 0:
            payload = 0x7C00 + (mantissa >> 13)
            if payload == 0x7C00:
                payload += 1
            return np.uint16(sign + payload)
        return np.uint16(sign + 0x7C00)
    if exponent <= 0x38000000:  # |x| < 2**-14: a subnormal half or zero
        if exponent < 0x33000000:
            return np.uint16(sign)
        shift = 113 - (exponent >> 23)
        significand = (0x00800000 + mantissa) >> shift
        # Round half to even; the (at most 11) bits shifted out also decide a tie.
        if (significand & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            significand += 0x1000
        return np.uint16(sign + (significand >> 13))
    half_exponent = (exponent - 0x38000000) >> 13
    if (mantissa & 0x3FFF) != 0x1000:
        mantissa += 0x1000
    # A carry out of the mantissa increments the exponent, up to infinity: both correct.
    return np.uint16(sign + half_exponent + (mantissa >> 13))


def float_bits_from_half_bits(bits):
    """float32 bits of the float16 with bits ``bits`` (exact)."""
    h = np.int64(bits) & 0xFFFF
    sign = (h & 0x8000) << 16
    exponent = h & 0x7C00
    mantissa = h & 0x03FF
    if exponent == 0:
        if mantissa == 0:
            return np.uint32(sign)
        # Subnormal: normalise the mantissa into a float32 exponent.
        shift = 0
        while (mantissa & 0x0400) == 0:
            mantissa <<= 1
            shift += 1
        return np.uint32(sign + ((113 - shift) << 23) + ((mantissa & 0x03FF) << 13))
    if exponent == 0x7C00:
        return np.uint32(sign + 0x7F800000 + (mantissa << 13))
    return np.uint32(sign + (((exponent >> 10) + 112) << 23) + (mantissa << 13))


def bfloat_bits_from_float_bits(bits):
    """bfloat16 bits nearest to the float32 with bits ``bits`` (ties to even)."""
    f = np.int64(bits) & 0xFFFFFFFF
    if (f & 0x7F800000) == 0x7F800000 and (f & 0x007FFFFF) != 0:
        return np.uint16((f >> 16) | 0x0040)
    return np.uint16((f + 0x7FFF + ((f >> 16) & 1)) >> 16)


def float_bits_from_bfloat_bits(bits):
    """float32 bits of the bfloat16 with bits ``bits`` (exact)."""
    return np.uint32((np.int64(bits) & 0xFFFF) << 16)
