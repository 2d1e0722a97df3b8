"""Tuning tables on real ranks: ``ringtrain-bench --tune`` writes one that init loads;
a table every rank loads decides ``auto`` (checked by which algorithm actually runs) and
the results stay right for every dtype; ranks that load different tables get a
MismatchError on every rank; a malformed or foreign table is ignored with a warning.

Run: mpiexec -n K python tests/mpi/tuning.py
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import warnings

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.collectives.algorithms import _broadcast_algorithms, _native, _ring
from ringtrain.collectives.transport import _pairwise
from ringtrain.collectives import tuning
from ringtrain.collectives.agreement._checked import CheckedCollective
from ringtrain.collectives.calls._allreduce_plan import allreduce_plan
from ringtrain.collectives.world._world import world
from ringtrain.collectives.bench import tune
from ringtrain.collectives.tuning import Range, TuningTable, default_choice, key_of, parse_table
from ringtrain.common.environment import TUNING_FILE
from _harness import (COPY_DTYPES, REDUCE_DTYPES, WORLD, all_inputs, assert_equal_arrays,
                      assert_reduced, check, expect_raises, main, make_input, reduce_reference)

DIRECTORY = WORLD.bcast(tempfile.mkdtemp(prefix="ringtrain-tuning-") if WORLD.Get_rank() == 0
                        else None)
if WORLD.Get_rank() == 0:
    atexit.register(shutil.rmtree, DIRECTORY, True)
TABLE_RANGES = {
    "allreduce": (Range(64, "ring", 1024), Range(4096, "native"),
                  Range(65536, "recursive_doubling", 1024)),
    "broadcast": (Range(100, "pipeline", 1024), Range(1000, "native"),
                  Range(1 << 20, "binomial")),
    "allgather": (Range(256, "native"), Range(1 << 20, "ring", 1024)),
    "reducescatter": (Range(256, "native"), Range(1 << 20, "ring", 1024)),
    "alltoall": (Range(256, "native"), Range(1 << 20, "pairwise", 1024)),
}
"""The table of these checks: every algorithm of every collective, by size."""

SPIED = {"allgather": ((_native, "allgather", "native"), (_ring, "allgather", "ring")),
         "alltoall": ((_native, "alltoall", "native"), (_pairwise, "alltoall", "pairwise")),
         "broadcast": ((_native, "broadcast", "native"),
                       (CheckedCollective, "run", None),
                       (_broadcast_algorithms, "pipeline", "pipeline"),
                       (_broadcast_algorithms, "binomial", "binomial")),
         "reducescatter": ((_native, "reducescatter", "native"),
                           (CheckedCollective, "run", None),
                           (_ring, "reduce_scatter", "ring"))}
"""The function each algorithm's data phase calls, by collective (MPI's own collective
is called from Python, or from the agreement's compiled call, which also runs the ring:
None there stands for the algorithm its call signature names)."""


def job_key() -> tuning.TuningKey:
    return key_of(MPI.Get_library_version().strip().splitlines()[0], world().node_keys)


def write(name: str, text: str) -> str:
    """Rank 0 writes ``text`` to a file of the shared directory; its path, on all ranks."""
    path = os.path.join(DIRECTORY, name)
    if WORLD.Get_rank() == 0:
        with open(path, "w") as handle:
            handle.write(text)
    WORLD.Barrier()
    return path


def reinit(path: str) -> None:
    """Start ringtrain again with ``path`` as this rank's tuning file ("" for none)."""
    rt.shutdown()
    os.environ[TUNING_FILE.name] = path
    rt.init()


@contextlib.contextmanager
def spying(collective: str):
    """The algorithms whose data phase ran inside the block, in order."""
    ran: list[str] = []
    saved = []
    for module, function, algorithm in SPIED[collective]:
        original = getattr(module, function)
        saved.append((module, function, original))

        def spy(*args, _original=original, _algorithm=algorithm, **kwargs):
            ran.append(_algorithm or args[0].call.fields["algorithm"])
            return _original(*args, **kwargs)

        setattr(module, function, spy)
    try:
        yield ran
    finally:
        for module, function, original in saved:
            setattr(module, function, original)


