"""allreduce and reducescatter with fp16 and bf16 compression, checked against numpy on
any number of ranks.

Run: mpiexec -n K python tests/mpi/compression.py [--only SUBSTRING]
"""

from __future__ import annotations

import warnings

import numpy as np

import ringtrain as rt
from _harness import (Digests, all_inputs, assert_equal_arrays, check, expect_raises, main,
                      make_input, reduce_reference)
from ringtrain.kernels import FP16Compressor

ALGORITHMS = ["ring", "recursive_doubling", "native", "auto"]
COMPRESSORS = {"fp16": rt.Compression.fp16, "bf16": rt.Compression.bf16}
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def shapes() -> list[tuple[int, ...]]:
    k = rt.size()
    return [(0,), (), (1,), (3, 5, 7), (37 * k + 1,), (70_001,)]


def assert_close_to(actual: np.ndarray, inputs: list[np.ndarray], op: rt.ReduceOp,
                    compressor: str, what: str, prescale: float = 1.0,
                    postscale: float = 1.0) -> None:
    """Within the 16-bit format's rounding of the exact result: each input is rounded
    once, each of the k-1 partial sums once more, all relative to the largest input."""
    expected = reduce_reference(inputs, op) * prescale * postscale
    assert actual.dtype == np.float32 and actual.shape == expected.shape, what
    if actual.size == 0:
        return
    k = len(inputs)
    largest = max(float(np.abs(x).max()) for x in inputs) * abs(prescale * postscale)
    bound = 2 * k * UNIT_ROUNDOFF[compressor] * largest * (k if op is rt.Sum else 1)
    error = float(np.abs(actual.astype(np.float64) - expected).max())
    assert error <= bound, f"{what}: error {error:.3g} exceeds {bound:.3g}"


def matrix(compressor: str, algorithm: str, in_place: bool) -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for op in (rt.Average, rt.Sum, rt.Min, rt.Max):
        for shape in shapes():
            x = make_input(me, shape, np.float32, op, "c", compressor)
            inputs = all_inputs(range(k), shape, np.float32, op, "c", compressor)
            what = (f"allreduce{'_' if in_place else ''}(compression={compressor}, "
                    f"algorithm={algorithm}, op={op.name}, shape={shape})")
            if in_place:
                y = x.copy()
                result = rt.allreduce_(y, op, name="c", algorithm=algorithm,
                                       compression=COMPRESSORS[compressor])
                assert result is y, f"{what}: did not return its argument"
            else:
                before = x.copy()
                y = rt.allreduce(x, op, name="c", algorithm=algorithm,
                                 compression=COMPRESSORS[compressor])
                assert_equal_arrays(x, before, f"{what}: input after the call")
            assert_close_to(y, inputs, op, compressor, what)
            if op in (rt.Min, rt.Max) and compressor == "fp16" and y.size:
                # a power-of-two scale keeps the order: the result is an input, rounded
                scale = rt.Compression.fp16.scale_for(max(np.abs(v).max() for v in inputs), k)
                rounded = [(v * scale).astype(np.float16).astype(np.float64) / scale
                           for v in inputs]
                assert np.array_equal(y, reduce_reference(rounded, op)), what
            digests.add(what, y)
    digests.verify()


for _compressor in COMPRESSORS:
    for _algorithm in ALGORITHMS:
        for _in_place in (False, True):
            check(lambda c=_compressor, a=_algorithm, p=_in_place: matrix(c, a, p),
                  name=f"{_compressor}_{_algorithm}_{'in_place' if _in_place else 'out_of_place'}")


