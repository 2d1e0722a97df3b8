"""allreduce in all its forms, checked against numpy on any number of ranks.

Run: mpiexec -n K python tests/mpi/allreduce.py [--only SUBSTRING]
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import ml_dtypes
import numpy as np

import ringtrain as rt
from ringtrain.kernels import bits, is_floating
from ringtrain.collectives.agreement._agreement import buffers_of
from ringtrain.collectives.transport._mailboxes import mailboxes_of
from ringtrain.collectives.engine import allreduce_plan, reduce_planned
from ringtrain.collectives.algorithms import _compiled_ring, _data_phase, _native, _ring
from ringtrain.collectives.algorithms._ring import allreduce as python_ring
from ringtrain.collectives.timeline import rank_path
from ringtrain.collectives.transport import _recursive_doubling
from ringtrain.collectives.world._world import world
from _harness import (FLOAT_DTYPES, INT_DTYPES, OPS, REDUCE_DTYPES, WORLD, Digests,
                      adasum_reference, all_inputs, assert_equal_arrays, assert_reduced, check,
                      configured, declined, expect_raises, main, make_input,
                      noncontiguous_views, reduce_reference, refused, replaced, rng)

ALGORITHMS = ["ring", "recursive_doubling", "native", "auto"]
OWN_ALGORITHMS = ["ring", "recursive_doubling", "auto"]  # ringtrain's own: bit-identical


def shapes() -> list[tuple[int, ...]]:
    """0-d, empty, one element, a prime, multi-dim, and a count not divisible by K."""
    k = rt.size()
    return [(0,), (), (1,), (13,), (3, 5, 7), (37 * k + 1,), (2, 0, 3)]


def integer_average_refused(x: np.ndarray, algorithm: str, function=rt.allreduce) -> None:
    error = expect_raises(rt.InvalidArgumentError, function, x, rt.Average, name="ints",
                          algorithm=algorithm, match=["'ints'", "Average"])
    assert isinstance(error, ValueError)


def label(function: str, algorithm: str, op, dtype, shape, extra: str = "") -> str:
    return (f"{function}(algorithm={algorithm}, op={op.name}, dtype={np.dtype(dtype).name}, "
            f"shape={shape}{extra})")


def out_of_place_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            for shape in shapes():
                x = make_input(me, shape, dtype, op, "oop")
                if op is rt.Average and dtype.kind in "iu":
                    integer_average_refused(x, algorithm)
                    continue
                before = x.copy()
                what = label("allreduce", algorithm, op, dtype, shape)
                y = rt.allreduce(x, op, name="t", algorithm=algorithm)
                expected = reduce_reference(all_inputs(range(k), shape, dtype, op, "oop"), op)
                assert_reduced(y, expected, dtype, what)
                assert y is not x and not np.shares_memory(y, x), f"{what}: result aliases input"
                assert_equal_arrays(x, before, f"{what}: input after the call")
                if algorithm != "native":
                    digests.add(what, y)
    digests.verify()


def in_place_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            if op is rt.Average and dtype.kind in "iu":
                integer_average_refused(make_input(me, (3,), dtype, op, "ip"), algorithm,
                                        rt.allreduce_)
                continue
            for shape in [(), (0,), (13,), (3, 5, 7), (37 * k + 1,)]:
                x = make_input(me, shape, dtype, op, "ip")
                what = label("allreduce_", algorithm, op, dtype, shape)
                returned = rt.allreduce_(x, op, name="t", algorithm=algorithm)
                assert returned is x, f"{what}: did not return its argument"
                expected = reduce_reference(all_inputs(range(k), shape, dtype, op, "ip"), op)
                assert_reduced(x, expected, dtype, what)
                if algorithm != "native":
                    digests.add(what, x)
    digests.verify()


def noncontiguous_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            if op is rt.Average and dtype.kind in "iu":
                continue
            references = [noncontiguous_views(dtype, op, r, "nc") for r in range(k)]
            # out of place: the view is read, never written
            for index, view in enumerate(noncontiguous_views(dtype, op, me, "nc")):
                what = label("allreduce", algorithm, op, dtype, view.shape, " non-contiguous")
                before = view.base.copy()
                y = rt.allreduce(view, op, algorithm=algorithm)
                expected = reduce_reference([refs[index] for refs in references], op)
                assert_reduced(y, expected, dtype, what)
                assert y.flags.c_contiguous or y.ndim == 0
                assert_equal_arrays(view.base, before, f"{what}: input after the call")
            # in place: the result lands in the view; the rest of the base is untouched
            for index, view in enumerate(noncontiguous_views(dtype, op, me, "nc")):
                what = label("allreduce_", algorithm, op, dtype, view.shape, " non-contiguous")
                base = view.base
                outside = np.ones(base.shape, bool)
                outside[tuple(_view_index(index))] = False
                untouched = base[outside].copy()
                returned = rt.allreduce_(view, op, algorithm=algorithm)
                assert returned is view, f"{what}: did not return its argument"
                expected = reduce_reference([refs[index] for refs in references], op)
                assert_reduced(view, expected, dtype, what)
                assert_equal_arrays(base[outside], untouched, f"{what}: elements outside the view")
            # asynchronous and in place: the result is written back when the handle completes
            if dtype.kind == "f" or op is rt.Sum:
                views = noncontiguous_views(dtype, op, me, "nc")
                handles = [rt.allreduce_async_(v, op, algorithm=algorithm) for v in views]
                for index, (view, handle) in enumerate(zip(views, handles)):
                    what = label("allreduce_async_", algorithm, op, dtype, view.shape,
                                 " non-contiguous")
                    assert rt.synchronize(handle) is view, f"{what}: did not return its argument"
                    expected = reduce_reference([refs[index] for refs in references], op)
                    assert_reduced(view, expected, dtype, what)


def _view_index(index: int):
    """The index expression of view ``index`` of noncontiguous_views, into its base."""
    return [(slice(None, None, 2),), (slice(None), slice(None)),
            (slice(1, None), slice(None, None, 2))][index]


def async_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    pending = []
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            if op is rt.Average and dtype.kind in "iu":
                continue
            shape = (3, 5) if dtype.kind == "f" else (13,)
            a = make_input(me, shape, dtype, op, "async", "a")
            b = make_input(me, shape, dtype, op, "async", "b")
            ha = rt.allreduce_async(a, op, name=f"a.{dtype}.{op.name}", algorithm=algorithm)
            hb = rt.allreduce_async_(b, op, name=f"b.{dtype}.{op.name}", algorithm=algorithm)
            pending.append((dtype, op, shape, a.copy(), ha, b, hb))
    for dtype, op, shape, a_before, ha, b, hb in pending:
        what = label("allreduce_async", algorithm, op, dtype, shape)
        ea = reduce_reference(all_inputs(range(k), shape, dtype, op, "async", "a"), op)
        eb = reduce_reference(all_inputs(range(k), shape, dtype, op, "async", "b"), op)
        ya = rt.synchronize(ha)
        assert_reduced(ya, ea, dtype, what)
        assert rt.poll(ha)
        yb = rt.synchronize(hb)
        assert yb is b, f"{what}: allreduce_async_ did not return its argument"
        assert_reduced(b, eb, dtype, what + " in place")
        if algorithm != "native":
            digests.add(what, ya)
            digests.add(what + "_", yb)
    digests.verify()


def grouped_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    shape_cycle = [(13,), (), (3, 5, 7), (0,), (37 * k + 1,), (2, 3), (1,)]
    for op in OPS:
        dtypes = FLOAT_DTYPES if op is rt.Average else REDUCE_DTYPES
        specs = [(dtype, shape_cycle[i % len(shape_cycle)]) for i, dtype in enumerate(dtypes)]
        # a second tensor of the first dtype, so one dtype fuses several arrays
        specs.append((dtypes[0], (4, 2)))
        specs.append((dtypes[-1], (5,)))

        def inputs(rank, tag):
            return [make_input(rank, shape, dtype, op, "grouped", tag, i)
                    for i, (dtype, shape) in enumerate(specs)]

        expected = [reduce_reference(list(column), op)
                    for column in zip(*[inputs(r, "g") for r in range(k)])]
        for form in ("grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
                     "grouped_allreduce_async_"):
            tensors = inputs(me, "g")
            befores = [t.copy() for t in tensors]
            result = getattr(rt, form)(tensors, op, name="group", algorithm=algorithm)
            if "async" in form:
                result = rt.synchronize(result)
            assert isinstance(result, list) and len(result) == len(tensors), form
            for i, ((dtype, shape), got, want) in enumerate(zip(specs, result, expected)):
                what = label(form, algorithm, op, dtype, shape, f" tensor {i}")
                assert_reduced(got, want, dtype, what)
                if form.endswith("_"):
                    assert got is tensors[i], f"{what}: in-place form returned a new array"
                else:
                    assert not np.shares_memory(got, tensors[i])
                    assert_equal_arrays(tensors[i], befores[i], f"{what}: input after the call")
                if algorithm != "native":
                    digests.add(what, got)
        # a group with a non-contiguous member, in place
        base = make_input(me, (26,), np.float64 if op is not rt.Average else np.float32, op,
                          "grouped-nc")
        view = base[::2]
        other = make_input(me, (7,), np.float64, op, "grouped-nc2")
        rt.grouped_allreduce_([view, other], op, algorithm=algorithm)
        exp_view = reduce_reference([make_input(r, (26,), base.dtype, op, "grouped-nc")[::2]
                                     for r in range(k)], op)
        exp_other = reduce_reference(all_inputs(range(k), (7,), np.float64, op, "grouped-nc2"),
                                     op)
        assert_reduced(view, exp_view, base.dtype, f"grouped_allreduce_ non-contiguous {op.name}")
        assert_reduced(other, exp_other, np.float64, f"grouped_allreduce_ {op.name}")
    assert rt.grouped_allreduce([], rt.Sum, algorithm=algorithm) == []
    digests.verify()


def scaled_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for dtype in FLOAT_DTYPES:
        for op in OPS:
            for prescale, postscale in [(0.5, 3.0), (2.0, 1.0), (1.0, 0.25)]:
                for shape in [(13,), (), (37 * k + 1,)]:
                    key = ("scaled", prescale, postscale)
                    expected = reduce_reference(all_inputs(range(k), shape, dtype, op, *key), op,
                                                prescale, postscale)
                    x = make_input(me, shape, dtype, op, *key)
                    before = x.copy()
                    what = label("allreduce", algorithm, op, dtype, shape,
                                 f", prescale={prescale}, postscale={postscale}")
                    y = rt.allreduce(x, op, prescale_factor=prescale, postscale_factor=postscale,
                                     algorithm=algorithm)
                    assert_reduced(y, expected, dtype, what)
                    assert_equal_arrays(x, before, f"{what}: input after the call")
                    rt.allreduce_(x, op, prescale_factor=prescale, postscale_factor=postscale,
                                  algorithm=algorithm)
                    assert_reduced(x, expected, dtype, what + " in place")
                    if algorithm != "native":
                        digests.add(what, y)
                        digests.add(what + " in place", x)
    # grouped, with scales
    tensors = [make_input(me, (11,), d, rt.Sum, "gscaled") for d in FLOAT_DTYPES]
    result = rt.grouped_allreduce(tensors, rt.Average, prescale_factor=0.5, postscale_factor=4.0,
                                  algorithm=algorithm)
    for d, got in zip(FLOAT_DTYPES, result):
        want = reduce_reference(all_inputs(range(k), (11,), d, rt.Sum, "gscaled"), rt.Average,
                                0.5, 4.0)
        assert_reduced(got, want, d, f"grouped_allreduce scaled {d}")
    # scale factors on integers are refused before any communication
    for dtype in (np.int32, np.uint8):
        expect_raises(rt.InvalidArgumentError, rt.allreduce, np.ones(3, dtype), rt.Sum,
                      name="iscale", prescale_factor=2.0, algorithm=algorithm, match=["'iscale'"])
        expect_raises(rt.InvalidArgumentError, rt.allreduce_, np.ones(3, dtype), rt.Sum,
                      name="iscale", postscale_factor=0.5, algorithm=algorithm,
                      match=["'iscale'"])
    digests.verify()


for _algorithm in ALGORITHMS:
    check(name=f"allreduce out of place, every op x dtype x shape, algorithm={_algorithm}")(
        lambda a=_algorithm: out_of_place_matrix(a))
    check(name=f"allreduce_ in place, every op x dtype, algorithm={_algorithm}")(
        lambda a=_algorithm: in_place_matrix(a))
    check(name=f"allreduce non-contiguous inputs, both modes, algorithm={_algorithm}")(
        lambda a=_algorithm: noncontiguous_matrix(a))
    check(name=f"allreduce_async / allreduce_async_, algorithm={_algorithm}")(
        lambda a=_algorithm: async_matrix(a))
    check(name=f"grouped_allreduce (all four forms, mixed dtypes), algorithm={_algorithm}")(
        lambda a=_algorithm: grouped_matrix(a))
    check(name=f"allreduce prescale/postscale, algorithm={_algorithm}")(
        lambda a=_algorithm: scaled_matrix(a))


@check
def op_names_and_default_op():
    k, me = rt.size(), rt.rank()
    for text, op in [("sum", rt.Sum), ("Average", rt.Average), ("MIN", rt.Min), ("max", rt.Max),
                     ("product", rt.Product)]:
        x = make_input(me, (6,), np.float64, op, "names")
        y = rt.allreduce(x, text)
        expected = reduce_reference(all_inputs(range(k), (6,), np.float64, op, "names"), op)
        assert_reduced(y, expected, np.float64, f"allreduce(op={text!r})")
    x = make_input(me, (9,), np.float32, rt.Average, "default")
    y = rt.allreduce(x)  # Average is the default
    expected = reduce_reference(all_inputs(range(k), (9,), np.float32, rt.Average, "default"),
                                rt.Average)
    assert_reduced(y, expected, np.float32, "allreduce default op")
    y = rt.allreduce([1.0, 2.0, float(me)], rt.Sum)  # array-likes are accepted
    assert_reduced(y, np.array([k, 2.0 * k, k * (k - 1) / 2]), np.float64, "allreduce(list)")


@check
def one_million_float32_elements():
    """The ring over a ~1M-element array (several segments per chunk), a few calls only."""
    k, me = rt.size(), rt.rank()
    n = (1 << 20) + 3
    inputs = [make_input(r, (n,), np.float32, rt.Sum, "big") for r in range(k)]
    x = inputs[me]
    reference = reduce_reference(inputs, rt.Sum)
    digests = Digests()
    y = rt.allreduce(x, rt.Sum, algorithm="ring")
    assert_reduced(y, reference, np.float32, "allreduce 1M ring Sum")
    digests.add("ring Sum", y)
    native = rt.allreduce(x, rt.Sum, algorithm="native")
    assert np.allclose(y, native, rtol=2e-5, atol=1e-5), "ring and native differ on 1M elements"
    z = x.copy()
    rt.allreduce_(z, rt.Average, algorithm="auto")
    assert_reduced(z, reference / k, np.float32, "allreduce_ 1M auto Average")
    digests.add("auto Average in place", z)
    if k <= 2:
        for op in (rt.Max, rt.Product):
            y = rt.allreduce(make_input(me, (n,), np.float32, op, "big"), op, algorithm="ring")
            expected = reduce_reference([make_input(r, (n,), np.float32, op, "big")
                                         for r in range(k)], op)
            assert_reduced(y, expected, np.float32, f"allreduce 1M ring {op.name}")
            digests.add(op.name, y)
    digests.verify()


@check
def recursive_doubling_in_segments():
    """Arrays far beyond the small-message path take the segmented recursive doubling."""
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for n, segment in [((1 << 18) + 3, None), (300_001, 64 * 1024)]:
        settings = {} if segment is None else {"segment_bytes": segment}
        with configured(**settings):
            for op in (rt.Sum, rt.Average, rt.Max):
                inputs = [make_input(r, (n,), np.float32, op, "rdbig") for r in range(k)]
                what = f"allreduce recursive_doubling n={n} segment={segment} op={op.name}"
                y = rt.allreduce(inputs[me], op, algorithm="recursive_doubling")
                assert_reduced(y, reduce_reference(inputs, op), np.float32, what)
                digests.add(what, y)
                if op is rt.Sum:
                    x = inputs[me].copy()
                    rt.allreduce_(x, op, algorithm="recursive_doubling")
                    assert_reduced(x, reduce_reference(inputs, op), np.float32,
                                   what + " in place")
                    digests.add(what + " in place", x)
    digests.verify()


@check
def ring_with_tiny_segments():
    """segment_bytes=64: many segments per chunk, chunks with different segment counts."""
    k, me = rt.size(), rt.rank()
    digests = Digests()
    with configured(segment_bytes=64):
        for dtype in (np.float64, np.float16, np.int32, np.uint8):
            per_segment = 64 // np.dtype(dtype).itemsize
            for n in [per_segment * k + 1, 3 * per_segment * k - 1, k - 1, 1]:
                for op in OPS:
                    if op is rt.Average and np.dtype(dtype).kind in "iu":
                        continue
                    inputs = all_inputs(range(k), (n,), dtype, op, "tiny")
                    expected = reduce_reference(inputs, op)
                    what = label("allreduce", "ring", op, dtype, (n,), ", segment_bytes=64")
                    y = rt.allreduce(inputs[me], op, algorithm="ring")
                    assert_reduced(y, expected, dtype, what)
                    digests.add(what, y)
                    x = inputs[me].copy()
                    rt.allreduce_(x, op, algorithm="ring", postscale_factor=1.0)
                    assert_reduced(x, expected, dtype, what + " in place")
                    digests.add(what + " in place", x)
    digests.verify()


@check
def bit_identical_on_every_rank():
    """Random float data with a wide range, where the order of additions changes the bits."""
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for dtype in FLOAT_DTYPES:
        for n in [13, 1000 * k + 3, 3 * 5 * 7]:
            g = rng(me, "bits", n, np.dtype(dtype).str)
            x = (g.standard_normal(n) * np.exp(g.uniform(-6, 6, n))).astype(dtype)
            if dtype == np.float16:
                x = np.clip(x, -1000, 1000).astype(dtype)
            for algorithm in OWN_ALGORITHMS:
                for op in (rt.Sum, rt.Average, rt.Product):
                    data = x if op is not rt.Product else (1 + x / 1e4).astype(dtype)
                    y = rt.allreduce(data, op, algorithm=algorithm)
                    digests.add(f"{algorithm} {op.name} {np.dtype(dtype).name} n={n}", y)
                    z = data.copy()
                    rt.allreduce_(z, op, algorithm=algorithm)
                    digests.add(f"{algorithm} {op.name} {np.dtype(dtype).name} n={n} in place", z)
    digests.verify()


@check
def every_algorithm_agrees_with_native():
    k, me = rt.size(), rt.rank()
    for dtype in REDUCE_DTYPES:
        for op in OPS:
            if op is rt.Average and dtype.kind in "iu":
                continue
            for shape in [(13,), (37 * k + 1,), (2, 3, 4)]:
                x = make_input(me, shape, dtype, op, "diff")
                native = rt.allreduce(x, op, algorithm="native")
                for algorithm in OWN_ALGORITHMS:
                    y = rt.allreduce(x, op, algorithm=algorithm)
                    what = label("allreduce", algorithm, op, dtype, shape, " vs native")
                    assert_reduced(y, native.astype(np.float64 if dtype.kind == "f"
                                                    else np.int64), dtype, what)


# --------------------------------------------------------------------------- exchange

EXCHANGE_OPS = [rt.Sum, rt.Min, rt.Max, rt.Product]


@contextlib.contextmanager
def python_exchange(on_this_rank: bool = True):
    """The agreement's exchange in Python on this rank for the block, if asked; the
    compiled one otherwise (see collectives/transport/_compiled_exchange.py)."""
    buffers = buffers_of(world().group)
    compiled = buffers.compiled
    assert compiled is not None, "the compiled exchange is off"
    if on_this_rank:
        buffers.compiled = None
    try:
        yield
    finally:
        buffers.compiled = compiled


def special_input(rank: int, dtype: np.dtype, op) -> np.ndarray:
    """Values that test a combining step's edges: infinities, NaN, overflow, wraparound
    of integers, and small exact values that vary with the rank."""
    if dtype.kind == "f":
        big = np.finfo(dtype).max
        values = [np.inf, -np.inf, np.nan if rank % 2 == 0 else 2.0, big, 0.5 * rank - 1,
                  1.0 + rank, -2.0, 0.25]
        if op is rt.Product:
            values[3] = big if rank % 2 else 2.0
        return np.array(values, dtype)
    info = np.iinfo(dtype)
    return np.array([info.max, info.min, info.max - rank, (rank + 1) % 3, 3 + rank, -1 if
                     info.min else 1, rank % 2, 7], dtype)


def combined_in_rank_order(inputs: list[np.ndarray], op) -> np.ndarray:
    """numpy's own combination of the ranks' inputs, left to right in their dtype."""
    function = {rt.Sum: np.add, rt.Min: np.minimum, rt.Max: np.maximum,
                rt.Product: np.multiply}[op]
    result = inputs[0].copy()
    for x in inputs[1:]:
        with np.errstate(all="ignore"):
            function(result, x, out=result)
    return result


@check
def compiled_and_python_exchanges_agree_with_numpy():
    """Small allreduces ride in the agreement's exchange: the compiled one, the Python
    one, and ranks mixing the two all give numpy's values (NaN where numpy has NaN, the
    same infinities, integers wrapped as numpy wraps them), bit-identical on every rank;
    gathers and alltoalls, small and large, arrive whole either way."""
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for form, python_here in [("compiled", False), ("python", True),
                              ("mixed", me % 2 == 1)]:
        with python_exchange(python_here):
            for dtype in REDUCE_DTYPES:
                for op in EXCHANGE_OPS:
                    inputs = [special_input(r, dtype, op) for r in range(k)]
                    expected = combined_in_rank_order(inputs, op)
                    got = rt.allreduce(inputs[me], op, name=f"special {form}")
                    what = f"{form} exchange, {op.name} of {dtype.name}"
                    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
                    if dtype.kind == "f" and dtype.itemsize > 2:
                        assert np.array_equal(got, expected, equal_nan=True), \
                            f"{what}: got {got}, numpy gives {expected}"
                    elif dtype.kind in "iu":
                        assert np.array_equal(got, expected), \
                            f"{what}: got {got}, numpy gives {expected}"
                    digests.add(what, got)
            gathered = rt.allgather(np.full(3, me, np.int16), name=f"gathered {form}")
            assert np.array_equal(gathered, np.repeat(np.arange(k, dtype=np.int16), 3))
            # rows too large to ride: MPI's own allgather and alltoall, in the compiled
            # call where it runs, after the check and mpi4py's call where it does not
            gathered = rt.allgather(np.full((50000, 3), me, np.int16), name=f"rows {form}")
            assert np.array_equal(gathered, np.repeat(np.arange(k, dtype=np.int16),
                                                      50000)[:, None].repeat(3, axis=1))
            received, splits = rt.alltoall(np.full((20000 * k, 2), me, np.int32),
                                           name=f"blocks {form}")
            assert np.array_equal(received, np.repeat(np.arange(k, dtype=np.int32),
                                                      20000)[:, None].repeat(2, axis=1))
            assert splits.tolist() == [20000] * k
            for count in (5, 8192):  # 64 KiB ride too, through the node's mailboxes
                sent = rt.broadcast(np.arange(count, dtype=np.float64) + me, k - 1,
                                    name=f"broadcast {form}")
                assert np.array_equal(sent, np.arange(count, dtype=np.float64) + k - 1)
            if k > 1:
                shape = (4,) if me == k - 1 else (3,)
                expect_raises(rt.MismatchError, rt.allreduce, np.ones(shape),
                              match=("shape",), name=f"mismatch {form}")
    digests.verify()


@check
def small_allreduces_scale_alike_in_both_exchanges():
    """The compiled small allreduce (fill, exchange and finish in one call) scales as the
    Python steps do: the same bits for prescale, Average's division and postscale, also
    for a plan run with another prescale factor (as the gradient reducer runs its
    plans), and for ranks mixing the two."""
    k, me = rt.size(), rt.rank()
    for dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        x = (rng(me, f"scales {dtype.name}").standard_normal(29) * 3).astype(dtype)
        results = {}
        for form, python_here in [("compiled", False), ("python", True),
                                  ("mixed", me % 2 == 1)]:
            with python_exchange(python_here):
                name = f"scaled {form} {dtype.name}"
                results[form] = rt.allreduce(x, rt.Average, name=name, prescale_factor=0.3,
                                             postscale_factor=1.7)
                plan = allreduce_plan(x, rt.Sum, name, 1.0, 1.0, None, None,
                                      rt.Compression.none, "allreduce")
                assert plan.carried is not None, f"{name}: not carried"
                flat = x.copy()
                reduce_planned(plan, "allreduce", name, flat, flat, 0.5, 1.0)
                results[form + " prescaled plan"] = flat
        for form in ("python", "mixed"):
            for suffix in ("", " prescaled plan"):
                assert_equal_arrays(results[form + suffix], results["compiled" + suffix],
                                    f"{dtype.name}: {form}{suffix} against compiled")
        everyone = np.stack([(rng(r, f"scales {dtype.name}").standard_normal(29) * 3)
                             .astype(dtype) for r in range(k)])
        tolerance = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(results["compiled"],
                                   (everyone * 0.3).sum(0) / k * 1.7, rtol=tolerance,
                                   atol=tolerance, err_msg=dtype.name)
        np.testing.assert_allclose(results["compiled prescaled plan"],
                                   (everyone * 0.5).sum(0), rtol=tolerance, atol=tolerance,
                                   err_msg=dtype.name)


SHARED_MEMORY = "RINGTRAIN_AGREEMENT_SHARED_MEMORY"


@check
def native_allreduces_check_and_reduce_in_one_compiled_call():
    """MPI's own allreduce of host arrays of MPI's own datatypes runs in the agreement's
    compiled call on more than one rank, in place (``MPI_IN_PLACE``) and out of place;
    16-bit floats, whose reduction is ringtrain's own MPI op, take the Python path."""
    k, rank = rt.size(), rt.rank()
    for dtype in (np.float32, np.float64, np.int8, np.int16, np.int64):
        inputs = [np.arange(37 * k + 1).astype(dtype) + dtype(r) for r in range(k)]
        x = inputs[rank]
        plan = allreduce_plan(x, rt.Max, "checked", 1.0, 1.0, None, "native",
                              rt.Compression.none, "allreduce")
        assert (plan.checked is not None) == (k > 1), f"{dtype.__name__}: compiled call?"
        expected = np.maximum.reduce(inputs)
        assert_equal_arrays(rt.allreduce(x, rt.Max, name="checked", algorithm="native"),
                            expected, f"out of place {dtype.__name__}")
        y = x.copy()
        assert rt.allreduce_(y, rt.Max, name="checked", algorithm="native") is y
        assert_equal_arrays(y, expected, f"in place {dtype.__name__}")
    for dtype in (np.float16, ml_dtypes.bfloat16):
        plan = allreduce_plan(np.zeros(5, dtype), rt.Sum, None, 1.0, 1.0, None, "native",
                              rt.Compression.none, "allreduce")
        assert plan.checked is None, f"{np.dtype(dtype).name} in the compiled call"