def expected_algorithm(collective: str, nbytes: int) -> str:
    """The test table's algorithm; beyond its ranges, the built-in table's."""
    for entry in TABLE_RANGES[collective]:
        if nbytes <= entry.max_bytes:
            return entry.algorithm
    return default_choice(collective, nbytes, rt.size(), rt.current_settings())


@check(min_size=2)
def tune_writes_a_table_that_init_loads():
    path = os.path.join(DIRECTORY, "tuned.json")
    assert tune.main(["-b", "1K", "-e", "16K", "-f", "16", "--rounds", "1",
                      "--round-bytes", "64K", "-o", path]) == 0
    reinit(path)
    with open(path) as handle:
        tuned = parse_table(handle.read())
    assert tuning.installed() == tuned, "init did not install the tuned table"
    assert tuned.key == job_key(), (tuned.key, job_key())
    ranges = tuned.groups[rt.size()]
    assert sorted(ranges) == sorted(tuning.TUNABLE), sorted(ranges)
    for collective, found in ranges.items():
        assert found[-1].max_bytes == 16 << 10, found
        assert {r.algorithm for r in found} <= set(tune.candidates(collective, False)), found


@check
def the_table_decides_auto_and_results_stay_right():
    k, me = rt.size(), rt.rank()
    reinit(write("same.json", TuningTable(job_key(), {k: TABLE_RANGES}).dumps()))
    assert tuning.installed() is not None
    for n in (3, 16, 17, 1000, 1025, 16385):  # ring, native, recursive doubling, beyond
        for dtype in REDUCE_DTYPES:
            x = make_input(me, (n,), dtype, rt.Sum, "ar")
            plan = allreduce_plan(x, rt.Sum, "ar", 1.0, 1.0, None, None,
                                  rt.Compression.none, "allreduce")
            assert plan.algorithm == expected_algorithm("allreduce", x.nbytes), \
                (n, dtype, plan.algorithm)
            expected = reduce_reference(all_inputs(range(k), (n,), dtype, rt.Sum, "ar"),
                                        rt.Sum)
            assert_reduced(rt.allreduce(x, rt.Sum, name="ar"), expected, dtype,
                           f"allreduce {dtype} n={n}")
    for n in (10, 101, 1001):  # broadcast: pipeline, native, binomial
        for dtype in COPY_DTYPES:
            source = make_input(k - 1, (n,), dtype, None, "bc")
            mine = source if me == k - 1 else np.zeros(n, dtype)
            with spying("broadcast") as ran:
                out = rt.broadcast(mine, k - 1, name="bc")
            assert_equal_arrays(out, source, f"broadcast {dtype} n={n}")
            wanted = expected_algorithm("broadcast", n * np.dtype(dtype).itemsize)
            assert ran == ([wanted] if k > 1 else []), (n, dtype, ran)


