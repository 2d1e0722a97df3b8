"""Host twins of the kernels: numpy arrays, ``numba.njit`` loops where numpy is slow.

Plain copies and native-dtype arithmetic stay in numpy, which already runs them at
memory speed. The 16-bit float formats go through numba loops on integer bit patterns
(numpy's float16 casts and arithmetic are several times slower than memory): serial for
small arrays, parallel over ``host_threads()`` threads for large ones. Compiled code is
cached on disk (``cache=True``), so only the first run on a machine pays for the JIT.

Every function here has a twin of the same name and signature in ``device``.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import numba
import numpy as np
from numba.extending import register_jitable

from . import float_bits, two_bit
from .dtypes import BFLOAT16, BFLOAT16_ENCODING, encoding_of, is_floating
from .layout import FusionLayout

PARALLEL_MIN_ELEMENTS = 1 << 17
"""Below this many elements a parallel loop costs more in start-up than it saves."""

OP_CODES = {"sum": 0, "average": 0, "min": 1, "max": 2, "product": 3}
"""Reduction ops by name, as the compiled loops number them."""

_OP_NAMES = ("add", "minimum", "maximum", "multiply")  # by op code

NUMPY_REDUCTIONS: dict[str, np.ufunc] = {
    "sum": np.add,
    "average": np.add,
    "min": np.minimum,
    "max": np.maximum,
    "product": np.multiply,
}
"""The elementwise function that combines two ranks' values, by op name (Average sums;
the collectives scale the sum afterwards)."""

_host_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
    else (os.cpu_count() or 1)


def set_host_threads(count: int) -> None:
    """Use at most ``count`` threads in parallel host kernels (e.g. cores / ranks per node)."""
    global _host_threads
    _host_threads = max(1, min(int(count), numba.config.NUMBA_NUM_THREADS))


def host_threads() -> int:
    """The number of threads parallel host kernels use."""
    return _host_threads


def _jit(function: Callable) -> Callable:
    return numba.njit(cache=True, nogil=True)(function)


def _jitable(function: Callable) -> Callable:
    """``function``, callable from compiled code (compiled for each caller, and inlined
    there by the compiler's optimiser).

    The loops below are closures over such functions, and the functions they call are
    such functions too, never compiled ones: numba keys its disk cache of a closure by
    its cells' contents pickled (a function made in a factory pickles with the globals
    it uses), and a compiled function pickles differently in every process (a new
    identifier), so a closure that reached one missed the cache and was compiled again
    at every start (2-25 s per process). A plain function pickles the same everywhere."""
    return register_jitable(function)


def _jitable_copy(function: Callable) -> Callable:
    """:func:`_jitable` on a copy of ``function`` (one shared with the GPU's kernels is
    left as it is)."""
    return _jitable(types.FunctionType(function.__code__, function.__globals__,
                                       function.__name__, function.__defaults__,
                                       function.__closure__))


_half_from_float = _jitable_copy(float_bits.half_bits_from_float_bits)
_float_from_half = _jitable_copy(float_bits.float_bits_from_half_bits)
_bfloat_from_float = _jitable_copy(float_bits.bfloat_bits_from_float_bits)
_float_from_bfloat = _jitable_copy(float_bits.float_bits_from_bfloat_bits)
_quantize_word = _jit(two_bit.quantize_word)
_dequantized = _jit(two_bit.dequantized)


def _parallel_twin(loop: Callable) -> Callable:
    """``loop`` under a name of its own: numba's on-disk cache files a function by its
    name and keys its entries by signature, not by compiler options, so the serial
    compilation would otherwise load the parallel one from the cache, and start threads
    where a rank was to use its one core."""
    twin = types.FunctionType(loop.__code__, loop.__globals__, loop.__name__,
                              loop.__defaults__, loop.__closure__)
    twin.__qualname__ = f"{loop.__qualname__}_parallel"
    return twin


class _SizedLoop:
    """A loop's serial and parallel forms, called as the size warrants."""

    def __init__(self, serial: Callable, parallel: Callable):
        self.serial, self.parallel = serial, parallel

    @classmethod
    def compiled(cls, loop: Callable) -> _SizedLoop:
        """``loop`` compiled twice, serial and parallel."""
        return cls(numba.njit(cache=True, nogil=True)(loop),
                   numba.njit(cache=True, nogil=True, parallel=True)(_parallel_twin(loop)))

    def __call__(self, size: int, *args):
        # One parallel loop at a time in a process: numba's workqueue threading layer
        # aborts the process when two threads run parallel loops at once.
        if size >= PARALLEL_MIN_ELEMENTS and _host_threads > 1 and \
                _PARALLEL_LOOP.acquire(blocking=False):
            try:
                numba.set_num_threads(_host_threads)
                return self.parallel(*args)
            finally:
                _PARALLEL_LOOP.release()
        return self.serial(*args)


