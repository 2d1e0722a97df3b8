"""MXNet's 2-bit gradient quantization, per element, on bit patterns.

Plain Python on arrays and integers, so the same source compiles for the host
(``numba.njit``) and for the GPU (``numba.cuda.jit(device=True)``), as :mod:`.float_bits`.

The rule (MXNet's ``quantize_2bit`` / ``dequantize_2bit``): for element ``i``,
``v = residual[i] + gradient[i]`` (float32); ``v >= t`` sends ``+t`` and keeps ``v - t``,
``v <= -t`` sends ``-t`` and keeps ``v + t``, otherwise sends 0 and keeps ``v``. Sixteen
elements share one 32-bit word; byte ``b`` of the word (in memory order) holds elements
``4b .. 4b+3``, element ``4b + c`` in its bits ``7-2c`` and ``6-2c``: ``11`` is ``+t``,
``10`` is ``-t``, ``00`` is 0. In the little-endian word that is bit ``8b + 6 - 2c``.
"""

import numpy as np

ELEMENTS_PER_WORD = 16
POSITIVE = 3
NEGATIVE = 2


def words_for(count):
    """How many 32-bit words hold ``count`` quantized elements."""
    return (count + ELEMENTS_PER_WORD - 1) // ELEMENTS_PER_WORD


def quantize_word(gradient, residual, word, threshold):
    """Quantize the up to 16 elements of word ``word``, updating ``residual``; the word."""
    start = word * ELEMENTS_PER_WORD
    end = start + ELEMENTS_PER_WORD
    if end > gradient.size:  # the last word's tail (no min(): numba's CUDA target)
        end = gradient.size
    bits = np.uint32(0)
    for i in range(start, end):
        # where element i sits in the little-endian word (see the module's docstring)
        shift = 8 * ((i & 15) >> 2) + 6 - 2 * (i & 3)
        value = np.float32(residual[i] + gradient[i])
        if value >= threshold:
            bits |= np.uint32(POSITIVE << shift)
            value = np.float32(value - threshold)
        elif value <= -threshold:
            bits |= np.uint32(NEGATIVE << shift)
            value = np.float32(value + threshold)
        residual[i] = value
    return bits


def dequantized(words, element, threshold):
    """The float32 that element ``element`` of the quantized ``words`` stands for."""
    shift = 8 * ((element & 15) >> 2) + 6 - 2 * (element & 3)
    code = (np.int64(words[element >> 4]) >> shift) & 3
    if code == POSITIVE:
        return threshold
    if code == NEGATIVE:
        return -threshold
    return np.float32(0)


def checked_threshold(count, dtype, words, residual, threshold):
    """Check a 2-bit kernel's arguments (host or device arrays alike); t as float32.

    ``count`` and ``dtype`` describe the float values; ``words`` and ``residual`` (or
    None) are the other arrays, seen through their ``size`` and ``dtype``.
    """
    if np.dtype(dtype) != np.float32:
        raise ValueError(f"2-bit quantization takes float32, got {dtype}")
    if np.dtype(words.dtype) != np.uint32:
        raise ValueError(f"2-bit words must be uint32, got {words.dtype}")
    if words.size != words_for(count):
        raise ValueError(f"{count} elements need {words_for(count)} words, got {words.size}")
    if residual is not None and (residual.size != count
                                 or np.dtype(residual.dtype) != np.float32):
        raise ValueError(f"the residual must be float32 of {count} elements, got "
                         f"{residual.dtype} of {residual.size}")
    t = np.float32(threshold)
    if not (np.isfinite(t) and t > 0):
        raise ValueError(f"the 2-bit threshold must be a finite number > 0, got {threshold}")
    return t
