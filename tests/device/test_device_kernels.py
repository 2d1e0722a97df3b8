"""The device twins of the kernels give what their host twins give, bit for bit.

Every kernel of ``ringtrain.kernels.device`` runs on device arrays (numba's, made with
``cuda.to_device``) through the dispatching entry points of ``ringtrain.kernels``, and its
result is compared with ``ringtrain.kernels.host`` on the same numpy input. Inputs are
small (the simulator runs kernels in Python) and hold the values where casts go wrong:
infinities, NaNs with payloads, subnormals, ties, overflow.

NaNs: numpy (so the host twins and the simulator) keeps a NaN operand's bits through
arithmetic, while GPU arithmetic returns the canonical NaN. Where a kernel computes on a
value (a scale other than 1, a sum, a product, error feedback) a real GPU is held to
"NaN where the host has NaN"; copies, casts without a scale, min and max keep the bits
everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain import kernels
from ringtrain.kernels import (BF16Compressor, Compression, FP16Compressor, FusionLayout,
                               host)
from ringtrain.kernels import layout as layout_module
from ringtrain.kernels.two_bit import words_for

# The simulator computes with numpy scalars, which warn of what the GPU does silently.
pytestmark = [pytest.mark.filterwarnings("ignore:.*encountered in scalar:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

SIZE_WITH_EDGES = 300
OPS = sorted(host.OP_CODES)
FORMATS = {"half": "float16", "bfloat": "bfloat16"}
ENCODE = {"half": kernels.encode_half, "bfloat": kernels.encode_bfloat}
HOST_ENCODE = {"half": host.encode_half, "bfloat": host.encode_bfloat}
DECODE = {"half": kernels.decode_half, "bfloat": kernels.decode_bfloat}
HOST_DECODE = {"half": host.decode_half, "bfloat": host.decode_bfloat}

# ----------------------------------------------------------------------------- bits


def bits(array):
    array = np.ascontiguousarray(array)
    return array.view(f"u{array.dtype.itemsize}").ravel()


def float32_from_bits(patterns):
    return np.asarray(patterns, np.uint32).view(np.float32)


def nan_mask(array, fmt):
    """Where ``array`` holds NaNs of format ``fmt`` (a dtype name, or bfloat16 for bits)."""
    patterns = bits(array).astype(np.uint64)
    if fmt == "float32":
        exponent, mantissa = 0x7F800000, 0x007FFFFF
    elif fmt == "float64":
        exponent, mantissa = 0x7FF0000000000000, 0x000FFFFFFFFFFFFF
    elif fmt == "float16":
        exponent, mantissa = 0x7C00, 0x03FF
    elif fmt == "bfloat16":
        exponent, mantissa = 0x7F80, 0x007F
    else:
        return np.zeros(patterns.size, bool)
    return ((patterns & exponent) == exponent) & ((patterns & mantissa) != 0)


def assert_same_bits(actual, expected, fmt=None, nan_bits=True):
    """``actual`` has ``expected``'s bits, but where ``nan_bits`` is False any NaN stands
    for a NaN.

    Args:
        fmt: the float format the bits hold; by default the arrays' dtype.
        nan_bits: a bool, or one per element.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    fmt = fmt or expected.dtype.name
    got, want = bits(actual), bits(expected)
    assert got.shape == want.shape, f"{got.size} elements, expected {want.size}"
    wrong = got != want
    loose = ~np.broadcast_to(np.asarray(nan_bits, bool).ravel(), want.shape)
    if loose.any():
        wrong &= ~(loose & nan_mask(actual, fmt) & nan_mask(expected, fmt))
    where = np.flatnonzero(wrong)
    width = 2 * expected.dtype.itemsize
    assert where.size == 0, (
        f"{where.size} of {want.size} differ ({fmt}); first at " + ", ".join(
            f"[{i}] got {int(got[i]):#0{width + 2}x} expected {int(want[i]):#0{width + 2}x}"
            for i in where[:5]))


@pytest.fixture
def nan_bits_kept(device_mode):
    """Whether arithmetic on the device keeps a NaN operand's bits, as numpy does."""
    return device_mode == "simulator"


# ----------------------------------------------------------------------------- inputs

EDGE_BITS = [
    0x00000000, 0x80000000, 0x3F800000, 0xBF800000,       # +-0, +-1
    0x7F800000, 0xFF800000,                               # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,       # quiet and signalling NaNs
    0x7FA00000, 0x7FC12345, 0x7FBFFFFF, 0xFFFFFFFF,       # NaN payloads
    0x00000001, 0x807FFFFF, 0x00400000,                   # float32 subnormals
    0x7F7FFFFF, 0xFF7FFFFF,                               # +-float32 max
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,       # 65504, below the tie, 65520, 2**16
    0xC77FF000, 0x4E6E6B28,                               # -65520, 1e9
    0x3F801000, 0x3F803000, 0x3F801001, 0xBF803000,       # float16 ties (1 + 2**-11 ...)
    0x38800000, 0x387FC000, 0x387FE000, 0x387FE001,       # around float16's smallest normal
    0x33800000, 0x33000000, 0x33000001, 0x33C00000,       # float16 subnormals: 2**-24, ties
    0x34200000, 0x32FFFFFF, 0xB3C00000, 0x35500000,
    0x3F808000, 0x3F818000, 0x3F808001, 0xBF808000,       # bfloat16 ties
    0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000,       # bfloat16: tie to inf, max, tiny ties
]