_PARALLEL_LOOP = threading.Lock()
"""Held while a parallel loop runs; a loop called meanwhile by another thread runs
serially."""


def _encoder(to_bits: Callable, from_bits: Callable, name: str) -> tuple[_SizedLoop, _SizedLoop]:
    """The encode loops of one 16-bit format: plain, and with error feedback."""

    def encode(source, wire, scale):
        if scale == 1:  # no product: it would quiet a signalling NaN
            for i in numba.prange(source.size):
                wire[i] = to_bits(np.float32(source[i]).view(np.uint32))
        else:
            for i in numba.prange(source.size):
                wire[i] = to_bits(np.float32(source[i] * scale).view(np.uint32))

    def encode_feedback(source, wire, scale, residual, inverse):
        for i in numba.prange(source.size):
            value = source[i] + residual[i]
            bits = to_bits(np.float32(value * scale).view(np.uint32))
            wire[i] = bits
            residual[i] = value - np.uint32(from_bits(bits)).view(np.float32) * inverse

    encode.__qualname__ = f"encode_{name}"
    encode_feedback.__qualname__ = f"encode_{name}_feedback"
    return _SizedLoop.compiled(encode), _SizedLoop.compiled(encode_feedback)


def _decoder(from_bits: Callable, name: str) -> _SizedLoop:
    def decode(wire, out, scale):
        if scale == 1:  # no product: it would quiet a signalling NaN
            for i in numba.prange(wire.size):
                out[i] = np.uint32(from_bits(wire[i])).view(np.float32)
        else:
            for i in numba.prange(wire.size):
                out[i] = np.uint32(from_bits(wire[i])).view(np.float32) * scale

    decode.__qualname__ = f"decode_{name}"
    return _SizedLoop.compiled(decode)


def _reducer(to_bits: Callable, from_bits: Callable, name: str) -> dict[int, _SizedLoop]:
    """Loops for ``out = a (op) b`` on 16-bit floats, computed in float32 and rounded once,
    by op code; one loop per op keeps branches out of the loops."""

    def add(x_bits, y_bits):
        x = np.uint32(from_bits(x_bits)).view(np.float32)
        y = np.uint32(from_bits(y_bits)).view(np.float32)
        return to_bits(np.float32(x + y).view(np.uint32))

    def multiply(x_bits, y_bits):
        x = np.uint32(from_bits(x_bits)).view(np.float32)
        y = np.uint32(from_bits(y_bits)).view(np.float32)
        return to_bits(np.float32(x * y).view(np.uint32))

    def minimum(x_bits, y_bits):  # min and max keep an operand's bits; NaN wins, as in numpy
        x = np.uint32(from_bits(x_bits)).view(np.float32)
        y = np.uint32(from_bits(y_bits)).view(np.float32)
        return x_bits if (x <= y or x != x) else y_bits

    def maximum(x_bits, y_bits):
        x = np.uint32(from_bits(x_bits)).view(np.float32)
        y = np.uint32(from_bits(y_bits)).view(np.float32)
        return x_bits if (x >= y or x != x) else y_bits

    return {code: _reduce_loop(combine, name)
            for code, combine in ((0, add), (3, multiply), (1, minimum), (2, maximum))}


def _reduce_loop(combine: Callable, name: str) -> _SizedLoop:
    """The loop applying ``combine`` elementwise into ``out``, which may be ``a`` or ``b``."""
    reduce = _combining_loop(_jitable(combine))
    combine.__qualname__ = f"{combine.__name__}_{name}"
    reduce.__qualname__ = f"reduce_{combine.__name__}_{name}"
    return _SizedLoop.compiled(reduce)


def _combining_loop(step: Callable) -> Callable:
    """The loop ``out[i] = step(a[i], b[i])``, where ``out`` may be ``a`` or ``b``.

    The compiler vectorises a loop whose output is exactly one of its inputs, or overlaps
    neither, but falls back to one element at a time when ``out`` is an input under another
    name: the loop tells the cases apart by address and runs the form that fits."""

    def loop(a, b, out):
        if out.ctypes.data == a.ctypes.data:
            for i in numba.prange(out.size):
                out[i] = step(out[i], b[i])
        elif out.ctypes.data == b.ctypes.data:
            for i in numba.prange(out.size):
                out[i] = step(a[i], out[i])
        else:
            for i in numba.prange(out.size):
                out[i] = step(a[i], b[i])

    return loop