@check
def reducescatter_compresses_float32():
    """Each rank's share of the compressed reduction, within the allreduce's bound; the
    result is float32 of the share's shape, torch in, torch out; other dtypes travel as
    they are; a rank compressing where the others do not gets a MismatchError."""
    k, me = rt.size(), rt.rank()
    for compressor in COMPRESSORS:
        for op in (rt.Average, rt.Sum, rt.Max):
            for shape in [(1,), (3 * k + 1, 5), (37 * k + 2,)]:
                x = make_input(me, shape, np.float32, op, "rs", compressor)
                inputs = all_inputs(range(k), shape, np.float32, op, "rs", compressor)
                y = rt.reducescatter(x, op, name="rs", postscale_factor=0.5,
                                     compression=COMPRESSORS[compressor])
                share = [np.array_split(v, k)[me] for v in inputs]
                assert_close_to(y, share, op, compressor,
                                f"reducescatter({compressor}, {op.name}, {shape})",
                                postscale=0.5)
        torch = __import__("torch")
        t = rt.reducescatter_async(torch.ones(2 * k + 1), rt.Sum, name="t",
                                   compression=COMPRESSORS[compressor])
        out = rt.synchronize(t)
        assert isinstance(out, torch.Tensor) and out.dtype == torch.float32, out
        assert torch.equal(out, torch.full_like(out, k)), out
        ints = np.arange(3 * k, dtype=np.int32)
        assert_equal_arrays(rt.reducescatter(ints, rt.Sum, name="i",
                                             compression=COMPRESSORS[compressor]),
                            np.array_split(ints * k, k)[me], "int32 reducescatter")
    if k > 1:
        compression = rt.Compression.fp16 if me == 0 else rt.Compression.none
        expect_raises(rt.MismatchError, rt.reducescatter, np.ones(k, np.float32), name="m",
                      compression=compression, match=["'m'", "compression"])
    assert_equal_arrays(rt.reducescatter(np.ones(k, np.float32), rt.Sum, name="after"),
                        np.full(1, k, np.float32), "a reducescatter after the mismatch")


@check
def scales_are_fused_and_exact_in_average():
    k, me = rt.size(), rt.rank()
    for name, compressor in COMPRESSORS.items():
        x = make_input(me, (1001,), np.float32, rt.Sum, "scaled", name)
        inputs = all_inputs(range(k), (1001,), np.float32, rt.Sum, "scaled", name)
        y = rt.allreduce(x, rt.Sum, name="s", prescale_factor=0.25, postscale_factor=3.0,
                         compression=compressor)
        assert_close_to(y, inputs, rt.Sum, name, "scaled sum", prescale=0.25, postscale=3.0)


@check
def tiny_gradients_are_not_flushed_to_zero():
    """std 1e-7: a plain float16 cast would flush most values; the scale keeps them."""
    k, me = rt.size(), rt.rank()
    g = np.random.default_rng([7, me]).standard_normal(4096).astype(np.float32) * 1e-7
    everyone = [np.random.default_rng([7, r]).standard_normal(4096).astype(np.float32) * 1e-7
                for r in range(k)]
    y = rt.allreduce(g, rt.Sum, name="tiny", compression=rt.Compression.fp16)
    exact = np.sum(np.array(everyone, np.float64), axis=0)
    relative = np.abs(y - exact) / np.abs(exact).max()
    assert relative.max() < 2 * k * 2.0 ** -11, relative.max()
    plain = np.sum([v.astype(np.float16).astype(np.float64) for v in everyone], axis=0)
    assert np.abs(plain - exact).max() / np.abs(exact).max() > 0.01, "the test is too easy"


@check
def large_gradients_do_not_overflow():
    """Values near float32's own range would overflow float16 (max 65504) unscaled."""
    k, me = rt.size(), rt.rank()
    x = np.full(100, 1e30 * (me + 1), np.float32)
    y = rt.allreduce(x, rt.Sum, name="big", compression=rt.Compression.fp16)
    expected = 1e30 * k * (k + 1) / 2
    assert np.isfinite(y).all() and np.allclose(y, expected, rtol=2 * k * 2.0 ** -11), y[:3]


@check
def other_dtypes_travel_uncompressed():
    me = rt.rank()
    for dtype in (np.float64, np.float16, np.int32):
        op = rt.Sum
        x = make_input(me, (37,), dtype, op, "passthrough")
        plain = rt.allreduce(x, op, name="p")
        compressed = rt.allreduce(x, op, name="p", compression=rt.Compression.fp16)
        assert_equal_arrays(compressed, plain, f"{np.dtype(dtype).name} with fp16 compression")


@check
def product_is_refused_with_compression():
    x = np.ones(4, np.float32)
    expect_raises(rt.InvalidArgumentError, rt.allreduce, x, rt.Product, name="prod",
                  compression=rt.Compression.fp16, match=["'prod'", "Product", "fp16"])
    expect_raises(rt.InvalidArgumentError, rt.allreduce, x, name="bad", compression="fp16",
                  match=["'bad'", "compression"])