@check
def ring_allreduces_run_in_compiled_calls():
    """The ring of host arrays of every dtype the compiled exchange combines (the 16-bit
    floats as their bits) runs in compiled code, checked in the same call (a plain call)
    or after the agreement (a prescaled one), and gives the Python ring's bits: uneven
    chunks, several segments, chunks with nothing in them, in place and out of place,
    every op, scaled."""
    k, me = rt.size(), rt.rank()
    group = world().group
    with configured(segment_bytes=64):
        for dtype in (np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32,
                      np.int64, np.float16, ml_dtypes.bfloat16):
            floating = is_floating(dtype)
            for n in (k - 1, 3 * (64 // np.dtype(dtype).itemsize) * k + 5):
                for op in OPS:
                    if op is rt.Average and not floating:
                        continue
                    inputs = all_inputs(range(k), (n,), dtype, op, "compiled ring")
                    plan = allreduce_plan(inputs[me], op, None, 1.0, 1.0, None, "ring",
                                          rt.Compression.none, "allreduce")
                    what = label("allreduce", "ring", op, dtype, (n,))
                    assert (plan.checked is not None) == (k > 1), f"{what}: compiled call?"
                    python = np.empty_like(inputs[me])
                    if k > 1:
                        python_ring(group, bits(inputs[me]), bits(python), plan.combine,
                                    plan.finish, 64)
                    else:
                        python[...] = inputs[me]
                    assert_equal_arrays(rt.allreduce(inputs[me], op, algorithm="ring"),
                                        python, what)
                    x = inputs[me].copy()
                    rt.allreduce_(x, op, algorithm="ring")
                    assert_equal_arrays(x, python, what + " in place")
                    if floating:  # the Python path up to the data phase, then compiled
                        rings = len(group.state.get("compiled rings", ()))
                        halves = (inputs[me] / 2).astype(dtype)
                        prescaled = rt.allreduce(halves, op, algorithm="ring",
                                                 prescale_factor=2.0)
                        assert_equal_arrays(prescaled, python, what + " prescaled")
                        assert len(group.state.get("compiled rings", ())) == rings + (k > 1), \
                            f"{what}: prescaled, not compiled"


@check(min_size=2)
def compressed_ring_allreduces_run_in_compiled_calls():
    """A compressed ring allreduce reduces its 16-bit wire in compiled code, with the
    bits the Python ring gives."""
    k, me = rt.size(), rt.rank()
    group = world().group
    x = make_input(me, (3 * 32 * k + 5,), np.float32, rt.Average, "compressed ring")
    with configured(segment_bytes=64):
        for compression in (rt.Compression.fp16, rt.Compression.bf16):
            rings = len(group.state.get("compiled rings", ()))
            compiled = rt.allreduce(x, rt.Average, algorithm="ring", compression=compression)
            assert len(group.state.get("compiled rings", ())) == rings + 1, \
                f"{compression.name}: not compiled"
            with replaced(_compiled_ring, "ring_allreduce", declined):
                python = rt.allreduce(x, rt.Average, algorithm="ring", compression=compression)
            assert_equal_arrays(compiled, python, f"{compression.name} compressed ring")


@check(min_size=2)
def recursive_doubling_past_the_payload_runs_in_a_compiled_call():
    """An allreduce by recursive doubling too large to ride in the agreement reduces its
    data after the check in one compiled call (segment by segment, through MPI), never
    the Python steps, with their bits: every op, 16-bit floats and integers, in place and
    out of place."""
    me = rt.rank()
    with configured(segment_bytes=4096):
        for dtype in (np.float32, np.float64, np.int32, np.float16, ml_dtypes.bfloat16):
            for op in OPS:
                if op is rt.Average and not is_floating(dtype):
                    continue
                x = make_input(me, (70_001,), dtype, op, "past the payload")
                what = label("allreduce", "recursive_doubling", op, dtype, x.shape)
                in_place = x.copy()
                with replaced(_recursive_doubling, "allreduce", refused):
                    compiled = rt.allreduce(x, op, algorithm="recursive_doubling", name=what)
                    rt.allreduce_(in_place, op, algorithm="recursive_doubling", name=what)
                with replaced(_data_phase, "reduce_by_recursive_doubling", declined):
                    python = rt.allreduce(x, op, algorithm="recursive_doubling", name=what)
                assert_equal_arrays(compiled, python, what)
                assert_equal_arrays(in_place, python, what + " in place")


@check(min_size=2)
def traced_calls_take_the_route_of_untraced_ones():
    """With a timeline on, each collective that the agreement's compiled call makes
    (the ring, and MPI's own allreduce, broadcast, reduce-scatter, allgather and
    alltoall) takes that same call (the Python data phases are never entered) and
    records its phases from the times the compiled call took: the check's end is the
    data phase's start, to the nanosecond."""
    k, me = rt.size(), rt.rank()
    rows = 4 * k  # even shares: MPI's reduce-scatter and alltoall of one block size
    x = np.arange(rows * 9_000, dtype=np.float32).reshape(rows, -1) * (me + 1)  # 144+ KiB
    total = np.arange(x.size, dtype=np.float32).reshape(x.shape) * (k * (k + 1) // 2)
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(rows), k)])
    every = np.concatenate([x / (me + 1) * (r + 1) for r in range(k)])
    mine = np.concatenate([every[r * rows:(r + 1) * rows][bounds[me]:bounds[me + 1]]
                           for r in range(k)])
    calls = {  # by the data phases they record (the rows' way is the tuning table's)
        ("reduce-scatter",): lambda: assert_equal_arrays(
            rt.allreduce(x, rt.Sum, name="traced", algorithm="ring"), total, "ring"),
        ("MPI allreduce",): lambda: assert_equal_arrays(
            rt.allreduce(x, rt.Sum, name="traced", algorithm="native"), total, "native"),
        ("MPI broadcast",): lambda: assert_equal_arrays(
            rt.broadcast(x, root_rank=k - 1, name="traced", algorithm="native"),
            x / (me + 1) * k, "broadcast"),
        ("MPI reducescatter",): lambda: assert_equal_arrays(
            rt.reducescatter(x, rt.Sum, name="traced", algorithm="native"),
            total[bounds[me]:bounds[me + 1]], "reducescatter"),
        ("MPI allgather", "pairwise allgather"): lambda: assert_equal_arrays(
            rt.allgather(x, name="traced", algorithm="recursive_doubling"), every,
            "allgather"),
        ("MPI alltoall", "pairwise alltoall"): lambda: assert_equal_arrays(
            rt.alltoall(x, name="traced", algorithm="recursive_doubling")[0], mine,
            "alltoall"),
    }
    directory = tempfile.mkdtemp() if me == 0 else None
    path = os.path.join(WORLD.bcast(directory), "trace.json")

    python_phases = [(_ring, "allreduce"), (_native, "allreduce"), (_native, "broadcast"),
                     (_native, "reducescatter")]
    originals = [getattr(module, name) for module, name in python_phases]
    for module, name in python_phases:
        setattr(module, name, refused)
    rt.start_timeline(path)
    try:
        for call in calls.values():
            call()
    finally:
        rt.stop_timeline()
        for (module, name), original in zip(python_phases, originals):
            setattr(module, name, original)
    with open(rank_path(path, me, k)) as trace:
        phases = [event for event in json.load(trace)["traceEvents"] if event.get("ph") == "X"]
    waits = [event for event in phases if event["name"] == "wait for ranks"]
    for names in calls:
        found = [event for event in phases if event["name"] in names]
        assert len(found) == 1, (names, phases)
        assert any(abs(wait["ts"] + wait["dur"] - found[0]["ts"]) <= 0.0015 for wait in waits), \
            (names, found, waits)