_SIXTEEN = np.uint32(16)
_HIGH_HALF = np.uint32(0xFFFF0000)
_KEPT_BIT = np.uint32(0x10000)  # the last bit a bfloat16 keeps of a float32
_HALF_UP = np.uint32(0x8000)  # added below an odd kept bit: a tie carries, up to even
_HALF_DOWN = np.uint32(0x7FFF)  # added below an even kept bit: a tie stays even

# The bfloat16 loops below work on words of two elements. A bfloat16 in the high half of
# a word whose low half is zero is the float32 of the same value ("wide" bits), so a
# word holds two float32 operands one shift and one mask away, and two rounded results
# go back into one word by a shift and a mask: no lane shuffles, which would otherwise
# cost more than the arithmetic.


@_jitable
def _rounded_wide(bits):
    """float32 ``bits`` rounded to the nearest bfloat16 (ties to even), which is the high
    half of the result (its low half is not cleared).

    ``bits`` must come from CPU arithmetic on bfloat16 values (and a finite float32
    factor): such a float32 is NaN only with a zero low half (an operand's NaN, quieted, or
    the default NaN 0x7FC00000), which rounding keeps NaN, with the bits
    :func:`float_bits.bfloat_bits_from_float_bits` gives; the encoder's NaN case, whose
    branch halves the speed of the loops, is not needed. (A GPU's canonical NaN, 0x7FFFFFFF,
    does need it: the device twins keep it.)"""
    return np.uint32(bits + (_HALF_UP if bits & _KEPT_BIT else _HALF_DOWN))


def _add_wide(x, y):
    return _rounded_wide(np.float32(np.uint32(x).view(np.float32) +
                                    np.uint32(y).view(np.float32)).view(np.uint32))


def _multiply_wide(x, y):
    return _rounded_wide(np.float32(np.uint32(x).view(np.float32) *
                                    np.uint32(y).view(np.float32)).view(np.uint32))


def _minimum_wide(x, y):  # min and max keep an operand's bits; NaN wins, as in numpy
    a, b = np.uint32(x).view(np.float32), np.uint32(y).view(np.float32)
    return x if (a <= b or a != a) else y


def _maximum_wide(x, y):
    a, b = np.uint32(x).view(np.float32), np.uint32(y).view(np.float32)
    return x if (a >= b or a != a) else y


@_jitable
def _low_wide(word):
    """The wide bits of a word's first bfloat16 (the low half, in little-endian memory)."""
    return np.uint32(word << _SIXTEEN)


@_jitable
def _high_wide(word):
    """The wide bits of a word's second bfloat16."""
    return np.uint32(word & _HIGH_HALF)


@_jitable
def _joined(low, high):
    """The word of two bfloat16 results, each the high half of ``low`` and ``high``."""
    return np.uint32((low >> _SIXTEEN) | (high & _HIGH_HALF))


@_jitable
def _wide(bits):
    """The wide bits of one bfloat16."""
    return np.uint32(np.uint32(bits) << _SIXTEEN)


@_jitable
def _narrow(wide):
    """The bfloat16 whose bits are the high half of ``wide``."""
    return np.uint16(wide >> _SIXTEEN)


@_jitable
def _words(bits):
    """The whole words of a uint16 array (all but an odd last element) as uint32."""
    return bits[:bits.size - bits.size % 2].view(np.uint32)


def _in_words(loop: Callable, words_loop: Callable) -> _SizedLoop:
    """The serial and parallel forms of a bfloat16 loop ``loop(a, operand, out)`` (the
    operand: ``b``, or a factor) that runs ``words_loop`` over the whole words and
    takes an odd last element itself. The parallel form takes views made here and the
    last element from the serial one: numba (0.68) compiles a parallel loop over a view
    made in the same function so that its writes are lost."""
    serial = numba.njit(cache=True, nogil=True)(loop)
    in_parallel = numba.njit(cache=True, nogil=True, parallel=True)(_parallel_twin(words_loop))

    def parallel(a: np.ndarray, operand: Any, out: np.ndarray) -> None:
        array = isinstance(operand, np.ndarray)
        in_parallel(_words(a), _words(operand) if array else operand, _words(out))
        if out.size % 2:
            serial(a[-1:], operand[-1:] if array else operand, out[-1:])

    return _SizedLoop(serial, parallel)


