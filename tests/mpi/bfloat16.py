"""bfloat16 in every collective: ``ml_dtypes.bfloat16`` arrays and torch CPU bfloat16
tensors, checked against float64 references on any number of ranks.

Where the specification makes a result exact (sums, products, minima and maxima of small
integers; the average of a small-integer sum, which is divided once and rounded once;
scales by powers of two) a bfloat16 result must equal the reference rounded to bfloat16;
elsewhere it must lie within the bound of :func:`expected`, one bfloat16 rounding per
reduction step. Results are bit-identical on every rank, and data that is only moved
(broadcast, allgather, alltoall) keeps its bits, NaN payloads included.

Run: mpiexec -n K python tests/mpi/bfloat16.py [--only SUBSTRING]
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

import ringtrain as rt
import ringtrain.collectives as rtc
from _harness import Digests, check, configured, expect_raises, main, rng

try:
    import torch
except ImportError:
    torch = None

BF16 = np.dtype(ml_dtypes.bfloat16)
UNIT_ROUNDOFF = 2.0 ** -8
"""bfloat16 keeps 8 significant bits: round to nearest errs by at most 2**-8, relative."""
FINISH_ROUNDOFF = UNIT_ROUNDOFF + 2.0 ** -22
"""A division or scale of the result: computed in float32 (a float32 factor), rounded
to float32, then once to bfloat16: at most 2**-8 + 2**-24 relative, plus 2**-24 for the
factor's own rounding to float32."""
OPS = [rt.Sum, rt.Average, rt.Min, rt.Max, rt.Product]
ALGORITHMS = ["auto", "ring", "recursive_doubling", "native"]


# --------------------------------------------------------------------------- inputs

def small_integers(rank: int, shape: tuple[int, ...], op: rt.ReduceOp, *key: object
                   ) -> np.ndarray:
    """Integers whose sums (|sum| <= 32), products (|product| <= 16), minima and maxima
    over up to 4 ranks are exact in bfloat16 (8 significant bits hold every integer up to
    256), at every step of any schedule."""
    g = rng(rank, tuple(shape), "small", getattr(op, "name", op), *key)
    if op is rt.Product:
        return np.asarray(g.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size=shape)).astype(BF16)
    return np.asarray(g.integers(-8, 9, size=shape)).astype(BF16)


def uniform(rank: int, shape: tuple[int, ...], op: rt.ReduceOp, *key: object) -> np.ndarray:
    """bfloat16 values in [-1, 1] (in [0.5, 1.5] for Product): sums round at every step."""
    g = rng(rank, tuple(shape), "uniform", getattr(op, "name", op), *key)
    low, high = (0.5, 1.5) if op is rt.Product else (-1.0, 1.0)
    return np.asarray(g.uniform(low, high, size=shape), np.float32).astype(BF16)


def random_bits(rank: int, shape: tuple[int, ...], *key: object) -> np.ndarray:
    """Any 16-bit patterns: NaNs with payloads, infinities, subnormals, both zeros."""
    g = rng(rank, tuple(shape), "bits", *key)
    return np.asarray(g.integers(0, 1 << 16, size=shape, dtype=np.uint16)).view(BF16)


def everyone(make: Any, shape: tuple[int, ...], op: Any, *key: object) -> list[np.ndarray]:
    return [make(r, shape, op, *key) for r in range(rt.size())]


# --------------------------------------------------------------------------- references

def rounded(values: np.ndarray) -> np.ndarray:
    """float64 values rounded to bfloat16 (to float32 first: for a quotient or product of
    bfloat16 numbers the double rounding is harmless, float32 holding more than twice
    bfloat16's significant bits plus two)."""
    return np.asarray(values, np.float64).astype(np.float32).astype(BF16)


def prescaled(x: np.ndarray, factor: float) -> np.ndarray:
    """What ringtrain reduces for an input ``x`` and a prescale factor: ``x`` times the
    factor rounded to float32, computed in float32, rounded once to bfloat16."""
    if factor == 1.0:
        return x
    return (x.astype(np.float32) * np.float32(factor)).astype(BF16)