@check
def uneven_sizes_choose_alike_from_the_sizes_of_all_ranks():
    """allgather and alltoall sizes differ between ranks: the total decides."""
    k, me = rt.size(), rt.rank()
    for base in (1, 9, 40):
        for dtype in COPY_DTYPES:
            rows = [base + r for r in range(k)]
            inputs = [make_input(r, (rows[r], 2), dtype, None, "ag", base) for r in range(k)]
            with spying("allgather") as ran:
                out = rt.allgather(inputs[me], name="ag")
            assert_equal_arrays(out, np.concatenate(inputs), f"allgather {dtype} {rows}")
            total = sum(rows) * 2 * np.dtype(dtype).itemsize
            if k > 1:
                assert ran == [expected_algorithm("allgather", total)], (rows, dtype, ran)
            splits = [[(r + j) % 3 + base for j in range(k)] for r in range(k)]
            sent = [make_input(r, (sum(splits[r]),), dtype, None, "a2a", base)
                    for r in range(k)]
            with spying("alltoall") as ran:
                received, counts = rt.alltoall(sent[me], splits[me], name="a2a")
            offsets = [np.cumsum([0] + splits[r]) for r in range(k)]
            expected = np.concatenate([sent[r][offsets[r][me]:offsets[r][me + 1]]
                                       for r in range(k)])
            assert_equal_arrays(received, expected, f"alltoall {dtype} base={base}")
            assert counts.tolist() == [splits[r][me] for r in range(k)]
            mean = sum(map(sum, splits)) * np.dtype(dtype).itemsize // k
            if k > 1:
                assert ran == [expected_algorithm("alltoall", mean)], (base, dtype, ran)
        for dtype in REDUCE_DTYPES:
            n = base * k + (k - 1)  # parts of different lengths
            x = make_input(me, (n,), dtype, rt.Sum, "rs", base)
            with spying("reducescatter") as ran:
                out = rt.reducescatter(x, rt.Sum, name="rs")
            reference = reduce_reference(all_inputs(range(k), (n,), dtype, rt.Sum, "rs", base),
                                         rt.Sum)
            bounds = _ring.chunk_bounds(n, k)
            assert_reduced(out, reference[bounds[me]:bounds[me + 1]], dtype,
                           f"reducescatter {dtype} n={n}")
            if k > 1:
                assert ran == [expected_algorithm("reducescatter", x.nbytes)], (n, dtype, ran)


@check(min_size=3)
def a_process_set_of_another_size_uses_the_defaults():
    k, me = rt.size(), rt.rank()
    pair = rt.add_process_set([0, k - 1])
    try:
        if me in (0, k - 1):
            x = np.full(1000, float(me), np.float32)
            plan = allreduce_plan(x, rt.Sum, "ps", 1.0, 1.0, pair, None,
                                  rt.Compression.none, "allreduce")
            assert plan.algorithm == default_choice("allreduce", x.nbytes, 2,
                                                    rt.current_settings()), plan.algorithm
            assert np.all(rt.allreduce(x, rt.Sum, name="ps", process_set=pair) == k - 1)
    finally:
        rt.remove_process_set(pair)


@check(min_size=2)
def ranks_loading_different_tables_get_a_mismatch_on_every_rank():
    k, me = rt.size(), rt.rank()
    same = write("same.json", TuningTable(job_key(), {k: TABLE_RANGES}).dumps())
    other = write("other.json", TuningTable(job_key(), {k: {}}).dumps())
    for odd in (other, os.path.join(DIRECTORY, "absent.json")):
        rt.shutdown()
        os.environ[TUNING_FILE.name] = odd if me == k - 1 else same
        error = expect_raises(rt.MismatchError, rt.init, match=(
            f"rank {k - 1} sent tuning file '{odd}'",
            f"{'rank 0' if k == 2 else 'ranks 0,1'} sent tuning file '{same}'",
            "contents", TUNING_FILE.name))
        assert sorted(error.differences["tuning file"]) == list(range(k))
        assert not rt.is_initialized()
    reinit(same)  # usable again once every rank finds the same file
    assert tuning.installed() is not None
    assert np.all(rt.allreduce(np.ones(5, np.float32), rt.Sum, name="after") == k)


@check
def malformed_or_foreign_tables_are_ignored_with_a_warning():
    k = rt.size()
    foreign = TuningTable(key_of("MPICH", [0] * (k + 1)), {k + 1: TABLE_RANGES}).dumps()
    for name, text, why in (("bad.json", '{"format": "ringtrain-tuning/1", "key": 3}',
                             "malformed: 'key' is not an object"),
                            ("foreign.json", foreign, f"world_size {k + 1}, this job {k}")):
        path = write(name, text)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            reinit(path)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                    and "tuning file" in str(w.message)]
        assert len(messages) == 1 and path in messages[0] and why in messages[0], messages
        assert tuning.installed() is None
        assert np.all(rt.allreduce(np.ones(5, np.float32), rt.Sum, name=name) == k)
    reinit("")


if __name__ == "__main__":
    main()