@check
def grouped_allreduce_compresses_float32_members():
    k, me = rt.size(), rt.rank()
    shapes_ = [(10,), (0,), (3, 4), (257,)]
    for name, compressor in COMPRESSORS.items():
        xs = [make_input(me, s, np.float32, rt.Average, "g", i) for i, s in enumerate(shapes_)]
        xs.append(np.arange(5, dtype=np.int64) + me)
        outs = rt.grouped_allreduce(xs, rt.Sum, name="g", compression=compressor)
        for i, s in enumerate(shapes_):
            inputs = [make_input(r, s, np.float32, rt.Average, "g", i) for r in range(k)]
            assert_close_to(outs[i], inputs, rt.Sum, name, f"grouped member {i}")
        assert np.array_equal(outs[-1], np.arange(5) * k + k * (k - 1) // 2)
        in_place = [x.copy() for x in xs]
        returned = rt.grouped_allreduce_(in_place, rt.Sum, name="g", compression=compressor)
        assert all(a is b for a, b in zip(returned, in_place))
        for a, b in zip(in_place, outs):
            assert_equal_arrays(a, b, "grouped in place vs out of place")


@check
def async_forms_compress_too():
    k, me = rt.size(), rt.rank()
    x = make_input(me, (1000,), np.float32, rt.Average, "async")
    inputs = all_inputs(range(k), (1000,), np.float32, rt.Average, "async")
    handle = rt.allreduce_async(x, name="a", compression=rt.Compression.fp16)
    y = x.copy()
    handle_ = rt.allreduce_async_(y, name="a_", compression=rt.Compression.bf16)
    assert_close_to(rt.synchronize(handle), inputs, rt.Average, "fp16", "async")
    rt.synchronize(handle_)
    assert_close_to(y, inputs, rt.Average, "bf16", "async in place")


@check
def inf_and_nan_pass_through_and_are_reported_by_rank():
    k, me = rt.size(), rt.rank()
    x = np.ones(50, np.float32)
    if me == k - 1:
        x[7] = np.inf
        x[9] = np.nan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = rt.allreduce(x, rt.Sum, name="grads", compression=rt.Compression.fp16)
    assert y[7] == np.inf and np.isnan(y[9]), y[:10]
    assert np.all(np.delete(y, [7, 9]) == k), "finite values were disturbed"
    messages = [str(w.message) for w in caught if issubclass(w.category, rt.NonFiniteWarning)]
    if me == k - 1:
        assert len(messages) == 1 and f"rank {k - 1}" in messages[0] \
            and "'grads'" in messages[0], messages
    else:
        assert not messages, messages


@check
def error_feedback_keeps_the_long_run_sum_unbiased():
    """Rank 0 adds the same vector many times, the others add zeros (so the reduction
    itself is exact): without feedback the cast's rounding error adds up step after
    step; with it, the total stays within one step's rounding."""
    values = (np.linspace(-1.0, 1.0, 333) / 3.0).astype(np.float32)
    base = values if rt.rank() == 0 else np.zeros_like(values)
    steps = 64
    plain_total = np.zeros(base.size, np.float64)
    feedback_total = np.zeros(base.size, np.float64)
    feedback = FP16Compressor(error_feedback=True)
    for _ in range(steps):
        plain_total += rt.allreduce(base, rt.Sum, name="ef", compression=rt.Compression.fp16)
        feedback_total += rt.allreduce(base, rt.Sum, name="ef", compression=feedback)
    exact = steps * values.astype(np.float64)
    plain_error = np.abs(plain_total - exact).max()
    feedback_error = np.abs(feedback_total - exact).max()
    assert plain_error > 8 * 2.0 ** -12, plain_error
    assert feedback_error <= 2.0 ** -11, (feedback_error, plain_error)
    assert feedback.residual("ef") is not None and rt.Compression.fp16.residual("ef") is None
    expect_raises(rt.InvalidArgumentError, rt.allreduce, base, name=None,
                  compression=feedback, match=["error feedback", "name"])


if __name__ == "__main__":
    main()