@check(min_size=2)
def the_exchange_uses_shared_memory_on_one_node():
    """All ranks run on one node here: the agreement's messages take the mailboxes,
    unless RINGTRAIN_AGREEMENT_SHARED_MEMORY=0 says otherwise."""
    wanted = os.environ.get(SHARED_MEMORY, "1") != "0"
    assert (mailboxes_of(world().group) is not None) == wanted, \
        f"mailboxes {'missing' if wanted else 'used'}"


@check(min_size=2)
def shared_memory_turned_off_on_one_rank_is_off_for_all():
    """A process set built while one rank has RINGTRAIN_AGREEMENT_SHARED_MEMORY=0 passes
    its agreement's messages through MPI on every rank; its collectives and their
    checks work as over the mailboxes."""
    k, me = rt.size(), rt.rank()
    before = os.environ.get(SHARED_MEMORY)
    if me == k - 1:
        os.environ[SHARED_MEMORY] = "0"
    everyone = rt.add_process_set(list(range(k)))
    try:
        got = rt.allreduce(np.full(3, me + 1.0), rt.Sum, name="over MPI",
                           process_set=everyone)
        assert np.array_equal(got, np.full(3, k * (k + 1) / 2)), got
        assert mailboxes_of(everyone.group("allreduce", None)) is None, "mailboxes used"
        shape = (4,) if me == 0 else (3,)
        expect_raises(rt.MismatchError, rt.allreduce, np.ones(shape), match=("shape",),
                      name="mismatch over MPI", process_set=everyone)
        assert np.array_equal(rt.broadcast(np.arange(3.0) + me, 0, process_set=everyone),
                              np.arange(3.0))
    finally:
        rt.remove_process_set(everyone)
        if before is None:
            os.environ.pop(SHARED_MEMORY, None)
        else:
            os.environ[SHARED_MEMORY] = before