def expected(inputs: list[np.ndarray], op: rt.ReduceOp, prescale: float = 1.0,
             postscale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The exact result in float64 and how far a bfloat16 result may lie from it.

    Every reduction step of ringtrain's algorithms (and of MPI's own, with ringtrain's op)
    combines two bfloat16 values in float32 and rounds once to bfloat16; a float32 sum of
    two bfloat16 numbers rounded to bfloat16 is correctly rounded (float32 holds more than
    twice bfloat16's bits plus two), so each step errs by at most u = 2**-8 relative. Any
    schedule over p ranks (ring chain, recursive-doubling tree, node sums then a ring)
    gives each element a reduction tree of depth at most p - 1, so the standard bound of
    recursive summation holds: |computed - exact| <= gamma(p - 1) * sum(|x_i|), with
    gamma(n) = n*u / (1 - n*u); a product errs by gamma(p - 1) * |product|; minima and
    maxima pick an operand and are exact. The division of an Average and a postscale
    each round once more (:data:`FINISH_ROUNDOFF` of the value). Prescaled inputs are
    computed exactly as ringtrain computes them (:func:`prescaled`).
    """
    values = np.stack([prescaled(x, prescale).astype(np.float64) for x in inputs])
    steps = len(inputs) - 1
    gamma = steps * UNIT_ROUNDOFF / (1 - steps * UNIT_ROUNDOFF)
    if op in (rt.Sum, rt.Average):
        value, bound = values.sum(0), gamma * np.abs(values).sum(0)
    elif op is rt.Product:
        value = values.prod(0)
        bound = gamma * np.abs(value)
    else:
        value = values.min(0) if op is rt.Min else values.max(0)
        bound = np.zeros_like(value)
    for factor in ([1.0 / len(inputs)] if op is rt.Average else []) + \
            ([postscale] if postscale != 1.0 else []):
        value, bound = value * factor, bound * abs(factor)
        bound = bound + FINISH_ROUNDOFF * (np.abs(value) + bound)
    return value, bound


def exactly(inputs: list[np.ndarray], op: rt.ReduceOp, prescale: float = 1.0,
            postscale: float = 1.0) -> np.ndarray:
    """The bfloat16 result where the specification makes it exact: every partial result
    is a bfloat16 number, and the division and scales (powers of two) round once."""
    value, _ = expected(inputs, op, prescale, postscale)
    return rounded(value)


def as_array(result: Any) -> np.ndarray:
    """A result as a bfloat16 numpy array (torch tensors through their int16 view)."""
    if torch is not None and isinstance(result, torch.Tensor):
        assert result.dtype == torch.bfloat16, f"torch result of dtype {result.dtype}"
        return result.view(torch.int16).numpy().view(BF16)
    return result


def assert_exact(result: Any, wanted: np.ndarray, what: str) -> None:
    """A bfloat16 result equal to ``wanted`` (bfloat16), value for value."""
    actual = as_array(result)
    assert isinstance(actual, np.ndarray), f"{what}: result is a {type(actual).__name__}"
    assert actual.dtype == BF16, f"{what}: dtype {actual.dtype}, expected bfloat16"
    assert actual.shape == wanted.shape, f"{what}: shape {actual.shape}, expected {wanted.shape}"
    got, want = actual.astype(np.float64), wanted.astype(np.float64)
    wrong = np.flatnonzero(~((got == want) | (np.isnan(got) & np.isnan(want))).ravel())
    assert wrong.size == 0, (f"{what}: {wrong.size} of {got.size} values differ; first at "
                             f"{wrong[0]}: got {got.ravel()[wrong[0]]!r}, expected "
                             f"{want.ravel()[wrong[0]]!r}")


def assert_within(result: Any, reference: tuple[np.ndarray, np.ndarray], what: str) -> None:
    """A bfloat16 result within :func:`expected`'s bound of the exact value."""
    value, bound = reference
    actual = as_array(result)
    assert actual.dtype == BF16, f"{what}: dtype {actual.dtype}, expected bfloat16"
    assert actual.shape == value.shape, f"{what}: shape {actual.shape}, expected {value.shape}"
    error = np.abs(actual.astype(np.float64) - value)
    wrong = np.flatnonzero((error > bound).ravel())
    assert wrong.size == 0, (f"{what}: {wrong.size} of {error.size} values beyond one "
                             f"rounding per step; first at {wrong[0]}: got "
                             f"{actual.ravel()[wrong[0]]!r}, exact {value.ravel()[wrong[0]]!r},"
                             f" bound {bound.ravel()[wrong[0]]:.3g}")


def assert_same_bits(result: Any, wanted: np.ndarray, what: str) -> None:
    """Moved data: the same dtype, shape and 16-bit patterns."""
    actual = as_array(result)
    assert actual.dtype == BF16, f"{what}: dtype {actual.dtype}, expected bfloat16"
    assert actual.shape == wanted.shape, f"{what}: shape {actual.shape}, expected {wanted.shape}"
    assert np.array_equal(actual.view(np.uint16), wanted.view(np.uint16)), f"{what}: bits differ"


def to_torch(x: np.ndarray) -> Any:
    """A torch CPU bfloat16 tensor holding ``x``."""
    return torch.from_numpy(np.array(x, copy=True).view(np.int16)).view(torch.bfloat16)


def kinds() -> list[tuple[str, Any]]:
    """The host tensors bfloat16 comes in: numpy arrays, and torch tensors if installed."""
    found = [("numpy", lambda x: x.copy())]
    if torch is not None:
        found.append(("torch", to_torch))
    return found


def shapes() -> list[tuple[int, ...]]:
    k = rt.size()
    return [(), (0,), (1,), (13,), (3, 5), (37 * k + 1,), (70_001,)]


# --------------------------------------------------------------------------- allreduce

@check
def allreduce_every_op_algorithm_and_shape():
    """Out of place and in place; 70 001 elements are past the agreement's payload."""
    me = rt.rank()
    digests = Digests()
    for algorithm in ALGORITHMS:
        for op in OPS:
            for shape in shapes():
                for make in (small_integers, uniform):
                    key = (algorithm, make.__name__)
                    inputs = everyone(make, shape, op, *key)
                    what = f"allreduce({algorithm}, {op.name}, {shape}, {make.__name__})"
                    before = inputs[me].copy()
                    out = rt.allreduce(inputs[me], op, name="x", algorithm=algorithm)
                    assert_same_bits(inputs[me], before, f"{what}: input afterwards")
                    inside = inputs[me].copy()
                    assert rt.allreduce_(inside, op, name="x", algorithm=algorithm) is inside
                    for result, mode in ((out, ""), (inside, " in place")):
                        if make is small_integers:
                            assert_exact(result, exactly(inputs, op), what + mode)
                        else:
                            assert_within(result, expected(inputs, op), what + mode)
                        digests.add(what + mode, result)
                    if algorithm != "native":  # MPI may order in-place calls otherwise
                        assert_same_bits(inside, out, f"{what}: in place vs out of place")
    digests.verify()


@check
def torch_tensors_in_and_out():
    """torch CPU bfloat16 tensors: results are torch bfloat16 tensors with the bits of
    the same call on numpy arrays; in place returns the caller's tensor, views included."""
    if torch is None:
        return
    me = rt.rank()
    for op in (rt.Sum, rt.Average, rt.Max):
        inputs = everyone(uniform, (5, 7), op, "torch")
        host = rt.allreduce(inputs[me], op, name="t")
        tensor = to_torch(inputs[me])
        result = rt.allreduce(tensor, op, name="t")
        assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16
        assert_same_bits(result, host, f"torch {op.name} vs numpy")
        assert rt.allreduce_(tensor, op, name="t") is tensor
        assert_same_bits(tensor, host, f"torch {op.name} in place")
        base = to_torch(inputs[me])
        view = base.t()
        assert rt.allreduce_(view, op, name="t") is view
        assert_same_bits(base, host, f"torch {op.name} in place through a transposed view")
        handle = rt.allreduce_async(to_torch(inputs[me]), op, name="t")
        assert_same_bits(rt.synchronize(handle), host, f"torch {op.name} async")
    summed = rt.allreduce(torch.ones(3, dtype=torch.bfloat16), rt.Sum, name="ones")
    assert summed.dtype == torch.bfloat16 and summed.tolist() == [float(rt.size())] * 3


@check
def scale_factors():
    """Powers of two scale exactly; other factors round once each."""
    me = rt.rank()
    digests = Digests()
    for algorithm in ("auto", "ring", "native"):
        for op in (rt.Sum, rt.Average, rt.Max):
            for shape in ((11,), (70_001,)):
                exact_in = everyone(small_integers, shape, op, "scaled", algorithm)
                y = rt.allreduce(exact_in[me], op, name="s", algorithm=algorithm,
                                 prescale_factor=0.5, postscale_factor=4.0)
                what = f"allreduce({algorithm}, {op.name}, {shape}) scaled 0.5/4"
                assert_exact(y, exactly(exact_in, op, 0.5, 4.0), what)
                inputs = everyone(uniform, shape, op, "scaled", algorithm)
                z = inputs[me].copy()
                rt.allreduce_(z, op, name="s", algorithm=algorithm, prescale_factor=3.0,
                              postscale_factor=0.1)
                what = f"allreduce_({algorithm}, {op.name}, {shape}) scaled 3/0.1"
                assert_within(z, expected(inputs, op, 3.0, 0.1), what)
                digests.add(what, z)
    digests.verify()


@check
def asynchronous_calls_in_flight():
    me = rt.rank()
    calls = []
    for i, op in enumerate((rt.Sum, rt.Average, rt.Min, rt.Product)):
        shape = (9 + 1000 * i,)
        inputs = everyone(small_integers, shape, op, "async", i)
        if i % 2:
            tensor = inputs[me].copy()
            calls.append((inputs, op, rt.allreduce_async_(tensor, op, name=f"a{i}"), tensor))
        else:
            calls.append((inputs, op, rt.allreduce_async(inputs[me], op, name=f"a{i}"), None))
    grouped_inputs = [everyone(small_integers, s, rt.Sum, "async grouped", j)
                      for j, s in enumerate(((3,), (4, 2)))]
    grouped = rt.grouped_allreduce_async([g[me] for g in grouped_inputs], rt.Sum, name="ga")
    for inputs, op, handle, tensor in reversed(calls):
        result = rt.synchronize(handle)
        assert_exact(result if tensor is None else tensor, exactly(inputs, op),
                     f"async {op.name}")
    for inputs, result in zip(grouped_inputs, rt.synchronize(grouped)):
        assert_exact(result, exactly(inputs, rt.Sum), "grouped async")


@check
def grouped_with_mixed_dtypes():
    """bfloat16 tensors fused with float32, float16 and int32 ones, in place and out."""
    me, k = rt.rank(), rt.size()
    specs = [((5, 3), BF16), ((7,), np.dtype(np.float32)), ((), BF16),
             ((4,), np.dtype(np.float16)), ((6,), np.dtype(np.int32)), ((0,), BF16),
             ((3000,), BF16)]

    def inputs_of(index: int, shape: tuple[int, ...], dtype: np.dtype) -> list[np.ndarray]:
        return [small_integers(r, shape, rt.Sum, "grouped", index).astype(dtype)
                for r in range(k)]

    everyone_inputs = [inputs_of(i, s, d) for i, (s, d) in enumerate(specs)]
    digests = Digests()
    for op in (rt.Sum, rt.Average):
        # an Average of integers is refused: the int32 member joins the Sums only
        members = [i for i, (_, d) in enumerate(specs) if op is rt.Sum or d.kind not in "iu"]
        for algorithm in ("auto", "ring", "native"):
            mine = [everyone_inputs[i][me] for i in members]
            out = rt.grouped_allreduce(mine, op, name="g", algorithm=algorithm)
            inside = [x.copy() for x in mine]
            returned = rt.grouped_allreduce_(inside, op, name="g", algorithm=algorithm)
            assert all(a is b for a, b in zip(returned, inside))
            for at, index in enumerate(members):
                if specs[index][1] != BF16:
                    continue
                for result, mode in ((out[at], ""), (inside[at], " in place")):
                    what = f"grouped {op.name} {algorithm} #{index}{mode}"
                    assert_exact(result, exactly(everyone_inputs[index], op), what)
                    digests.add(what, result)
            wanted = np.sum([x.astype(np.float64) for x in everyone_inputs[1]], axis=0)
            wanted = (wanted / (k if op is rt.Average else 1)).astype(np.float32)
            assert np.array_equal(out[1], wanted), f"grouped {op.name}: the float32 member"
    digests.verify()


@check
def uneven_sizes_and_many_segments():
    me, k = rt.rank(), rt.size()
    with configured(segment_bytes=64):
        for algorithm in ("ring", "recursive_doubling", "native"):
            for count in sorted({1, max(1, k - 1), k + 1, 2 * k + 1, 1001}):
                for op in (rt.Sum, rt.Average):
                    inputs = everyone(small_integers, (count,), op, "uneven")
                    y = rt.allreduce(inputs[me], op, name="u", algorithm=algorithm)
                    assert_exact(y, exactly(inputs, op), f"{algorithm} {count} {op.name}")
                    noisy = everyone(uniform, (count,), op, "uneven")
                    z = rt.allreduce(noisy[me], op, name="u", algorithm=algorithm)
                    assert_within(z, expected(noisy, op), f"{algorithm} {count} {op.name}")


@check
def reducescatter_every_op():
    me, k = rt.rank(), rt.size()
    for algorithm in ("ring", "native"):
        for op in OPS:
            for rows in (1, 2 * k + 1, 40_001):
                shape = (rows, 3) if rows < 1000 else (rows,)
                for make in (small_integers, uniform):
                    inputs = everyone(make, shape, op, "reducescatter", algorithm)
                    y = rt.reducescatter(inputs[me], op, name="r", algorithm=algorithm)
                    share = np.array_split(np.arange(rows), k)[me]
                    what = f"reducescatter({algorithm}, {op.name}, {shape}, {make.__name__})"
                    if make is small_integers:
                        assert_exact(y, exactly(inputs, op)[share], what)
                    else:
                        value, bound = expected(inputs, op)
                        assert_within(y, (value[share], bound[share]), what)
            inputs = everyone(small_integers, (2 * k + 1,), rt.Average, "rs scaled")
            y = rt.reducescatter(inputs[me], rt.Average, name="r", algorithm=algorithm,
                                 prescale_factor=2.0, postscale_factor=0.5)
            share = np.array_split(np.arange(2 * k + 1), k)[me]
            assert_exact(y, exactly(inputs, rt.Average, 2.0, 0.5)[share],
                         f"reducescatter({algorithm}) scaled")
    if torch is not None:
        inputs = everyone(small_integers, (2 * k + 1, 2), rt.Sum, "rs torch")
        result = rt.reducescatter(to_torch(inputs[me]), rt.Sum, name="r")
        share = np.array_split(np.arange(2 * k + 1), k)[me]
        assert_exact(result, exactly(inputs, rt.Sum)[share], "reducescatter torch")


# --------------------------------------------------------------------------- copies

@check
def broadcast_allgather_alltoall_move_the_bits():
    me, k = rt.rank(), rt.size()
    for kind, convert in kinds():
        for algorithm in ("auto", "binomial", "pipeline", "native"):
            for root in range(k):
                for shape in ((), (0,), (17,), (3, 70_000)):
                    data = random_bits(root, shape, "broadcast")
                    mine = random_bits(me, shape, "broadcast")
                    what = f"{kind} broadcast({algorithm}, root {root}, {shape})"
                    assert_same_bits(rt.broadcast(convert(mine), root, name="b",
                                                  algorithm=algorithm), data, what)
                    tensor = convert(mine)
                    assert rt.broadcast_(tensor, root, name="b", algorithm=algorithm) is tensor
                    assert_same_bits(tensor, data, what + " in place")
        for algorithm in ("auto", "ring", "native"):
            for row in ((), (3,)):
                parts = [random_bits(r, (r % 3, *row), "gather") for r in range(k)]
                gathered = rt.allgather(convert(parts[me]), name="g", algorithm=algorithm)
                assert_same_bits(gathered, np.concatenate(parts),
                                 f"{kind} allgather({algorithm}) rows of {row}")
        for algorithm in ("auto", "pairwise", "native"):
            splits = [(me + r) % 3 for r in range(k)]
            data = random_bits(me, (sum(splits), 2), "alltoall")
            received, counts = rt.alltoall(convert(data), splits=splits, name="a",
                                           algorithm=algorithm)
            pieces = []
            for sender in range(k):
                theirs = [(sender + r) % 3 for r in range(k)]
                rows = random_bits(sender, (sum(theirs), 2), "alltoall")
                start = sum(theirs[:me])
                pieces.append(rows[start:start + theirs[me]])
            assert_same_bits(received, np.concatenate(pieces), f"{kind} alltoall({algorithm})")
            assert list(np.asarray(counts)) == [(r + me) % 3 for r in range(k)]


# --------------------------------------------------------------------------- agreement

def dtypes_part(sent: dict[int, np.dtype]) -> str:
    """How a MismatchError names the ranks' dtypes: the smallest group of ranks first."""
    groups: dict[str, list[int]] = {}
    for r in sorted(sent):
        groups.setdefault(str(sent[r]), []).append(r)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
    return ", ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))} "
                     f"sent dtype {name}" for name, ranks in ordered)


@check(min_size=2)
def bfloat16_against_float16_and_float32_names_ranks_and_dtypes():
    """The signature carries the dtype: bfloat16 is its own, so a rank sending float16 (or
    float32) where another sends bfloat16 gets a MismatchError on every rank."""
    me, k = rt.rank(), rt.size()
    sent = {r: (np.dtype(np.float16), BF16, np.dtype(np.float32))[r % 3] for r in range(k)}
    for function in (rt.allreduce, rt.allreduce_):
        for count in (6, 70_001):
            error = expect_raises(rt.MismatchError, function, np.ones(count, sent[me]),
                                  rt.Sum, name="w",
                                  match=["allreduce of tensor 'w'", dtypes_part(sent)])
            assert {r: str(d) for r, d in error.differences["dtype"].items()} == \
                {r: str(d) for r, d in sent.items()}, error.differences
    error = expect_raises(rt.MismatchError, rt.broadcast, np.zeros(4, sent[me]), 0, name="b",
                          match=["broadcast of tensor 'b'", dtypes_part(sent)])
    assert str(error.differences["dtype"][1]) == "bfloat16"
    total = rt.allreduce(np.ones(5, BF16), rt.Sum, name="after")
    assert_exact(total, np.full(5, k, BF16), "a bfloat16 allreduce after the mismatch")


@check
def compression_of_bfloat16_tensors():
    """bf16 compression leaves a bfloat16 tensor as it is (the same bits as none); fp16
    compression is refused by name, before anything is sent."""
    me = rt.rank()
    inputs = everyone(uniform, (1000,), rt.Average, "compressed")
    plain = rt.allreduce(inputs[me], name="c")
    same = rt.allreduce(inputs[me], name="c", compression=rt.Compression.bf16)
    assert_same_bits(same, plain, "bf16 compression of a bfloat16 tensor")
    expect_raises(rt.UnsupportedDtypeError, rt.allreduce, inputs[me], name="c",
                  compression=rt.Compression.fp16,
                  match=[f"rank {me}: allreduce of tensor 'c'", "fp16", "bfloat16"])
    floats = np.linspace(-1, 1, 100, dtype=np.float32) * (me + 1)
    mixed = rt.grouped_allreduce([inputs[me], floats], name="m",
                                 compression=rt.Compression.bf16)
    assert_same_bits(mixed[0], plain, "grouped: the bfloat16 member travels as it is")
    assert mixed[1].dtype == np.float32
    expect_raises(rt.UnsupportedDtypeError, rt.grouped_allreduce, [floats, inputs[me]],
                  name="m", compression=rt.Compression.fp16, match=["'m'", "bfloat16"])


# --------------------------------------------------------------------------- hierarchical

@check
def hierarchical_on_pretend_nodes():
    me, k = rt.rank(), rt.size()
    digests = Digests()
    for node_size in (2, 3):
        with configured(node_size=node_size, segment_bytes=256):
            for algorithm in ("hierarchical", "node_leader"):
                for op in (rt.Sum, rt.Average, rt.Max):
                    for shape in ((0,), (13,), (37 * k + 1,), (20_001,)):
                        what = f"node_size={node_size} {algorithm} {op.name} {shape}"
                        inputs = everyone(small_integers, shape, op, "h", node_size)
                        y = rt.allreduce(inputs[me], op, name="h", algorithm=algorithm)
                        assert_exact(y, exactly(inputs, op), what)
                        noisy = everyone(uniform, shape, op, "h", node_size)
                        z = noisy[me].copy()
                        rt.allreduce_(z, op, name="h", algorithm=algorithm)
                        assert_within(z, expected(noisy, op), what + " in place")
                        digests.add(what, z)
            for root in range(k):
                data = random_bits(root, (5, 301), "hb")
                got = rt.broadcast(random_bits(me, (5, 301), "hb"), root, name="hb",
                                   algorithm="hierarchical")
                assert_same_bits(got, data, f"node_size={node_size} broadcast root {root}")
            parts = [random_bits(r, (r + 1, 3), "hg") for r in range(k)]
            assert_same_bits(rt.allgather(parts[me], name="hg", algorithm="hierarchical"),
                             np.concatenate(parts), f"node_size={node_size} allgather")
    digests.verify()


# --------------------------------------------------------------------------- join

@check(min_size=2)
def joined_rank_replays_bfloat16_with_zeros():
    me, k = rt.rank(), rt.size()
    for first in range(k):
        active = [r for r in range(k) if r != first]
        if me == first:
            rtc.join()
            continue
        for shape in ((7,), (40_001,)):
            for op in (rt.Sum, rt.Average):
                key = ("join", first, op.name)
                mine = small_integers(me, shape, rt.Sum, *key)
                total = np.sum([small_integers(r, shape, rt.Sum, *key).astype(np.float64)
                                for r in active], axis=0)
                wanted = rounded(total / (k if op is rt.Average else 1))
                assert_exact(rt.allreduce(mine, op, name=f"j{shape}"), wanted,
                             f"{op.name} {shape}, rank {first} joined")
        parts = [small_integers(me, (5,), rt.Sum, "join grouped", first),
                 np.full(3, me + 1.0, np.float32)]
        grouped = rt.grouped_allreduce(parts, rt.Sum, name="jg")
        total = np.sum([small_integers(r, (5,), rt.Sum, "join grouped", first)
                        .astype(np.float64) for r in active], axis=0)
        assert_exact(grouped[0], rounded(total), f"grouped, rank {first} joined")
        assert grouped[1].tolist() == [float(sum(r + 1 for r in active))] * 3
        rtc.join()


if __name__ == "__main__":
    main()
