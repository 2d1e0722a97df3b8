"""``ringtrain-bench --tune``: measure every algorithm of every collective on the job's
own ranks, and write the tuning table that ``auto`` then follows.

Run it as the job runs (``mpiexec -n 4 ringtrain-bench --tune``, on the same nodes).
For each collective and size (powers of ``--stepfactor`` up to ``--maxbytes``), every
algorithm ``auto`` may pick (``native`` as ringtrain runs it: MPI's own collective behind
ringtrain's agreement check) is timed as ``ringtrain-bench`` times it: the algorithms interleaved in
``--rounds`` rounds, the median round kept, time averaged over ranks; out of place and,
where the collective has one, in place, the two times added. A round makes enough calls
to move ``--round-bytes`` (from 2 to 200 calls), so large sizes take few calls and a
default tune of one node takes a minute or two. The fastest algorithm of each size
wins, unless the built-in table's choice is within ``--tolerance`` (default 5%) of it:
a tuned table departs from the built-in one only where it measured a clear difference,
not where noise decided. Consecutive sizes with the same winner make one range, which rank 0
writes atomically to ``--output`` (default: ``RINGTRAIN_TUNING_FILE``, else the user's
cache directory; see :func:`ringtrain.common.environment.tuning_file`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from ... import collectives as rt
from ...common.atomic_file import write_atomically
from ...common.environment import ALGORITHMS, TUNING_FILE, tuning_file
from ..tuning import TUNABLE, Range, TuningTable, default_choice
from ..world._topology import HIERARCHICAL, layout_of
from ..world._tuning_load import job_key
from ..world._world import world
from .cases import HOST, Case, Variant
from .measure import modes_of, time_calls
from .options import NATIVE, Options, add_size_arguments, parsed_sizes, size_argument

ITERATION_BOUNDS = (2, 200)
"""Fewest and most timed calls of one algorithm in one round."""

_NEVER_TABULATED = ("auto", "ipc")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ringtrain-bench --tune``."""
    parser = argparse.ArgumentParser(
        prog="ringtrain-bench --tune",
        description="Measure each algorithm of each collective (MPI's own included) on "
                    "these ranks and write the tuning table that auto follows.")
    add_size_arguments(parser, 64 << 20, 4, "; sizes are maxbytes divided by powers of "
                                            "the step factor, down to minbytes")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per size, algorithms interleaved (default 3; more "
                             "for a steadier table)")
    parser.add_argument("--round-bytes", type=size_argument, default=4 << 20,
                        help="bytes each algorithm moves per round (default 4M; more for "
                             "a steadier table)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="keep the built-in table's choice where it is within this "
                             "fraction of the fastest (default 0.05)")
    parser.add_argument("--collectives", default=",".join(TUNABLE),
                        help=f"comma-separated (default {','.join(TUNABLE)})")
    parser.add_argument("-o", "--output", default=None,
                        help=f"the table's file (default: {TUNING_FILE.name}, else "
                             f"the user's cache directory)")
    return parser


def tuned_sizes(minimum: int, maximum: int, factor: int) -> tuple[int, ...]:
    """``maximum``, ``maximum / factor``, ... down to ``minimum``, ascending."""
    if minimum < 1 or maximum < minimum or factor < 2:
        raise ValueError(f"need 1 <= minbytes <= maxbytes and a step factor >= 2, got "
                         f"{minimum}, {maximum} and {factor}")
    sizes, size = [], maximum
    while size >= minimum:
        sizes.append(size)
        size //= factor
    return tuple(reversed(sizes))


def candidates(collective: str, spans_nodes: bool) -> tuple[str, ...]:
    """The algorithms measured for ``collective``: all but ``auto`` and ``ipc`` (and the
    node-aware ones where the ranks do not span nodes), MPI's own included."""
    return tuple(a for a in ALGORITHMS[collective] if a not in _NEVER_TABULATED
                 and (spans_nodes or a not in HIERARCHICAL))


def ranges_of(winners: Sequence[tuple[int, str]], segment_bytes: int) -> tuple[Range, ...]:
    """The table's ranges from each size's fastest algorithm (sizes ascending): a range
    ends at the last size its algorithm won."""
    ranges: list[Range] = []
    for size, algorithm in winners:
        segment = None if algorithm == NATIVE else segment_bytes
        if ranges and ranges[-1].algorithm == algorithm:
            ranges[-1] = Range(size, algorithm, segment)
        else:
            ranges.append(Range(size, algorithm, segment))
    return tuple(ranges)