@check(min_size=2)
def zero_ties_give_the_same_bits_on_every_rank():
    """+0 on some ranks and -0 on others: the minimum is -0 and the maximum +0 on every
    rank, whatever order each rank combined them in."""
    me = rt.rank()
    for dtype in (np.float32, np.float64):
        zeros = np.array([0.0, -0.0] if me % 2 else [-0.0, 0.0], dtype)
        low = rt.allreduce(zeros, rt.Min, name="zero ties")
        high = rt.allreduce(zeros, rt.Max, name="zero ties")
        assert np.signbit(low).all() and not np.signbit(high).any(), \
            f"{np.dtype(dtype).name}: min {low}, max {high}"


@check(min_size=2)
def sixteen_bit_zero_ties_give_the_same_bits_on_every_rank():
    """A 16-bit minimum or maximum of +0 and -0 returns its first operand, so its bits
    depend on the operands' order; every rank still gets the same bits, from the compiled
    exchange, the Python one, and ranks mixing the two: partners combine in rank order."""
    me = rt.rank()
    for form, python_here in [("compiled", False), ("python", True),
                              ("mixed", me % 2 == 1)]:
        with python_exchange(python_here):
            for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
                zeros = np.array([0.0, -0.0] if me % 2 else [-0.0, 0.0], dtype)
                for op in (rt.Min, rt.Max):
                    got = rt.allreduce(zeros, op, name=f"zero ties {form}")
                    every = rt.allgather(got.view(np.uint8)[None], name=f"ties {form}")
                    assert (every == every[0]).all(), \
                        f"{form} exchange, {op.name} of {dtype.name}: bits differ: {every}"


