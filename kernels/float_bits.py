"""Scalar conversions between float32 and the 16-bit float formats, on bit patterns.

Plain Python on integers (and, for float16 subnormals, one exact or correctly rounded
float32 operation), so the same source compiles for the host (``numba.njit``) and for
the GPU (``numba.cuda.jit(device=True)``) and runs as it is under the CUDA simulator:
numba's CPU target has no float16 type, and this code gives the same bits on every
target. Integer arithmetic is done in int64 whatever the argument's type.

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
    magnitude = f & 0x7FFFFFFF
    # Every case is computed and the right one selected: no branch, so loops vectorise.
    # Normal halves: rebias the exponent, round the 13 dropped bits half to even (a
    # carry out of the mantissa correctly bumps the exponent, up to infinity).
    normal = (magnitude - 0x38000000 + 0x0FFF + ((magnitude >> 13) & 1)) >> 13
    # Subnormal halves: adding 0.5 aligns the half's last bit with the float's, and the
    # float addition rounds half to even.
    aligned = np.float32(np.uint32(magnitude).view(np.float32) + np.float32(0.5))
    subnormal = np.int64(aligned.view(np.uint32)) - 0x3F000000
    payload = (magnitude & 0x007FFFFF) >> 13
    nan = 0x7C00 + (payload if payload != 0 else 1)
    half = subnormal if magnitude < 0x38800000 else normal
    half = 0x7C00 if magnitude >= 0x47800000 else half
    half = nan if magnitude > 0x7F800000 else half
    return np.uint16(sign | half)


def float_bits_from_half_bits(bits):
    """float32 bits of the float16 with bits ``bits`` (exact)."""
    h = np.int64(bits) & 0xFFFF
    sign = (h & 0x8000) << 16
    exponent = h & 0x7C00
    mantissa = h & 0x03FF
    normal = ((h & 0x7FFF) + 0x1C000) << 13
    # A subnormal half is mantissa * 2**-24, exact in float32.
    subnormal = np.int64(np.float32(np.float32(mantissa) * np.float32(2.0 ** -24))
                         .view(np.uint32))
    special = 0x7F800000 + (mantissa << 13)
    result = subnormal if exponent == 0 else normal
    result = special if exponent == 0x7C00 else result
    return np.uint32(sign | result)


def bfloat_bits_from_float_bits(bits):
    """bfloat16 bits nearest to the float32 with bits ``bits`` (ties to even)."""
    f = np.int64(bits) & 0xFFFFFFFF
    if (f & 0x7F800000) == 0x7F800000 and (f & 0x007FFFFF) != 0:
        return np.uint16((f >> 16) | 0x0040)
    return np.uint16((f + 0x7FFF + ((f >> 16) & 1)) >> 16)


def float_bits_from_bfloat_bits(bits):
    """float32 bits of the bfloat16 with bits ``bits`` (exact)."""
    return np.uint32((np.int64(bits) & 0xFFFF) << 16)