def winner(seconds: dict[str, float], built_in: str, tolerance: float) -> str:
    """The fastest algorithm of ``seconds``, or ``built_in`` if it is within
    ``tolerance`` (a fraction) of the fastest."""
    best = min(seconds, key=lambda a: seconds[a])
    if built_in in seconds and seconds[built_in] <= seconds[best] * (1 + tolerance):
        return built_in
    return best


def times(collective: str, nbytes: int, algorithms: tuple[str, ...], rounds: int,
          round_bytes: int, comm: MPI.Comm) -> dict[str, float]:
    """Seconds per call of each of ringtrain's ``algorithms`` of ``collective`` at
    ``nbytes`` on ``comm`` (``native`` as ringtrain runs it: behind its agreement check),
    out of place plus in place where there is an in-place form."""
    options = Options(collective, (nbytes,), None, 1, rounds, False, np.dtype(np.float32),
                      "sum", 0, algorithms, "none", None, None, None,
                      round_bytes=round_bytes, iteration_bounds=ITERATION_BOUNDS)
    case = Case(options, nbytes, comm)
    calls = {(Variant(algorithm, HOST), in_place): case.ringtrain_call(algorithm, in_place)
             for algorithm in algorithms for in_place in modes_of(case, options)}
    seconds: dict[str, float] = dict.fromkeys(algorithms, 0.0)
    for (variant, _), point in time_calls(case, options, calls).items():
        seconds[variant.algorithm] += point.seconds
    return seconds


def main(argv: Sequence[str]) -> int:
    """Tune on every rank; rank 0 prints each size's times and winner, and writes the
    table. Returns 0, or 2 on bad arguments (before any measurement)."""
    parser = build_parser()
    arguments = parser.parse_args(argv)
    sizes = parsed_sizes(parser, arguments, tuned_sizes)
    collectives = [c.strip() for c in arguments.collectives.split(",") if c.strip()]
    unknown = [c for c in collectives if c not in TUNABLE]
    if unknown or not collectives:
        parser.error(f"--collectives: one or more of {', '.join(TUNABLE)}; got "
                     f"{arguments.collectives!r}")
    if arguments.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {arguments.rounds}")
    if not arguments.tolerance >= 0:
        parser.error(f"--tolerance must be at least 0, got {arguments.tolerance}")
    output = arguments.output or tuning_file()
    if output is None:
        parser.error(f"{TUNING_FILE.name} is empty: name the table's file with --output")
    rt.init()  # every call below names its algorithm: no table decides anything here
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    settings = rt.current_settings()
    layout = layout_of(world().group, settings)
    say = print if rank == 0 else (lambda *_, **__: None)
    say(f"# ringtrain-bench --tune: {ranks} ranks, nodes {layout.describe()}; "
        f"float32, {arguments.rounds} rounds of {ITERATION_BOUNDS[0]}-{ITERATION_BOUNDS[1]} "
        f"calls (enough for {arguments.round_bytes} B) per algorithm, interleaved; "
        f"median round, microseconds per call (out of place + in place)", flush=True)
    table: dict[str, tuple[Range, ...]] = {}
    for collective in collectives:
        algorithms = candidates(collective, layout.pays_off)
        say(f"# {collective}: {', '.join(algorithms)}", flush=True)
        winners = []
        for nbytes in sizes:
            seconds = times(collective, nbytes, algorithms, arguments.rounds,
                            arguments.round_bytes, comm)
            chosen = winner(seconds, default_choice(collective, nbytes, ranks, settings),
                            arguments.tolerance)
            winners.append((nbytes, chosen))
            shown = "  ".join(f"{a} {seconds[a] * 1e6:.1f}" for a in algorithms)
            say(f"{collective:>13} {nbytes:>10}  {shown}  -> {chosen}", flush=True)
        table[collective] = ranges_of(winners, settings.segment_bytes)
    tuned = TuningTable(job_key(world().node_keys), {ranks: table},
                        shlex.join(["ringtrain-bench", "--tune", *argv]))
    if rank == 0:
        directory = os.path.dirname(os.path.abspath(output))
        os.makedirs(directory, exist_ok=True)
        write_atomically(output, tuned.dumps().encode())
        for collective, ranges in table.items():
            print(f"# {collective}: " + ", ".join(
                f"<= {r.max_bytes} B {r.algorithm}" for r in ranges), flush=True)
        print(f"# wrote {output}", file=sys.stdout, flush=True)
    rt.shutdown()
    return 0