def _bfloat_reducer() -> dict[int, _SizedLoop]:
    """Loops for ``out = a (op) b`` on bfloat16 bits, computed in float32 and rounded
    once, by op code (one loop per op keeps branches out of them)."""
    return {code: _bfloat_reduce_loop(combine, name)
            for code, combine, name in ((0, _add_wide, "add"), (3, _multiply_wide, "multiply"),
                                        (1, _minimum_wide, "minimum"),
                                        (2, _maximum_wide, "maximum"))}


def _bfloat_reduce_loop(combine: Callable, name: str) -> _SizedLoop:
    """The loop applying wide ``combine`` to bfloat16 bits into ``out``, which may be ``a``
    or ``b``, a word at a time."""
    step = _jitable(combine)

    def combine_words(x, y):
        return _joined(step(_low_wide(x), _low_wide(y)), step(_high_wide(x), _high_wide(y)))

    reduce_words = _combining_loop(_jitable(combine_words))
    words_loop = _jitable(reduce_words)

    def reduce(a, b, out):
        words_loop(_words(a), _words(b), _words(out))
        if out.size % 2:
            last = out.size - 1
            out[last] = _narrow(step(_wide(a[last]), _wide(b[last])))

    combine_words.__qualname__ = f"{name}_bfloat_words"
    reduce_words.__qualname__ = f"reduce_{name}_bfloat_words"
    reduce.__qualname__ = f"reduce_{name}_bfloat"
    return _in_words(reduce, reduce_words)


def _bfloat_loop(step: Callable, name: str) -> _SizedLoop:
    """The loop for ``out = step(a, factor)`` on bfloat16 bits, computed in float32 and
    rounded once, a word at a time; ``out`` may be ``a``."""
    operation = _jitable(step)

    def apply(wide, factor):
        return _rounded_wide(np.float32(operation(np.uint32(wide).view(np.float32), factor))
                             .view(np.uint32))

    element = _jitable(apply)

    def apply_words(x, factor):
        return _joined(element(_low_wide(x), factor), element(_high_wide(x), factor))

    word = _jitable(apply_words)

    def loop_words(a, factor, out):
        if out.ctypes.data == a.ctypes.data:
            for i in numba.prange(out.size):
                out[i] = word(out[i], factor)
        else:
            for i in numba.prange(out.size):
                out[i] = word(a[i], factor)

    words_loop = _jitable(loop_words)

    def loop(a, factor, out):
        words_loop(_words(a), factor, _words(out))
        if out.size % 2:
            last = out.size - 1
            out[last] = _narrow(element(_wide(a[last]), factor))

    apply.__qualname__ = f"{name}_bfloat"
    apply_words.__qualname__ = f"{name}_bfloat_words"
    loop_words.__qualname__ = f"{name}_bfloat_loop_words"
    loop.__qualname__ = f"{name}_bfloat_loop"
    return _in_words(loop, loop_words)


def _times(x, factor):
    return x * factor


def _over(x, divisor):
    return x / divisor


_encode_half, _encode_half_feedback = _encoder(_half_from_float, _float_from_half, "half")
_encode_bfloat, _encode_bfloat_feedback = _encoder(_bfloat_from_float, _float_from_bfloat,
                                                   "bfloat")
_decode_half = _decoder(_float_from_half, "half")
_decode_bfloat = _decoder(_float_from_bfloat, "bfloat")
_reduce_half = _reducer(_half_from_float, _float_from_half, "half")
_reduce_bfloat = _bfloat_reducer()
_scale_bfloat = _bfloat_loop(_times, "scale")
_divide_bfloat = _bfloat_loop(_over, "divide")


def _half_loop(step: Callable, name: str) -> Callable:
    """The serial loop for ``out = step(a, factor)`` on float16 bits, computed in float32
    and rounded once, as numpy's float16 arithmetic does; ``out`` may be ``a``. (The
    host's own float16 scaling is numpy's; compiled callers, :mod:`.elementwise`, take
    this one.)"""
    operation = _jitable(step)

    def loop(a, factor, out):
        for i in range(out.size):
            value = np.uint32(_float_from_half(a[i])).view(np.float32)
            out[i] = _half_from_float(np.float32(operation(value, factor)).view(np.uint32))

    loop.__qualname__ = f"{name}_half_loop"
    return numba.njit(cache=True, nogil=True)(loop)


SERIAL_SIXTEEN_BIT_LOOPS: dict[str, Callable] = {
    **{f"{name}_half": _reduce_half[code].serial for code, name in enumerate(_OP_NAMES)},
    **{f"{name}_bfloat": _reduce_bfloat[code].serial for code, name in enumerate(_OP_NAMES)},
    "scale_half": _half_loop(_times, "scale"), "divide_half": _half_loop(_over, "divide"),
    "scale_bfloat": _scale_bfloat.serial, "divide_bfloat": _divide_bfloat.serial}
