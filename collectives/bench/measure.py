"""Timing and checking: every algorithm at one size, in turn, round after round."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from mpi4py import MPI

from ...common.environment import BENCH_INJECT_WRONG
from .cases import Call, Case, Variant, variants
from .options import Options, iterations_for

INJECT_WRONG_VARIABLE = BENCH_INJECT_WRONG.name
"""When set to 1, rank 0 corrupts one checked element (to test that errors are caught)."""


@dataclass
class Measurement:
    """One algorithm, one mode (out-of-place or in-place), one size."""

    seconds: float
    wrong: int | None


def time_per_call(call: Call, iterations: int, comm: MPI.Comm) -> float:
    """Seconds per call of ``call``, averaged over ``iterations`` calls and over ranks."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    elapsed = (time.perf_counter() - start) / iterations
    return comm.allreduce(elapsed, MPI.SUM) / comm.Get_size()


def measure(case: Case, options: Options) -> dict[tuple[Variant, bool], Measurement]:
    """Time (and check) every requested algorithm on ``case``, out of place and in place,
    on each kind of buffer (:func:`~.cases.variants`); a call MPI cannot make (a
    bfloat16 reduction by ``native``) is left out, and its row shows n/a.

    Each round runs every variant and mode once, one after the other, so that noise
    on a shared machine hits them alike; the median round is reported.
    """
    made = {(variant, in_place): case.call(variant.algorithm, in_place, variant.memory)
            for variant in variants(options) for in_place in modes_of(case, options)}
    return time_calls(case, options, {key: call for key, call in made.items()
                                      if call is not None})


def modes_of(case: Case, options: Options) -> tuple[bool, ...]:
    """In place or not: out of place always, in place too where the collective has an
    in-place form and ``options`` ask for it."""
    return (False, True) if case.in_place and options.in_place else (False,)


def time_calls(case: Case, options: Options, calls: dict[tuple[Variant, bool], Call]
               ) -> dict[tuple[Variant, bool], Measurement]:
    """Time (and, with ``options.check``, check) ``calls`` on ``case``: round after
    round, each call in turn; the median round of each."""
    for call in calls.values():
        for _ in range(options.warmup):
            call()
    times: dict[tuple[Variant, bool], list[float]] = {key: [] for key in calls}
    iterations = iterations_for(options, case.count * options.dtype.itemsize)
    for _ in range(options.rounds):
        for key, call in calls.items():
            times[key].append(time_per_call(call, iterations, case.comm))
    results = {}
    for key, call in calls.items():
        wrong = count_wrong(case, call) if options.check else None
        results[key] = Measurement(statistics.median(times[key]), wrong)
    return results


def count_wrong(case: Case, call: Call) -> int:
    """Wrong elements of one call on the check inputs, summed over ranks."""
    case.reset()
    case.comm.Barrier()
    result = case.host_copy(call())
    if BENCH_INJECT_WRONG.read() and case.rank == 0 and result.size:
        result.reshape(-1)[0] += 1
    return case.comm.allreduce(case.wrong(result), MPI.SUM)