def cast_inputs(seed=0, size=SIZE_WITH_EDGES):
    """float32 values for the casts: the edge values, then normal values over a range of
    magnitudes from float16's subnormals to past its overflow, then random bit patterns."""
    rng = np.random.default_rng(seed)
    edges = float32_from_bits(EDGE_BITS)
    spread = (size - edges.size) * 2 // 3
    normal = (rng.standard_normal(spread) * 2.0 ** rng.integers(-30, 20, spread)) \
        .astype(np.float32)
    random = float32_from_bits(rng.integers(0, 1 << 32, size - edges.size - spread,
                                            dtype=np.uint64))
    return np.concatenate([edges, normal, random])


def half_patterns():
    """float16 bit patterns: every sign and exponent with a few mantissas (NaNs included)."""
    mantissas = [0x000, 0x001, 0x002, 0x155, 0x200, 0x2AA, 0x3FE, 0x3FF]
    return np.array([sign | exponent << 10 | mantissa for sign in (0, 0x8000)
                     for exponent in range(32) for mantissa in mantissas], np.uint16)


def bfloat_patterns(seed=1):
    """bfloat16 bit patterns: signs, exponents at the ends and middle, random ones."""
    exponents = [0, 1, 2, 63, 64, 126, 127, 128, 129, 200, 253, 254, 255]
    mantissas = [0x00, 0x01, 0x40, 0x55, 0x7F]
    chosen = [sign | exponent << 7 | mantissa for sign in (0, 0x8000)
              for exponent in exponents for mantissa in mantissas]
    random = np.random.default_rng(seed).integers(0, 1 << 16, 170)
    return np.concatenate([np.array(chosen), random]).astype(np.uint16)