# --------------------------------------------------------------------------- Adasum

ADASUM_DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32),
                 np.dtype(np.float64)]
ADASUM_TOLERANCE = {  # (rtol, atol) against the float64 model of _harness.adasum_reference
    np.dtype(np.float64): (1e-12, 1e-13),
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float16): (2.0 ** -11, 1e-6),
    np.dtype(ml_dtypes.bfloat16): (2.0 ** -8, 1e-6),
}
"""Why these bounds: inputs lie in [-1, 1] and results within a few units of them. The
halving sums each dot product and norm in float64 over pieces, then over ranks, in
another order than the model: a relative difference of about n * 2^-53, far below the
float64 bound. The combination runs in float64 (float64 tensors) or float32 (the others):
at most 3 levels (4 ranks; the fold for 3) of two products and a sum, each rounded once,
so float32 results stay within 10 * 2^-24 * 2 ~ 1.2e-6 absolute of the model (atol for
the values that cancel to near zero), well inside rtol 1e-5. 16-bit results are rounded
once from that float32 value: half a unit in the last place, 2^-11 (float16) or 2^-8
(bfloat16) relative."""


def assert_adasum(actual: np.ndarray, expected: np.ndarray, dtype: np.dtype, what: str,
                  scale: float = 1.0) -> None:
    """``actual`` has ``expected``'s shape, ``dtype`` and values within ADASUM_TOLERANCE
    (its atol times ``scale``, for results scaled up by a postscale)."""
    assert isinstance(actual, np.ndarray) and actual.dtype == dtype, \
        f"{what}: got {type(actual).__name__} of {getattr(actual, 'dtype', None)}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, not {expected.shape}"
    rtol, atol = ADASUM_TOLERANCE[np.dtype(dtype)]
    atol *= scale
    values = actual.astype(np.float64)
    bad = np.argwhere(~np.isclose(values, expected, rtol=rtol, atol=atol))
    assert not bad.size, (f"{what}: {len(bad)} of {actual.size} values beyond rtol={rtol} "
                          f"atol={atol}; first at {tuple(bad[0])}: {values[tuple(bad[0])]!r}, "
                          f"model {expected[tuple(bad[0])]!r}")