"""The serial loops on 16-bit float bits, by name (``add_half`` ... ``divide_bfloat``), for
compiled callers (:mod:`.elementwise`): ``loop(a, b, out)`` combines, ``loop(a, factor,
out)`` scales or divides by a float32."""


def _abs_max_loop(bits, sign_clear, infinity, zero):
    # On the bit patterns, |x| is an integer that orders like the float, and x is
    # finite exactly when it is below infinity's: integer max and sum vectorise.
    largest = zero
    nonfinite = 0
    for i in numba.prange(bits.size):
        magnitude = bits[i] & sign_clear
        finite = magnitude < infinity
        largest = max(largest, magnitude if finite else zero)
        nonfinite += 0 if finite else 1
    return largest, nonfinite


_abs_max = _SizedLoop.compiled(_abs_max_loop)


def _scale_as_float32(scale: float) -> np.float32:
    value = np.float32(scale)
    if not np.isfinite(value):
        raise ValueError(f"scale {scale} is not a finite float32")
    return value


def _check_scalable(dtype: np.dtype, scale: float) -> None:
    if scale != 1.0 and not is_floating(dtype):
        raise ValueError(f"a scale needs a floating dtype, got {dtype}")


def _check_float32(name: str, array: np.ndarray) -> None:
    if array.dtype != np.float32:
        raise ValueError(f"{name} must be float32, got {array.dtype}")


def _flat(array: np.ndarray) -> np.ndarray:
    if not array.flags.c_contiguous:
        raise ValueError("kernels need C-contiguous arrays")
    return array if array.ndim == 1 else array.reshape(-1)


def pack(layout: FusionLayout, tensors: Sequence[np.ndarray], buffer: np.ndarray,
         scale: float = 1.0) -> None:
    """Copy ``tensors`` into their places in ``buffer``, times ``scale``; zero the padding.

    Args:
        layout: the buffer's layout; ``tensors`` must match its shapes and dtype.
        tensors: the arrays (any strides).
        buffer: 1-D, ``layout.total_size`` elements of ``layout.dtype``.
        scale: multiplies every element on the way (floating dtypes only).
    """
    layout.check(tensors, buffer)
    _check_scalable(layout.dtype, scale)
    views = layout.views(buffer)
    for tensor, view in zip(tensors, views):
        if scale == 1.0:
            np.copyto(view, tensor)
        else:
            _scaled_copy(tensor, scale, view)
    for start, stop in layout.padding:
        buffer[start:stop] = 0


def unpack(layout: FusionLayout, buffer: np.ndarray, tensors: Sequence[np.ndarray],
           scale: float = 1.0) -> None:
    """Copy each tensor's place in ``buffer`` into ``tensors``, times ``scale``.

    Args:
        layout: the buffer's layout.
        buffer: 1-D, ``layout.total_size`` elements.
        tensors: destinations (any strides), matching the layout.
        scale: multiplies every element on the way (floating dtypes only).
    """
    layout.check(tensors, buffer)
    _check_scalable(layout.dtype, scale)
    for tensor, view in zip(tensors, layout.views(buffer)):
        if scale == 1.0:
            np.copyto(tensor, view)
        else:
            _scaled_copy(view, scale, tensor)