def garbage(shape, dtype):
    """An array whose every byte is 0xFF (NaN for the float formats)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    return np.full(count * dtype.itemsize, 0xFF, np.uint8).view(dtype).reshape(shape)


# ----------------------------------------------------------------------------- dispatch


def test_device_arrays_go_to_the_device_twins(cuda, device):
    assert kernels.twin_for(cuda.to_device(np.zeros(3, np.float32))) is device
    assert kernels.twin_for(np.zeros(3, np.float32)) is host


# ----------------------------------------------------------------------------- pack


SHAPES = [(3, 5), (0,), (17,), (2, 0, 3), (1,), (40,), (6, 7), (0,)]


def pack_tensors(dtype, seed=2):
    rng = np.random.default_rng(seed)
    tensors = []
    for shape in SHAPES:
        count = int(np.prod(shape))
        if dtype == np.float32:
            values = cast_inputs(seed)[rng.integers(0, SIZE_WITH_EDGES, count)]
        elif dtype == np.float16:
            values = half_patterns()[rng.integers(0, 512, count)].view(np.float16)
        else:
            values = rng.integers(-(1 << 31), 1 << 31, count).astype(np.int32)
        tensors.append(np.ascontiguousarray(values.reshape(shape)))
    return tensors


@pytest.mark.parametrize("dtype, scale, task_elements", [
    (np.float32, 1.0, None), (np.float32, 0.5, None), (np.float16, 1.0, None),
    (np.float16, 0.5, None), (np.int32, 1.0, None), (np.float32, 1.0, 7),
    (np.float16, 0.5, 7)], ids=["float32", "float32-scaled", "float16", "float16-scaled",
                                "int32", "float32-small-tasks", "float16-scaled-small-tasks"])
def test_pack_matches_host(cuda, monkeypatch, nan_bits_kept, dtype, scale, task_elements):
    if task_elements:
        monkeypatch.setattr(layout_module, "TASK_ELEMENTS", task_elements)
    tensors = pack_tensors(dtype)
    layout = FusionLayout.of(tensors)
    assert layout.padding
    if task_elements:
        assert len(layout.tasks) > layout.count + len(layout.padding)
    expected = garbage(layout.total_size, dtype)
    host.pack(layout, tensors, expected, scale)
    buffer = cuda.to_device(garbage(layout.total_size, dtype))
    kernels.pack(layout, [cuda.to_device(t) for t in tensors], buffer, scale)
    packed = buffer.copy_to_host()
    assert_same_bits(packed, expected, nan_bits=scale == 1.0 or nan_bits_kept)
    for start, stop in layout.padding:
        assert not bits(packed[start:stop]).any(), f"padding {start}:{stop} not zeroed"
    # The same layout again, with other tensors at other addresses.
    others = pack_tensors(dtype, seed=3)
    host.pack(layout, others, expected, scale)
    kernels.pack(layout, [cuda.to_device(t) for t in others], buffer, scale)
    assert_same_bits(buffer.copy_to_host(), expected, nan_bits=scale == 1.0 or nan_bits_kept)


@pytest.mark.parametrize("dtype, scale, task_elements", [
    (np.float32, 1.0, None), (np.float32, 0.5, None), (np.float16, 1.0, None),
    (np.float16, 0.5, None), (np.int32, 1.0, None), (np.float32, 0.5, 7)],
    ids=["float32", "float32-scaled", "float16", "float16-scaled", "int32",
         "float32-scaled-small-tasks"])
def test_unpack_matches_host(cuda, monkeypatch, nan_bits_kept, dtype, scale, task_elements):
    if task_elements:
        monkeypatch.setattr(layout_module, "TASK_ELEMENTS", task_elements)
    tensors = pack_tensors(dtype)
    layout = FusionLayout.of(tensors)
    buffer = garbage(layout.total_size, dtype)
    host.pack(layout, tensors, buffer)
    expected = [garbage(t.shape, dtype) for t in tensors]
    host.unpack(layout, buffer, expected, scale)
    outputs = [cuda.to_device(garbage(t.shape, dtype)) for t in tensors]
    kernels.unpack(layout, cuda.to_device(buffer), outputs, scale)
    for index, (output, want) in enumerate(zip(outputs, expected)):
        got = output.copy_to_host()
        assert got.shape == want.shape, index
        assert_same_bits(got, want, nan_bits=scale == 1.0 or nan_bits_kept)
    if scale == 1.0:
        for output, tensor in zip(outputs, tensors):
            assert_same_bits(output.copy_to_host(), tensor)


def test_pack_of_no_tensors(cuda):
    layout = FusionLayout([], np.float32)
    buffer = cuda.to_device(np.zeros(0, np.float32))
    kernels.pack(layout, [], buffer)
    kernels.unpack(layout, buffer, [])
    assert buffer.copy_to_host().size == 0


def test_pack_refuses_a_scale_for_integers(cuda):
    tensors = pack_tensors(np.int32)
    layout = FusionLayout.of(tensors)
    buffer = cuda.to_device(np.zeros(layout.total_size, np.int32))
    with pytest.raises(ValueError, match="floating"):
        kernels.pack(layout, [cuda.to_device(t) for t in tensors], buffer, 0.5)


def test_pack_checks_the_layout(cuda):
    tensors = pack_tensors(np.float32)
    layout = FusionLayout.of(tensors)
    devices = [cuda.to_device(t) for t in tensors]
    buffer = cuda.to_device(np.zeros(layout.total_size, np.float32))
    with pytest.raises(ValueError):
        kernels.pack(layout, devices[:-1], buffer)
    with pytest.raises(ValueError):
        kernels.pack(layout, devices, cuda.to_device(np.zeros(layout.total_size - 1, np.float32)))
    with pytest.raises(ValueError):
        kernels.pack(layout, devices, cuda.to_device(np.zeros(layout.total_size, np.float16)))
    with pytest.raises(ValueError):
        kernels.unpack(layout, buffer, devices[1:] + devices[:1])


# ----------------------------------------------------------------------------- casts


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0, 2.0 ** -20])
@pytest.mark.parametrize("kind, wire_dtype", [("half", np.float16), ("half", np.uint16),
                                              ("bfloat", np.uint16)])
def test_encode_matches_host(cuda, nan_bits_kept, kind, wire_dtype, scale):
    values = cast_inputs()
    expected = np.empty(values.size, np.uint16)
    HOST_ENCODE[kind](values, expected, scale)
    wire = cuda.to_device(garbage(values.size, wire_dtype))
    ENCODE[kind](cuda.to_device(values.reshape(12, 25)), wire, scale)
    got = wire.copy_to_host()
    assert got.dtype == wire_dtype
    assert_same_bits(got, expected, FORMATS[kind], nan_bits=scale == 1.0 or nan_bits_kept)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** 12, 3.0, 0.1])
@pytest.mark.parametrize("kind", ["half", "bfloat"])
def test_encode_with_error_feedback_matches_host(cuda, nan_bits_kept, kind, scale):
    values = cast_inputs(seed=4)
    rng = np.random.default_rng(5)
    expected_residual = (rng.standard_normal(values.size) * 1e-3).astype(np.float32)
    residual = cuda.to_device(expected_residual)
    source = cuda.to_device(values)
    expected = np.empty(values.size, np.uint16)
    wire = cuda.to_device(garbage(values.size, np.uint16))
    for step in range(3):
        HOST_ENCODE[kind](values, expected, scale, expected_residual)
        ENCODE[kind](source, wire, scale, residual)
        assert_same_bits(wire.copy_to_host(), expected, FORMATS[kind], nan_bits=nan_bits_kept)
        kept = residual.copy_to_host()
        assert_same_bits(kept, expected_residual, nan_bits=nan_bits_kept)
        finite = np.isfinite(expected_residual)
        assert finite.sum() > values.size // 2 and expected_residual[finite].any(), step
    assert_same_bits(source.copy_to_host(), values)


@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0, 2.0 ** -120])
@pytest.mark.parametrize("kind, wire_dtype", [("half", np.float16), ("half", np.uint16),
                                              ("bfloat", np.uint16)])
def test_decode_matches_host(cuda, nan_bits_kept, kind, wire_dtype, scale):
    patterns = half_patterns() if kind == "half" else bfloat_patterns()
    wire = patterns.view(wire_dtype)
    expected = np.empty(patterns.size, np.float32)
    HOST_DECODE[kind](wire, expected, scale)
    out = cuda.to_device(garbage((2, patterns.size // 2), np.float32))
    DECODE[kind](cuda.to_device(wire), out, scale)
    got = out.copy_to_host()
    assert got.shape == (2, patterns.size // 2)
    assert_same_bits(got, expected, nan_bits=scale == 1.0 or nan_bits_kept)
    if scale == 2.0 ** -120:
        subnormal = (expected != 0) & (np.abs(expected) < np.finfo(np.float32).tiny)
        assert subnormal.any()


def test_casts_check_their_arguments(cuda):
    source = cuda.to_device(np.ones(8, np.float32))
    with pytest.raises(ValueError):
        kernels.encode_half(source, cuda.to_device(np.zeros(7, np.uint16)))
    with pytest.raises(ValueError):
        kernels.encode_half(cuda.to_device(np.ones(8, np.float64)),
                            cuda.to_device(np.zeros(8, np.uint16)))
    with pytest.raises(ValueError):
        kernels.encode_bfloat(source, cuda.to_device(np.zeros(8, np.uint16)), 1.0,
                              cuda.to_device(np.zeros(7, np.float32)))
    with pytest.raises(ValueError):
        kernels.encode_half(source, cuda.to_device(np.zeros(8, np.uint16)), float("inf"))
    with pytest.raises(ValueError):
        kernels.decode_bfloat(cuda.to_device(np.zeros(8, np.uint16)),
                              cuda.to_device(np.zeros(8, np.float16)))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.encode_half(cuda.to_device(np.ones((4, 6), np.float32))[:, ::2],
                            cuda.to_device(np.zeros(12, np.uint16)))


# ----------------------------------------------------------------------------- reductions


def reduction_operands(fmt, seed=6):
    """Two operands of ``SIZE_WITH_EDGES`` elements in format ``fmt``, edge pairs first."""
    rng = np.random.default_rng(seed)
    if fmt in ("float16", "bfloat16"):
        patterns = half_patterns() if fmt == "float16" else bfloat_patterns()
        inf, nan = (0x7C00, 0x7E00) if fmt == "float16" else (0x7F80, 0x7FC0)
        top = 0x7BFF if fmt == "float16" else 0x7F7F
        pairs = [(0x0000, 0x8000), (0x8000, 0x0000), (0x8000, 0x8000), (inf, inf | 0x8000),
                 (inf, 0x0000), (nan, 0x3C00), (0x3C00, nan | 0x8001), (nan | 1, nan | 0x8000),
                 (top, top), (top | 0x8000, top | 0x8000), (0x0001, 0x0001), (0x0001, 0x8001)]
        a, b = (np.array(side, np.uint16) for side in zip(*pairs))
        count = SIZE_WITH_EDGES - len(pairs)
        a = np.concatenate([a, patterns[rng.integers(0, patterns.size, count)]])
        b = np.concatenate([b, patterns[rng.integers(0, patterns.size, count)]])
        return (a.view(np.float16), b.view(np.float16)) if fmt == "float16" else (a, b)
    if fmt == "float32":
        a = cast_inputs(seed)
        b = np.concatenate([a[:8][::-1], cast_inputs(seed + 1)[rng.permutation(a.size - 8)]])
        # numpy's minimum and maximum pick either zero of a +0/-0 pair, by SIMD path.
        tie = (a == 0) & (b == 0) & (np.signbit(a) != np.signbit(b))
        b[tie] = 1.0
        return a, b
    extremes = np.array([2**31 - 1, -2**31, -2**31, 2**31 - 1, 0, -1], np.int64)
    a = np.concatenate([extremes, rng.integers(-(1 << 31), 1 << 31, SIZE_WITH_EDGES - 6)])
    b = np.concatenate([extremes[::-1], rng.integers(-(1 << 31), 1 << 31,
                                                     SIZE_WITH_EDGES - 6)])
    return a.astype(np.int32), b.astype(np.int32)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "float32", "int32"])
@pytest.mark.parametrize("op", OPS)
def test_reduce_into_matches_host(cuda, nan_bits_kept, op, fmt):
    encoding = "bfloat16" if fmt == "bfloat16" else None
    a, b = reduction_operands(fmt)
    expected = np.empty_like(a)
    with np.errstate(all="ignore"):
        host.reduce_into(op, a, b, expected, encoding)
    # Of two NaNs, a sum or product keeps either, as the compiled code orders the operands;
    # numpy's minimum and maximum (the host twin of native dtypes) pick either by SIMD path.
    both_nan = nan_mask(a, fmt) & nan_mask(b, fmt)
    if op in ("min", "max"):
        exact = ~both_nan if encoding is None and fmt != "float16" else True
    else:
        exact = nan_bits_kept & ~both_nan
    out = cuda.to_device(garbage(a.shape, a.dtype))
    device_a, device_b = cuda.to_device(a), cuda.to_device(b)
    kernels.reduce_into(op, device_a, device_b, out, encoding)
    assert_same_bits(out.copy_to_host(), expected, fmt, nan_bits=exact)
    assert_same_bits(device_a.copy_to_host(), a)
    assert_same_bits(device_b.copy_to_host(), b)
    # In place, into either operand.
    kernels.reduce_into(op, device_a, device_b, device_a, encoding)
    assert_same_bits(device_a.copy_to_host(), expected, fmt, nan_bits=exact)
    kernels.reduce_into(op, cuda.to_device(a), device_b, device_b, encoding)
    assert_same_bits(device_b.copy_to_host(), expected, fmt, nan_bits=exact)


def test_reduce_into_checks_its_operands(cuda):
    half = cuda.to_device(np.zeros(8, np.float16))
    with pytest.raises(ValueError):
        kernels.reduce_into("sum", half, cuda.to_device(np.zeros(7, np.float16)), half)
    with pytest.raises(ValueError):
        kernels.reduce_into("sum", cuda.to_device(np.zeros(8, np.float32)), half, half)
    bfloat = cuda.to_device(np.zeros(8, np.uint16))
    with pytest.raises(ValueError):
        kernels.reduce_into("sum", bfloat, cuda.to_device(np.zeros(9, np.uint16)), bfloat,
                            "bfloat16")
    with pytest.raises(ValueError):
        kernels.reduce_into("sum", bfloat, bfloat, bfloat, "bfloat8")
    single = cuda.to_device(np.zeros(8, np.float32))
    with pytest.raises(ValueError):
        kernels.reduce_into("sum", single, cuda.to_device(np.zeros(4, np.float32)), single)


# ----------------------------------------------------------------------------- scale, range


@pytest.mark.parametrize("factor", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_scale_into_matches_host(cuda, nan_bits_kept, dtype, factor):
    values = cast_inputs() if dtype == np.float32 else half_patterns().view(np.float16)
    values = values.reshape(-1, 4)
    exact = factor == 1.0 or nan_bits_kept
    expected = garbage(values.shape, dtype)
    with np.errstate(all="ignore"):
        host.scale_into(values, factor, expected)
    source = cuda.to_device(values)
    out = cuda.to_device(garbage(values.shape, dtype))
    with np.errstate(all="ignore"):
        kernels.scale_into(source, factor, out)
    assert_same_bits(out.copy_to_host(), expected, nan_bits=exact)
    assert_same_bits(source.copy_to_host(), values)
    with np.errstate(all="ignore"):
        kernels.scale_into(source, factor, source)
    assert_same_bits(source.copy_to_host(), expected, nan_bits=exact)


@pytest.mark.parametrize("divisor", [1, 3, 7])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_divide_into_matches_host(cuda, nan_bits_kept, dtype, divisor):
    values = cast_inputs().astype(dtype) if dtype != np.float16 else \
        half_patterns().view(np.float16)
    expected = garbage(values.shape, dtype)
    with np.errstate(all="ignore"):
        host.divide_into(values, divisor, expected)
    source = cuda.to_device(values)
    out = cuda.to_device(garbage(values.shape, dtype))
    with np.errstate(all="ignore"):
        kernels.divide_into(source, divisor, out)
    assert_same_bits(out.copy_to_host(), expected, nan_bits=nan_bits_kept)
    with np.errstate(all="ignore"):
        kernels.divide_into(source, divisor, source)
    assert_same_bits(source.copy_to_host(), expected, nan_bits=nan_bits_kept)


def abs_max_cases(dtype):
    rng = np.random.default_rng(7)
    finite = (rng.standard_normal(SIZE_WITH_EDGES) * 100).astype(dtype)
    finite[123] = -1234.5
    with_inf, with_nan, both = finite.copy(), finite.copy(), finite.copy()
    with_inf[[0, 77]] = [np.inf, -np.inf]
    with_nan[[5, 299]] = np.nan
    both[[1, 2]] = [np.nan, -np.inf]
    tiny = np.array([0.0, -0.0, np.finfo(dtype).smallest_subnormal, -4 *
                     np.finfo(dtype).smallest_subnormal] * 20, dtype)
    return {
        "finite": (finite, 1234.5, False),
        "inf": (with_inf, 1234.5, True),
        "nan": (with_nan, 1234.5, True),
        "inf-and-nan": (both, 1234.5, True),
        "only-nan": (np.full(33, np.nan, dtype), 0.0, True),
        "only-inf": (np.full(33, -np.inf, dtype), 0.0, True),
        "zeros": (np.zeros(40, dtype), 0.0, False),
        "subnormal": (tiny, float(4 * np.finfo(dtype).smallest_subnormal), False),
        "empty": (np.zeros(0, dtype), 0.0, False),
        "one": (np.array([-3.0], dtype), 3.0, False),
        "largest-last": (np.append(finite, dtype(-np.finfo(dtype).max)),
                         float(np.finfo(dtype).max), False),
    }


@pytest.mark.parametrize("case", sorted(abs_max_cases(np.float32)))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_abs_max_matches_host(cuda, dtype, case):
    values, largest, nonfinite = abs_max_cases(dtype)[case]
    expected = host.abs_max(values)
    assert expected == (largest, nonfinite)
    found = kernels.abs_max(cuda.to_device(values.reshape(-1, 1)))
    assert found == expected
    assert isinstance(found[0], float) and isinstance(found[1], bool)


def test_abs_max_refuses_other_dtypes(cuda):
    with pytest.raises(ValueError):
        kernels.abs_max(cuda.to_device(np.ones(4, np.float16)))


# ----------------------------------------------------------------------------- allocation


def test_empty_like_and_zeros_like_make_device_arrays(cuda, device):
    source = cuda.to_device(np.arange(12, dtype=np.float32).reshape(3, 4))
    empty = kernels.empty_like(source, np.float16)
    assert kernels.twin_for(empty) is device
    assert tuple(empty.shape) == (3, 4) and np.dtype(empty.dtype) == np.float16
    zeros = kernels.zeros_like(source)
    assert kernels.twin_for(zeros) is device
    assert tuple(zeros.shape) == (3, 4) and np.dtype(zeros.dtype) == np.float32
    assert_same_bits(zeros.copy_to_host(), host.zeros_like(source.copy_to_host()))
    assert zeros.copy_to_host().shape == (3, 4)
    assert not bits(zeros.copy_to_host()).any()
    # New memory: writing one leaves the source alone.
    kernels.scale_into(source, 1.0, zeros)
    kernels.reduce_into("sum", zeros, zeros, zeros)
    assert_same_bits(source.copy_to_host(), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert_same_bits(zeros.copy_to_host(), 2 * np.arange(12, dtype=np.float32).reshape(3, 4))


# ----------------------------------------------------------------------------- compression


def compression_tensor(case):
    rng = np.random.default_rng(8)
    values = rng.standard_normal((6, 50)).astype(np.float32)
    if case == "small":
        values *= np.float32(1e-6)
        values[0, :4] = [1e-12, -3e-9, 0.0, -0.0]
    elif case == "large":
        values *= np.float32(3e4)
    elif case == "nonfinite":
        values[1, [3, 9]] = [np.inf, np.nan]
    return values


@pytest.mark.parametrize("case", ["small", "large", "nonfinite"])
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_compression_on_device_arrays_equals_host(cuda, device, nan_bits_kept, name, case):
    compressor = getattr(Compression, name)
    fmt = "float16" if name == "fp16" else "bfloat16"
    tensor = compression_tensor(case)
    expected_wire, expected_context = compressor.compress(tensor)
    wire, context = compressor.compress(cuda.to_device(tensor))
    assert kernels.twin_for(wire) is device
    assert context == expected_context
    if name == "fp16" and case != "nonfinite":
        assert context.scale != 1.0
    got = wire.copy_to_host()
    assert got.dtype == expected_wire.dtype and got.shape == tensor.shape
    assert_same_bits(got, expected_wire, fmt, nan_bits=context.scale == 1.0 or nan_bits_kept)
    expected_restored = compressor.decompress(expected_wire, expected_context)
    restored = compressor.decompress(wire, context)
    assert kernels.twin_for(restored) is device
    restored = restored.copy_to_host()
    assert restored.dtype == np.float32 and restored.shape == tensor.shape
    assert_same_bits(restored, expected_restored,
                     nan_bits=context.scale == 1.0 or nan_bits_kept)
    assert_same_bits(compressor.decompress(cuda.to_device(tensor), context).copy_to_host(),
                     tensor)


@pytest.mark.parametrize("compressor_type", [FP16Compressor, BF16Compressor])
def test_error_feedback_compressor_on_device_arrays_equals_host(cuda, device, nan_bits_kept,
                                                                compressor_type):
    fmt = "float16" if compressor_type is FP16Compressor else "bfloat16"
    on_host, on_device = compressor_type(error_feedback=True), \
        compressor_type(error_feedback=True)
    tensor = compression_tensor("small")
    scale = on_host.scale_for(host.abs_max(tensor)[0], 3)
    source = cuda.to_device(tensor)
    expected = np.empty(tensor.shape, on_host.wire_dtype)
    wire = cuda.to_device(garbage(tensor.shape, on_host.wire_dtype))
    for _ in range(2):
        on_host.encode(tensor, expected, scale, key="w")
        on_device.encode(source, wire, scale, key="w")
        assert_same_bits(wire.copy_to_host(), expected, fmt, nan_bits=nan_bits_kept)
        residual = on_device.residual("w")
        assert kernels.twin_for(residual) is device
        assert_same_bits(residual.copy_to_host(), on_host.residual("w"),
                         nan_bits=nan_bits_kept)
    assert on_host.residual("w").any()


# ----------------------------------------------------------------------------- interface


class Exposed:
    """Only the CUDA array interface of a device array: no shape, dtype or size."""

    def __init__(self, array):
        self._array = array

    @property
    def __cuda_array_interface__(self):
        return self._array.__cuda_array_interface__


def test_objects_with_only_the_cuda_array_interface(cuda, device, device_mode):
    if device_mode == "simulator":
        pytest.skip("needs a real GPU: the simulator's arrays have no __cuda_array_interface__")
    assert kernels.twin_for(Exposed(cuda.to_device(np.zeros(3, np.float32)))) is device
    tensors = pack_tensors(np.float32)
    layout = FusionLayout.of(tensors)
    expected = np.empty(layout.total_size, np.float32)
    host.pack(layout, tensors, expected, 0.5)
    buffer = cuda.to_device(garbage(layout.total_size, np.float32))
    kernels.pack(layout, [Exposed(cuda.to_device(t)) for t in tensors], Exposed(buffer), 0.5)
    assert_same_bits(buffer.copy_to_host(), expected, nan_bits=False)
    outputs = [cuda.to_device(garbage(t.shape, np.float32)) for t in tensors]
    kernels.unpack(layout, Exposed(buffer), [Exposed(o) for o in outputs], 2.0)
    unpacked = [np.empty_like(t) for t in tensors]
    host.unpack(layout, expected, unpacked, 2.0)
    for output, want in zip(outputs, unpacked):
        assert_same_bits(output.copy_to_host(), want, nan_bits=False)

    values = cast_inputs()
    residual = np.zeros(values.size, np.float32)
    wire = np.empty(values.size, np.float16)
    host.encode_half(values, wire, 0.5, residual)
    device_wire = cuda.to_device(garbage(values.size, np.float16))
    device_residual = cuda.to_device(np.zeros(values.size, np.float32))
    kernels.encode_half(Exposed(cuda.to_device(values)), Exposed(device_wire), 0.5,
                        Exposed(device_residual))
    assert_same_bits(device_wire.copy_to_host(), wire, nan_bits=False)
    assert_same_bits(device_residual.copy_to_host(), residual, nan_bits=False)
    bfloat = cuda.to_device(garbage(values.size, np.uint16))
    kernels.encode_bfloat(Exposed(cuda.to_device(values)), Exposed(bfloat))
    expected_bfloat = np.empty(values.size, np.uint16)
    host.encode_bfloat(values, expected_bfloat)
    assert_same_bits(bfloat.copy_to_host(), expected_bfloat, "bfloat16")

    # From here on the host's wire: a NaN scaled on a GPU comes out with the GPU's
    # canonical payload, which the encoding check above leaves aside.
    device_wire = cuda.to_device(wire)
    decoded, expected_decoded = cuda.to_device(garbage(values.size, np.float32)), \
        np.empty(values.size, np.float32)
    kernels.decode_half(Exposed(device_wire), Exposed(decoded))
    host.decode_half(wire, expected_decoded)
    assert_same_bits(decoded.copy_to_host(), expected_decoded)

    summed, expected_sum = cuda.to_device(garbage(values.size, np.float16)), \
        np.empty(values.size, np.float16)
    kernels.reduce_into("max", Exposed(device_wire), Exposed(device_wire), Exposed(summed))
    host.reduce_into("max", wire, wire, expected_sum)
    assert_same_bits(summed.copy_to_host(), expected_sum)
    copied = cuda.to_device(garbage(values.size, np.float32))
    kernels.scale_into(Exposed(decoded), 1.0, Exposed(copied))
    assert_same_bits(copied.copy_to_host(), expected_decoded)
    assert kernels.abs_max(Exposed(cuda.to_device(values))) == host.abs_max(values)
    empty = kernels.empty_like(Exposed(decoded), np.float16)
    assert tuple(empty.shape) == (values.size,) and np.dtype(empty.dtype) == np.float16
    zeros = kernels.zeros_like(Exposed(decoded))
    assert_same_bits(zeros.copy_to_host(), np.zeros(values.size, np.float32))


# ----------------------------------------------------------------------------- bfloat16 arrays
#
# bfloat16 arrays (ml_dtypes.bfloat16 on the host) in device memory: ringtrain's
# BfloatDeviceArray (uint16 bits whose interface says "bfloat16"), and under the simulator
# also the simulator's own arrays over bfloat16 host memory. Their kernels need no
# ``encoding``: the dtype says it.

BFLOAT16_KINDS = ["ringtrain", "simulator"]


def bfloat16_on_device(cuda, device, device_mode, values, kind):
    """``values`` (bfloat16) copied to the device as an array of ``kind``."""
    if kind == "simulator":
        if device_mode != "simulator":
            pytest.skip("the simulator's arrays over bfloat16 host memory")
        return cuda.to_device(values)
    return device.BfloatDeviceArray(cuda.to_device(np.ascontiguousarray(values)
                                                   .view(np.uint16)))


def bfloat16_values(seed=7):
    return bfloat_patterns(seed).view(kernels.BFLOAT16)


@pytest.mark.parametrize("kind", BFLOAT16_KINDS)
@pytest.mark.parametrize("op", OPS)
def test_bfloat16_arrays_reduce_as_on_the_host(cuda, device, device_mode, nan_bits_kept, op,
                                               kind):
    a_bits, b_bits = reduction_operands("bfloat16")
    a, b = a_bits.view(kernels.BFLOAT16), b_bits.view(kernels.BFLOAT16)
    expected = garbage(a.shape, kernels.BFLOAT16)
    with np.errstate(all="ignore"):
        host.reduce_into(op, a, b, expected)
        through_bits = garbage(a.shape, np.uint16)
        host.reduce_into(op, a_bits, b_bits, through_bits, "bfloat16")
    assert_same_bits(expected, through_bits.view(kernels.BFLOAT16))
    both_nan = nan_mask(a_bits, "bfloat16") & nan_mask(b_bits, "bfloat16")
    exact = True if op in ("min", "max") else nan_bits_kept & ~both_nan
    out = bfloat16_on_device(cuda, device, device_mode, garbage(a.shape, kernels.BFLOAT16), kind)
    device_a = bfloat16_on_device(cuda, device, device_mode, a, kind)
    kernels.reduce_into(op, device_a, bfloat16_on_device(cuda, device, device_mode, b, kind),
                        out)
    assert_same_bits(out.copy_to_host(), expected, nan_bits=exact)
    kernels.reduce_into(op, device_a, bfloat16_on_device(cuda, device, device_mode, b, kind),
                        device_a)
    assert_same_bits(device_a.copy_to_host(), expected, nan_bits=exact)


@pytest.mark.parametrize("kind", BFLOAT16_KINDS)
@pytest.mark.parametrize("factor", [1.0, 0.5, 3.0, 0.1])
def test_bfloat16_scale_into_matches_host_in_float32(cuda, device, device_mode, nan_bits_kept,
                                                     factor, kind):
    values = bfloat16_values().reshape(-1, 5)
    expected = garbage(values.shape, kernels.BFLOAT16)
    host.scale_into(values, factor, expected)
    finite = np.isfinite(values.astype(np.float32))
    with np.errstate(all="ignore"):
        in_float32 = (values.astype(np.float32) * np.float32(factor)).astype(kernels.BFLOAT16)
    assert_same_bits(expected[finite], in_float32[finite])
    exact = factor == 1.0 or nan_bits_kept
    source = bfloat16_on_device(cuda, device, device_mode, values, kind)
    out = bfloat16_on_device(cuda, device, device_mode, garbage(values.shape, kernels.BFLOAT16),
                             kind)
    kernels.scale_into(source, factor, out)
    assert_same_bits(out.copy_to_host(), expected, nan_bits=exact)
    kernels.scale_into(source, factor, source)
    assert_same_bits(source.copy_to_host(), expected, nan_bits=exact)


@pytest.mark.parametrize("kind", BFLOAT16_KINDS)
@pytest.mark.parametrize("divisor", [1, 3, 7])
def test_bfloat16_divide_into_is_correctly_rounded(cuda, device, device_mode, nan_bits_kept,
                                                   divisor, kind):
    values = bfloat16_values()
    expected = garbage(values.shape, kernels.BFLOAT16)
    host.divide_into(values, divisor, expected)
    finite = np.isfinite(values.astype(np.float32))
    exact = (values.astype(np.float64) / divisor).astype(np.float32).astype(kernels.BFLOAT16)
    assert_same_bits(expected[finite], exact[finite])
    source = bfloat16_on_device(cuda, device, device_mode, values, kind)
    out = bfloat16_on_device(cuda, device, device_mode, garbage(values.shape, kernels.BFLOAT16),
                             kind)
    kernels.divide_into(source, divisor, out)
    assert_same_bits(out.copy_to_host(), expected, nan_bits=nan_bits_kept)
    kernels.divide_into(source, divisor, source)
    assert_same_bits(source.copy_to_host(), expected, nan_bits=nan_bits_kept)


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.1])
def test_bfloat16_pack_and_unpack_match_host(cuda, device, device_mode, nan_bits_kept, scale):
    rng = np.random.default_rng(4)
    patterns = bfloat_patterns()
    tensors = [patterns[rng.integers(0, patterns.size, int(np.prod(s)))].reshape(s)
               .view(kernels.BFLOAT16) for s in SHAPES]
    layout = FusionLayout.of(tensors)
    expected = garbage(layout.total_size, kernels.BFLOAT16)
    host.pack(layout, tensors, expected, scale)
    buffer = device.empty((layout.total_size,), kernels.BFLOAT16)
    assert isinstance(buffer, device.BfloatDeviceArray)
    kernels.pack(layout, [bfloat16_on_device(cuda, device, device_mode, t, "ringtrain")
                          for t in tensors], buffer, scale)
    assert_same_bits(buffer.copy_to_host(), expected, nan_bits=scale == 1.0 or nan_bits_kept)
    unpacked = [garbage(t.shape, kernels.BFLOAT16) for t in tensors]
    host.unpack(layout, expected, unpacked, scale)
    outputs = [device.empty(t.shape, kernels.BFLOAT16) for t in tensors]
    kernels.unpack(layout, buffer, outputs, scale)
    for output, want in zip(outputs, unpacked):
        assert output.shape == want.shape
        assert_same_bits(output.copy_to_host(), want, nan_bits=scale == 1.0 or nan_bits_kept)


def test_bfloat16_device_arrays(cuda, device):
    values = bfloat16_values()[:12].reshape(3, 4)
    array = device.BfloatDeviceArray(cuda.to_device(values.view(np.uint16)))
    assert (array.shape, array.dtype, array.size, array.ndim, array.nbytes) == \
        ((3, 4), kernels.BFLOAT16, 12, 2, 24)
    face = array.__cuda_array_interface__
    assert face["typestr"] == "bfloat16" and tuple(face["shape"]) == (3, 4)
    assert np.dtype(face["typestr"]) == kernels.BFLOAT16
    assert kernels.twin_for(array) is device and device.dtype_of(array) == kernels.BFLOAT16
    assert_same_bits(array.copy_to_host(), values)
    assert_same_bits(array.reshape(12)[4:8].copy_to_host(), values.reshape(12)[4:8])
    assert device.byte_view(array).size == 24
    for made in (device.empty((5,), kernels.BFLOAT16),
                 device.zeros(None, (5,), kernels.BFLOAT16),
                 kernels.empty_like(array, kernels.BFLOAT16), kernels.zeros_like(array)):
        assert isinstance(made, device.BfloatDeviceArray)
    assert_same_bits(kernels.zeros_like(array).copy_to_host(),
                     np.zeros((3, 4), kernels.BFLOAT16))
    target = device.empty((3, 4), kernels.BFLOAT16)
    target.copy_to_device(values)
    assert_same_bits(target.copy_to_host(), values)


@pytest.mark.parametrize("size", [1, 17, 1001])
@pytest.mark.parametrize("threshold", [0.5, 2.0])
def test_two_bit_quantization_matches_host(cuda, size, threshold):
    rng = np.random.default_rng(size)
    expected_residual = np.zeros(size, np.float32)
    residual = cuda.to_device(expected_residual)
    expected_words = np.empty(words_for(size), np.uint32)
    words = cuda.to_device(garbage(expected_words.size, np.uint32))
    for step in range(3):
        gradient = (rng.standard_normal(size) * threshold).astype(np.float32)
        host.quantize_2bit(gradient, expected_residual, expected_words, threshold)
        kernels.quantize_2bit(cuda.to_device(gradient), residual, words, threshold)
        assert np.array_equal(words.copy_to_host(), expected_words), step
        assert np.array_equal(residual.copy_to_host(), expected_residual), step
        expected = np.empty(size, np.float32)
        host.dequantize_2bit(expected_words, expected, threshold)
        out = cuda.to_device(garbage(size, np.float32))
        kernels.dequantize_2bit(words, out, threshold)
        assert np.array_equal(out.copy_to_host(), expected), step


def test_two_bit_kernels_check_their_arguments(cuda):
    with pytest.raises(ValueError, match="threshold"):
        kernels.dequantize_2bit(cuda.to_device(np.zeros(1, np.uint32)),
                                cuda.to_device(np.zeros(4, np.float32)), 0.0)
    with pytest.raises(ValueError, match="words"):
        kernels.quantize_2bit(cuda.to_device(np.zeros(17, np.float32)),
                              cuda.to_device(np.zeros(17, np.float32)),
                              cuda.to_device(np.zeros(1, np.uint32)), 1.0)


def on_device(cuda, device, values):
    """``values`` copied to a device array (bfloat16 as a BfloatDeviceArray)."""
    if values.dtype != kernels.BFLOAT16:
        return cuda.to_device(values)
    array = device.empty(values.shape, kernels.BFLOAT16)
    if values.size:  # the simulator refuses to copy an empty array's strides
        array.copy_to_device(values)
    return array


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, kernels.BFLOAT16])
@pytest.mark.parametrize("kept_share", [0.0, 0.4, 1.0])
def test_indexed_gather_and_scatter_match_host(cuda, device, dtype, kept_share):
    rng = np.random.default_rng(int(kept_share * 10))
    whole = (rng.standard_normal((20, 15)) * 50).astype(dtype)
    indices = np.flatnonzero(rng.random(whole.size) < kept_share)
    expected = np.empty(indices.size, dtype)
    host.gather_indexed(whole, indices, expected)
    packed = on_device(cuda, device, garbage(indices.size, dtype))
    device_indices = cuda.to_device(indices)
    kernels.gather_indexed(on_device(cuda, device, whole), device_indices, packed)
    assert_same_bits(packed.copy_to_host(), expected)
    expected_whole = garbage(whole.shape, dtype)
    host.scatter_indexed(expected, indices, expected_whole)
    out = on_device(cuda, device, garbage(whole.shape, dtype))
    kernels.scatter_indexed(on_device(cuda, device, expected), device_indices, out)
    assert_same_bits(out.copy_to_host(), expected_whole)


def test_indexed_kernels_check_their_indices(cuda):
    whole = cuda.to_device(np.zeros(9, np.float32))
    packed = cuda.to_device(np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="outside 9 elements"):
        kernels.gather_indexed(whole, cuda.to_device(np.array([0, 9])), packed)
    with pytest.raises(ValueError, match="int64"):
        kernels.scatter_indexed(packed, cuda.to_device(np.array([0, 3], np.int32)), whole)