def adasum_input(rank: int, shape: tuple[int, ...], dtype: np.dtype, *key: object) -> np.ndarray:
    """Uniform in [-1, 1], made in float32 for bfloat16 (make_input knows numpy's dtypes)."""
    made = make_input(rank, shape, np.float32 if dtype == ml_dtypes.bfloat16 else dtype, None,
                      "adasum", *key)
    return made.astype(dtype)


@check
def adasum_equals_the_model():
    """Every form, every floating dtype, sizes that do not split evenly, against the model;
    the same bytes on every rank; inputs left alone out of place."""
    k, me = rt.size(), rt.rank()
    digests = Digests()
    for dtype in ADASUM_DTYPES:
        for shape in [(1,), (7,), (1000,), (3, 5), (0,)]:
            inputs = [adasum_input(r, shape, dtype) for r in range(k)]
            expected = adasum_reference(inputs)
            for form in ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_"):
                what = f"{form}(Adasum, {dtype.name}, {shape})"
                x = inputs[me].copy()
                result = getattr(rt, form)(x, rt.Adasum, name="adasum")
                if "async" in form:
                    result = rt.synchronize(result)
                assert_adasum(result, expected, dtype, what)
                if form.endswith("_"):
                    assert result is x, f"{what}: in place returned a new array"
                else:
                    assert_equal_arrays(x, inputs[me], f"{what}: input after the call")
                digests.add(what, result)
    digests.verify()