def gather_indexed(source: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """``out[j] = source.flat[indices[j]]``: the chosen elements, packed.

    Args:
        source: C-contiguous, any shape and dtype.
        indices: int64 flat indices into ``source``, ascending, each below
            ``source.size``.
        out: 1-D, C-contiguous, ``indices.size`` elements of ``source``'s dtype.
    """
    source_bits, out_bits = _indexed_operands(source, indices, out)
    _gather_loop(indices.size, source_bits, indices, out_bits)


def scatter_indexed(source: np.ndarray, indices: np.ndarray, out: np.ndarray) -> None:
    """``out.flat[indices[j]] = source[j]``, and zero everywhere else in ``out``.

    Args:
        source: 1-D, C-contiguous, ``indices.size`` elements of ``out``'s dtype.
        indices: int64 flat indices into ``out``, strictly ascending, each below
            ``out.size``.
        out: C-contiguous, any shape and dtype; overwritten.
    """
    out_bits, source_bits = _indexed_operands(out, indices, source)
    _scatter_loop(out.size, source_bits, indices, out_bits)


def _indexed_operands(whole: np.ndarray, indices: np.ndarray,
                      packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``whole`` and ``packed`` as unsigned integers of their element size (the loops
    copy bits, whatever the dtype), checked against ``indices``."""
    if packed.dtype != whole.dtype or packed.size != indices.size:
        raise ValueError(f"the packed array must hold {indices.size} {whole.dtype}, got "
                         f"{packed.size} {packed.dtype}")
    if indices.dtype != np.int64 or indices.ndim != 1:
        raise ValueError(f"indices must be 1-D int64, got {indices.ndim}-D {indices.dtype}")
    if indices.size and not (indices[0] >= 0 and indices[-1] < whole.size):
        raise ValueError(f"indices from {indices[0]} to {indices[-1]} are outside "
                         f"{whole.size} elements")
    unsigned = np.dtype(f"u{whole.dtype.itemsize}")
    return _flat(whole).view(unsigned), _flat(packed).view(unsigned)


def _gather(source, indices, out):
    for j in numba.prange(indices.size):
        out[j] = source[indices[j]]


def _scatter(source, indices, out):
    for i in numba.prange(out.size):
        out[i] = 0
    for j in numba.prange(indices.size):
        out[indices[j]] = source[j]


_gather_loop = _SizedLoop.compiled(_gather)
_scatter_loop = _SizedLoop.compiled(_scatter)


def _scaled_copy(source: np.ndarray, scale: float, target: np.ndarray) -> None:
    """``target[...] = source * scale`` for arrays of one shape and dtype, any strides."""
    if target.dtype != BFLOAT16:
        np.multiply(source, scale, out=target, casting="unsafe")
    elif source.flags.c_contiguous and target.flags.c_contiguous:
        scale_into(source, scale, target)
    else:  # the bfloat16 loops take contiguous arrays
        scaled = np.empty(source.shape, BFLOAT16)
        scale_into(np.ascontiguousarray(source), scale, scaled)
        np.copyto(target, scaled)


def encode_half(source: np.ndarray, wire: np.ndarray, scale: float = 1.0,
                residual: np.ndarray | None = None) -> None:
    """``wire = float16(source * scale)``, rounding to nearest even, as numpy does.

    Args:
        source: float32, C-contiguous.
        wire: float16 (or its uint16 bits), same size.
        scale: multiplies before the cast (in float32).
        residual: float32 error feedback, same size, or None. When given, ``source +
            residual`` is encoded and ``residual`` becomes what the cast lost, in
            ``source``'s units, ready to be added at the next step.
    """
    _encode_16(_encode_half, _encode_half_feedback, source, wire, scale, residual)


def encode_bfloat(source: np.ndarray, wire: np.ndarray, scale: float = 1.0,
                  residual: np.ndarray | None = None) -> None:
    """``wire = bfloat16(source * scale)`` as uint16 bits; arguments as :func:`encode_half`."""
    _encode_16(_encode_bfloat, _encode_bfloat_feedback, source, wire, scale, residual)


def _encode_16(plain: _SizedLoop, feedback: _SizedLoop, source: np.ndarray, wire: np.ndarray,
               scale: float, residual: np.ndarray | None) -> None:
    _check_float32("source", source)
    scale32 = _scale_as_float32(scale)
    source, bits = _flat(source), _flat(wire).view(np.uint16)
    if source.size != bits.size:
        raise ValueError(f"source has {source.size} elements, wire {bits.size}")
    if residual is None:
        plain(source.size, source, bits, scale32)
    else:
        _check_float32("residual", residual)
        if residual.size != source.size:
            raise ValueError(f"source has {source.size} elements, residual {residual.size}")
        inverse = _scale_as_float32(1.0 / scale)
        feedback(source.size, source, bits, scale32, _flat(residual), inverse)


def decode_half(wire: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
    """``out = float32(wire) * scale`` (exact cast, one rounding for the scale).

    Args:
        wire: float16 (or its uint16 bits), C-contiguous.
        out: float32, same size; may not overlap ``wire``.
        scale: multiplies after the cast.
    """
    _decode_16(_decode_half, wire, out, scale)


def decode_bfloat(wire: np.ndarray, out: np.ndarray, scale: float = 1.0) -> None:
    """``out = float32(wire) * scale`` for bfloat16 bits; arguments as :func:`decode_half`."""
    _decode_16(_decode_bfloat, wire, out, scale)


def _decode_16(loop: _SizedLoop, wire: np.ndarray, out: np.ndarray, scale: float) -> None:
    _check_float32("out", out)
    bits, flat_out = _flat(wire).view(np.uint16), _flat(out)
    if bits.size != flat_out.size:
        raise ValueError(f"wire has {bits.size} elements, out {flat_out.size}")
    loop(bits.size, bits, flat_out, _scale_as_float32(scale))


def _quantize_2bit(gradient, residual, words, threshold):
    for word in numba.prange(words.size):
        words[word] = _quantize_word(gradient, residual, word, threshold)


def _dequantize_2bit(words, out, threshold):
    for i in numba.prange(out.size):
        out[i] = _dequantized(words, i, threshold)


_quantize_2bit_loop = _SizedLoop.compiled(_quantize_2bit)
_dequantize_2bit_loop = _SizedLoop.compiled(_dequantize_2bit)


def quantize_2bit(gradient: np.ndarray, residual: np.ndarray, words: np.ndarray,
                  threshold: float) -> None:
    """MXNet's 2-bit quantization: ``words`` codes ``gradient + residual`` as +t, -t or 0.

    Args:
        gradient: float32, C-contiguous.
        residual: float32, same size: what earlier quantizations kept back; updated to
            ``gradient + residual - quantized``.
        words: uint32, ``two_bit.words_for(gradient.size)`` of them, 16 elements each
            (the layout is :mod:`.two_bit`'s).
        threshold: t > 0 (as float32).
    """
    t = two_bit.checked_threshold(gradient.size, gradient.dtype, words, residual, threshold)
    flat = _flat(gradient)
    _quantize_2bit_loop(flat.size, flat, _flat(residual), _flat(words), t)


def dequantize_2bit(words: np.ndarray, out: np.ndarray, threshold: float) -> None:
    """``out`` = the +t, -t or 0 that each element of :func:`quantize_2bit`'s ``words`` codes.

    Args:
        words: uint32, ``two_bit.words_for(out.size)`` of them.
        out: float32, C-contiguous; overwritten.
        threshold: the t the words were quantized with.
    """
    t = two_bit.checked_threshold(out.size, out.dtype, words, None, threshold)
    flat = _flat(out)
    _dequantize_2bit_loop(flat.size, _flat(words), flat, t)


def reduce_into(op: str, a: np.ndarray, b: np.ndarray, out: np.ndarray,
                encoding: str | None = None) -> None:
    """``out = a (op) b`` elementwise; ``out`` may be ``a`` or ``b``.

    Args:
        op: a key of :data:`OP_CODES` (``average`` sums).
        a, b: operands of ``out``'s size and dtype.
        out: destination.
        encoding: ``"bfloat16"`` when uint16 arrays hold bfloat16 bits; None otherwise
            (bfloat16 arrays need none). float16 and bfloat16 are computed in float32 and
            rounded once per element.
    """
    encoding = _encoding(encoding, out)
    if encoding == BFLOAT16_ENCODING:
        loops, dtypes = _reduce_bfloat, _BFLOAT16_STORAGE
    elif out.dtype == np.float16:
        loops, dtypes = _reduce_half, (np.dtype(np.float16),)
    else:
        NUMPY_REDUCTIONS[op](a, b, out=out)
        return
    for name, array in (("a", a), ("b", b), ("out", out)):
        if array.dtype not in dtypes or array.size != out.size:
            raise ValueError(f"{name} must hold {out.size} {dtypes[0]}, got {array.size} "
                             f"{array.dtype}")
    loops[OP_CODES[op]](out.size, _flat(a).view(_UINT16), _flat(b).view(_UINT16),
                        _flat(out).view(_UINT16))


def scale_into(a: np.ndarray, factor: float, out: np.ndarray,
               encoding: str | None = None) -> None:
    """``out = a * factor`` in ``out``'s dtype; a plain copy (or nothing) when factor is 1.

    Args:
        a: source, of ``out``'s shape.
        factor: the scale.
        out: destination; may be ``a``.
        encoding: ``"bfloat16"`` when uint16 arrays hold bfloat16 bits. bfloat16 is
            multiplied in float32 (by the factor rounded to float32) and rounded once.
    """
    if factor == 1.0:
        if out is not a:
            np.copyto(out, a)
        return
    if _encoding(encoding, out) == BFLOAT16_ENCODING:
        _bfloat_step(_scale_bfloat, a, _scale_as_float32(factor), out)
        return
    np.multiply(a, factor, out=out, casting="unsafe")


def divide_into(a: np.ndarray, divisor: int, out: np.ndarray,
                encoding: str | None = None) -> None:
    """``out = a / divisor`` (correctly rounded, as an Average's last step needs).

    Args:
        a: source, floating, of ``out``'s shape.
        divisor: a positive integer (the number of ranks).
        out: destination; may be ``a``.
        encoding: ``"bfloat16"`` when uint16 arrays hold bfloat16 bits. bfloat16 is
            divided in float32 and rounded once (correctly rounded: float32 holds more
            than twice bfloat16's significant bits, for divisors up to 256).
    """
    if _encoding(encoding, out) == BFLOAT16_ENCODING:
        _bfloat_step(_divide_bfloat, a, np.float32(divisor), out)
        return
    np.divide(a, divisor, out=out)


_BFLOAT16_STORAGE = (np.dtype(np.uint16), BFLOAT16)
"""What may hold bfloat16 bits: uint16 arrays (with ``encoding="bfloat16"``) and
bfloat16 arrays."""

_UINT16 = np.dtype(np.uint16)  # a dtype object: numpy converts np.uint16 at every use


def _encoding(encoding: str | None, out: np.ndarray) -> str | None:
    """The format of ``out``'s elements: ``encoding`` if given, else its dtype's."""
    if encoding is None:
        return encoding_of(out.dtype)
    if encoding != BFLOAT16_ENCODING:
        raise ValueError(f"unknown encoding {encoding!r}")
    return encoding


def _bfloat_step(loop: _SizedLoop, a: np.ndarray, operand: np.float32,
                 out: np.ndarray) -> None:
    """Run a bfloat16 loop of :func:`_bfloat_loop` from ``a`` into ``out`` (may be ``a``)."""
    for name, array in (("a", a), ("out", out)):
        if array.dtype not in _BFLOAT16_STORAGE or array.size != out.size:
            raise ValueError(f"{name} must hold {out.size} bfloat16, got {array.size} "
                             f"{array.dtype}")
    loop(out.size, _flat(a).view(_UINT16), operand, _flat(out).view(_UINT16))


def abs_max(values: np.ndarray) -> tuple[float, bool]:
    """The largest finite ``|value|`` (0.0 if none), and whether any value is inf or NaN.

    Args:
        values: float32 or float64, C-contiguous.
    """
    flat = _flat(values)
    if flat.dtype not in (np.float32, np.float64):
        raise ValueError(f"abs_max needs float32 or float64, got {flat.dtype}")
    if flat.size == 0:
        return 0.0, False
    unsigned = np.dtype(f"u{flat.itemsize}")
    ones = np.iinfo(unsigned).max
    infinity = np.array(np.inf, flat.dtype).view(unsigned)[()]
    largest, nonfinite = _abs_max(flat.size, flat.view(unsigned), unsigned.type(ones >> 1),
                                  infinity, unsigned.type(0))
    return float(np.array(largest, unsigned).view(flat.dtype)), bool(nonfinite)


def empty_like(array: np.ndarray, dtype: Any) -> np.ndarray:
    """A new uninitialised array of ``array``'s shape and the given dtype."""
    return np.empty(array.shape, dtype)


def zeros_like(array: np.ndarray) -> np.ndarray:
    """A new zeroed array of ``array``'s shape and dtype."""
    return np.zeros(array.shape, array.dtype)


def dtype_of(array: np.ndarray) -> np.dtype:
    """``array``'s numpy dtype."""
    return array.dtype


def compile_every_kernel() -> None:
    """Run every kernel of this module once, on small arrays and on arrays large enough to
    run in parallel, on one thread and on two: numba compiles each specialization (or
    loads it from its disk cache). The thread count is restored after."""
    threads = host_threads()
    try:
        for count in (1, 2):
            set_host_threads(count)
            for n in (5, PARALLEL_MIN_ELEMENTS):
                x = np.linspace(-2, 2, n).astype(np.float32)
                h, b = np.empty(n, np.float16), np.empty(n, np.uint16)
                out = np.empty(n, np.float32)
                for scale in (2.0, 1.0):
                    encode_half(x, h, scale)
                    encode_bfloat(x, b, scale)
                    decode_half(h, out, scale)
                    decode_bfloat(b, out, scale)
                encode_half(x, h, 2.0, np.zeros_like(x))
                encode_bfloat(x, b, 2.0, np.zeros_like(x))
                abs_max(x)
                abs_max(x.astype(np.float64))
                for op in OP_CODES:
                    reduce_into(op, h, h.copy(), np.empty_like(h))
                    reduce_into(op, h, h.copy(), h)
                    reduce_into(op, b, b.copy(), np.empty_like(b), "bfloat16")
                    reduce_into(op, b, b.copy(), b, "bfloat16")
                scale_into(b, 0.5, np.empty_like(b), "bfloat16")
                scale_into(b, 0.5, b, "bfloat16")
                divide_into(b, 3, np.empty_like(b), "bfloat16")
                divide_into(b, 3, b, "bfloat16")
    finally:
        set_host_threads(threads)
