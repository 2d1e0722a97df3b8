"""A soak: thousands of random collectives, each result checked against numpy, and the
resident memory bounded.

Every rank draws the same random sequence of calls (allreduce in and out of place,
blocking and asynchronous, grouped, compressed; broadcast, allgather, reducescatter,
alltoall, barriers and object collectives) over every dtype and sizes that divide
unevenly, with inputs made from (seed, step, rank), so each rank checks every result
against a numpy reference. One part of the run makes named calls from two threads at
once. Resident memory is measured after a warm-up and at the end; growing more than
``RSS_GROWTH_BYTES`` fails.

``RINGTRAIN_SOAK_OPS`` sets the number of calls (default 2000; a release check runs
100000).

Run: mpiexec -n K python tests/mpi/soak.py
"""

from __future__ import annotations

import gc
import os
import threading
import warnings

import numpy as np
import psutil

import ringtrain as rt
from _harness import (COPY_DTYPES, FLOAT_DTYPES, OPS, REDUCE_DTYPES, all_inputs,
                      assert_equal_arrays, assert_reduced, check, main, make_input,
                      reduce_reference, rng)

OPS_TOTAL = int(os.environ.get("RINGTRAIN_SOAK_OPS", "2000"))
WARM_UP = min(300, OPS_TOTAL // 4)
RSS_GROWTH_BYTES = 48 << 20
SIZES = (0, 1, 3, 17, 100, 1023, 4099, 65537)
COMPRESSED_TOLERANCE = 2e-2


def _reduce_op(g: np.random.Generator, dtype: np.dtype) -> rt.ReduceOp:
    ops = OPS if dtype.kind == "f" else [op for op in OPS if op is not rt.Average]
    return ops[int(g.integers(len(ops)))]


def _allreduce(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    dtype = REDUCE_DTYPES[int(g.integers(len(REDUCE_DTYPES)))]
    op = _reduce_op(g, dtype)
    shape = (int(g.choice(SIZES)),) if g.random() < 0.8 else (3, int(g.integers(1, 40)))
    mode = int(g.integers(4))
    x = make_input(me, shape, dtype, op, step)
    expected = reduce_reference(all_inputs(range(n), shape, dtype, op, step), op)
    if mode == 0:
        out = rt.allreduce(x, op, name=name)
    elif mode == 1:
        out = rt.synchronize(rt.allreduce_async(x, op, name=name))
    elif mode == 2:
        rt.allreduce_(x, op, name=name)
        out = x
    else:
        rt.synchronize(rt.allreduce_async_(x, op, name=name))
        out = x
    assert_reduced(out, expected, dtype, f"step {step}: allreduce {op.name} {dtype} {shape}")


def _compressed(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    dtype = FLOAT_DTYPES[int(g.integers(len(FLOAT_DTYPES)))]
    op = (rt.Sum, rt.Average)[int(g.integers(2))]
    compression = (rt.Compression.fp16, rt.Compression.bf16)[int(g.integers(2))]
    shape = (int(g.choice(SIZES)),)
    x = make_input(me, shape, dtype, op, step)
    expected = reduce_reference(all_inputs(range(n), shape, dtype, op, step), op)
    out = rt.allreduce(x, op, name=name, compression=compression)
    assert out.dtype == dtype and out.shape == shape, (out.dtype, out.shape)
    assert np.allclose(out, expected, rtol=COMPRESSED_TOLERANCE, atol=COMPRESSED_TOLERANCE * n), \
        f"step {step}: compressed allreduce {dtype} {shape}"


def _grouped(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    dtype = REDUCE_DTYPES[int(g.integers(len(REDUCE_DTYPES)))]
    op = _reduce_op(g, dtype)
    shapes = [(int(g.choice(SIZES)),) for _ in range(int(g.integers(1, 4)))]
    inputs = [make_input(me, s, dtype, op, step, i) for i, s in enumerate(shapes)]
    expected = [reduce_reference(all_inputs(range(n), s, dtype, op, step, i), op)
                for i, s in enumerate(shapes)]
    if g.random() < 0.5:
        outs = rt.synchronize(rt.grouped_allreduce_async(inputs, op, name=name))
    else:
        rt.grouped_allreduce_(inputs, op, name=name)
        outs = inputs
    for i, (out, want) in enumerate(zip(outs, expected)):
        assert_reduced(out, want, dtype, f"step {step}: grouped {op.name} {dtype} part {i}")


def _broadcast(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    dtype = COPY_DTYPES[int(g.integers(len(COPY_DTYPES)))]
    root = int(g.integers(n))
    shape = (int(g.choice(SIZES)),)
    x = make_input(me, shape, dtype, None, step)
    expected = make_input(root, shape, dtype, None, step)
    if g.random() < 0.5:
        out = rt.synchronize(rt.broadcast_async(x, root, name=name))
    else:
        rt.broadcast_(x, root, name=name)
        out = x
    assert_equal_arrays(out, expected, f"step {step}: broadcast {dtype} from {root}")


def _allgather(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    dtype = COPY_DTYPES[int(g.integers(len(COPY_DTYPES)))]
    rows = [int(rng(r, "rows", step).integers(0, 9)) for r in range(n)]
    x = make_input(me, (rows[me], 3), dtype, None, step)
    expected = np.concatenate([make_input(r, (rows[r], 3), dtype, None, step)
                               for r in range(n)])
    assert_equal_arrays(rt.allgather(x, name=name), expected, f"step {step}: allgather {dtype}")


def _reducescatter(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    dtype = REDUCE_DTYPES[int(g.integers(len(REDUCE_DTYPES)))]
    op = rt.Sum if dtype.kind != "f" else (rt.Sum, rt.Average)[int(g.integers(2))]
    length = int(g.choice(SIZES[1:]))
    x = make_input(me, (length,), dtype, op, step)
    whole = reduce_reference(all_inputs(range(n), (length,), dtype, op, step), op)
    bounds = np.cumsum([0] + [length // n + (1 if r < length % n else 0) for r in range(n)])
    out = rt.reducescatter(x, op, name=name)
    assert_reduced(out, whole[bounds[me]:bounds[me + 1]], dtype,
                   f"step {step}: reducescatter {dtype} {length}")


def _alltoall(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    dtype = COPY_DTYPES[int(g.integers(len(COPY_DTYPES)))]
    splits = [[int(rng(r, "splits", step, d).integers(0, 5)) for d in range(n)] for r in range(n)]
    sent = [make_input(r, (sum(splits[r]),), dtype, None, step) for r in range(n)]
    offsets = [np.cumsum([0] + splits[r]) for r in range(n)]
    expected = np.concatenate([sent[r][offsets[r][me]:offsets[r][me + 1]] for r in range(n)])
    out, received_splits = rt.alltoall(sent[me], splits[me], name=name)
    assert_equal_arrays(out, expected, f"step {step}: alltoall {dtype}")
    assert list(received_splits) == [splits[r][me] for r in range(n)], received_splits


def _objects(step: int, g: np.random.Generator, name: str | None) -> None:
    n, me = rt.size(), rt.rank()
    if g.random() < 0.3:
        rt.barrier()
        return
    root = int(g.integers(n))
    got = rt.broadcast_object({"step": step, "rank": me}, root, name=name)
    assert got == {"step": step, "rank": root}, got
    assert rt.allgather_object((step, me), name=name) == [(step, r) for r in range(n)]


CALLS = [(_allreduce, 6), (_compressed, 1), (_grouped, 2), (_broadcast, 2), (_allgather, 1),
         (_reducescatter, 1), (_alltoall, 1), (_objects, 1)]
_KINDS = [call for call, weight in CALLS for _ in range(weight)]


def run_step(step: int, thread: int = 0, named: bool = False) -> None:
    g = rng(0, "soak", step, thread)
    call = _KINDS[int(g.integers(len(_KINDS)))]
    name = f"soak.{thread}.{step}" if named or g.random() < 0.5 else None
    if named and call is _objects:
        call = _allreduce
    call(step, g, name)


def resident_bytes() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


@check(name=f"soak of {OPS_TOTAL} random collectives")
def soak() -> None:
    threaded = range(OPS_TOTAL // 2, OPS_TOTAL // 2 + OPS_TOTAL // 5)
    with warnings.catch_warnings(record=True) as caught:
        for step in range(WARM_UP):
            run_step(step)
        before = resident_bytes()
        for step in range(WARM_UP, threaded.start):
            run_step(step)
        errors: list[BaseException] = []

        def second_thread() -> None:
            try:
                for step in threaded[1::2]:
                    run_step(step, thread=1, named=True)
            except BaseException as error:  # reported below
                errors.append(error)

        helper = threading.Thread(target=second_thread, name="soak-second")
        helper.start()
        for step in threaded[::2]:
            run_step(step, named=True)
        helper.join()
        assert not errors, errors[0]
        for step in range(threaded.stop, OPS_TOTAL):
            run_step(step)
        after = resident_bytes()
    assert after - before < RSS_GROWTH_BYTES, \
        f"resident memory grew by {(after - before) >> 20} MiB over {OPS_TOTAL} calls"
    escaped = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
               and "ringtrain" in w.filename]
    assert not escaped, escaped[:3]


if __name__ == "__main__":
    main()