@check
def adasum_grouped_each_tensor_on_its_own():
    """A grouped Adasum gives each tensor the Adasum of its own values (its own dot
    products), whatever else is fused with it."""
    k, me = rt.size(), rt.rank()
    specs = [(np.dtype(np.float32), (7,)), (np.dtype(np.float64), (1000,)),
             (np.dtype(np.float32), (3, 5)), (np.dtype(ml_dtypes.bfloat16), (13,)),
             (np.dtype(np.float16), (1,)), (np.dtype(np.float32), (0,))]
    everyone = [[adasum_input(r, shape, dtype, "grouped", i)
                 for i, (dtype, shape) in enumerate(specs)] for r in range(k)]
    expected = [adasum_reference(list(column)) for column in zip(*everyone)]
    digests = Digests()
    for form in ("grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
                 "grouped_allreduce_async_"):
        tensors = [t.copy() for t in everyone[me]]
        result = getattr(rt, form)(tensors, rt.Adasum, name="adasum-group")
        if "async" in form:
            result = rt.synchronize(result)
        for i, ((dtype, shape), got, want) in enumerate(zip(specs, result, expected)):
            what = f"{form}(Adasum) tensor {i} {dtype.name} {shape}"
            assert_adasum(got, want, dtype, what)
            if form.endswith("_"):
                assert got is tensors[i], f"{what}: in place returned a new array"
            digests.add(what, got)
    digests.verify()


@check
def adasum_scaled_and_with_a_zero_vector():
    """prescale and postscale (Adasum is homogeneous: adasum(s a, s b) = s adasum(a, b));
    a zero vector on rank 0 takes coefficient 1, as Horovod's."""
    k, me = rt.size(), rt.rank()
    for dtype in ADASUM_DTYPES:
        for n in (7, 1000):
            inputs = [adasum_input(r, (n,), dtype, "scaled") for r in range(k)]
            prescaled = [(x.astype(np.float64) * 0.5).astype(dtype) for x in inputs]
            expected = 3.0 * adasum_reference(prescaled)
            result = rt.allreduce(inputs[me], rt.Adasum, name="scaled", prescale_factor=0.5,
                                  postscale_factor=3.0)
            assert_adasum(result, expected, dtype, f"scaled Adasum {dtype.name} n={n}",
                          scale=3.0)
            grouped = rt.grouped_allreduce([inputs[me], inputs[me][:n // 2]], rt.Adasum,
                                           name="scaled-group", prescale_factor=0.5,
                                           postscale_factor=3.0)
            halves = 3.0 * adasum_reference([x[:n // 2] for x in prescaled])
            assert_adasum(grouped[0], expected, dtype, f"scaled grouped {dtype.name} n={n}",
                          scale=3.0)
            assert_adasum(grouped[1], halves, dtype, f"scaled grouped half {dtype.name} n={n}",
                          scale=3.0)
            zeros = [np.zeros(n, dtype)] + inputs[1:]
            result = rt.allreduce(zeros[me], rt.Adasum, name="zero")
            assert_adasum(result, adasum_reference(zeros), dtype,
                          f"Adasum with a zero vector on rank 0, {dtype.name} n={n}")
    if k == 1:
        return
    same = np.full(5, 2.5)  # adasum(a, a) = a
    assert_adasum(rt.allreduce(same, rt.Adasum), same, same.dtype, "Adasum of equal vectors")
    unit = np.eye(k)[me]  # orthogonal vectors add up
    assert_adasum(rt.allreduce(unit, rt.Adasum), np.ones(k), unit.dtype,
                  "Adasum of orthogonal vectors")


@check
def adasum_on_process_sets():
    """A set of the even ranks and one of all ranks but 0 (3 ranks at 4: the fold)."""
    k, me = rt.size(), rt.rank()
    for members in ([r for r in range(k) if r % 2 == 0], [r for r in range(1, k)]):
        if not members:
            continue
        ps = rt.add_process_set(members)
        try:
            if me in members:
                inputs = [adasum_input(r, (7 * k + 3,), np.dtype(np.float32), "sets")
                          for r in members]
                result = rt.allreduce(inputs[members.index(me)], rt.Adasum, name="set",
                                      process_set=ps)
                assert_adasum(result, adasum_reference(inputs), np.dtype(np.float32),
                              f"Adasum on process set {members}")
            everyone = WORLD.allgather(result.tobytes() if me in members else None)
            assert len({everyone[r] for r in members}) == 1, \
                f"Adasum on process set {members}: the members' result bytes differ"
        finally:
            rt.remove_process_set(ps)


@check
def adasum_refusals_name_the_tensor():
    """Refused before anything is sent, on every rank alike; the library works after."""
    for dtype in INT_DTYPES:
        error = expect_raises(rt.UnsupportedDtypeError, rt.allreduce, np.ones(3, dtype),
                              rt.Adasum, name="ints", match=["'ints'", "Adasum", dtype.name])
        assert isinstance(error, TypeError)
    expect_raises(rt.UnsupportedDtypeError, rt.grouped_allreduce,
                  [np.ones(3, np.float32), np.ones(2, np.int32)], rt.Adasum, name="mixed",
                  match=["'mixed'", "Adasum", "int32"])
    expect_raises(rt.InvalidArgumentError, rt.allreduce, np.ones(3, np.float32), rt.Adasum,
                  name="fp16", compression=rt.Compression.fp16, match=["'fp16'", "Adasum"])
    expect_raises(rt.InvalidArgumentError, rt.allreduce, np.ones(3, np.float32), rt.Adasum,
                  name="ring", algorithm="ring", match=["'ring'", "Adasum", "algorithm"])
    expect_raises(rt.InvalidArgumentError, rt.reducescatter, np.ones(4, np.float32),
                  rt.Adasum, name="rs", match=["'rs'", "Adasum"])
    assert rt.allreduce(np.ones(3), "adasum", name="by name").tolist() == [1.0, 1.0, 1.0]
    total = rt.allreduce(np.ones(5), rt.Sum, name="after")
    assert_equal_arrays(total, np.full(5, float(rt.size())), "Sum after refused Adasum calls")


if __name__ == "__main__":
    main()
