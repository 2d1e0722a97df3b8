"""``ringtrain-bench``: parse, measure size after size, print, write the files."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mpi4py import MPI

from ... import collectives as rt
from . import report
from .cases import Case, bus_factor
from .measure import Measurement, measure
from .options import AUTO_ITERATIONS, AUTO_ROUND_BYTES, NATIVE, Options, parse_options


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark on every rank; rank 0 prints. Returns 1 if any result was wrong.

    Bad arguments exit with status 2 and a one-line message before any measurement.
    """
    options = parse_options(sys.argv[1:] if argv is None else argv)
    rt.init()
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    if options.collective == "broadcast" and not 0 <= options.root < ranks:
        if rank == 0:
            print(f"ringtrain-bench: error: root {options.root} is not a rank of {ranks}",
                  file=sys.stderr)
        return 2
    description = describe(options, ranks)
    with_ratio = NATIVE in options.algorithms and len(options.algorithms) > 1
    if rank == 0:
        print("\n".join(report.header_lines(description, with_ratio)), flush=True)
    rows: list[report.Row] = []
    factor = bus_factor(options.collective, ranks)
    for nbytes in options.sizes:
        case = Case(options, nbytes, comm)
        for row in rows_of(case, measure(case, options), factor, with_ratio):
            rows.append(row)
            if rank == 0:
                print(report.format_row(row, with_ratio), flush=True)
    if rank == 0:
        print("\n".join(report.footer_lines(rows)), flush=True)
        if options.csv:
            report.write_csv(options.csv, rows)
        if options.json:
            report.write_json(options.json, description, rows)
        if options.plot:
            report.plot(options.plot, f"{options.collective}, {ranks} ranks", rows)
    wrong = any(part.wrong for row in rows for part in (row.out_of_place, row.in_place)
                if part is not None)
    rt.shutdown()
    return 1 if wrong else 0


def rows_of(case: Case, measured: dict[tuple[str, bool], Measurement], factor: float,
            with_ratio: bool) -> list[report.Row]:
    """The table rows of one size: one per algorithm, with both modes and the ratio to
    ``native`` measured in the same rounds."""
    options = case.options
    size = case.count * options.dtype.itemsize
    rows = []
    for algorithm in options.algorithms:
        parts = []
        for in_place in (False, True):
            point = measured.get((algorithm, in_place))
            if point is None:
                parts.append(None)
                continue
            baseline = measured.get((NATIVE, in_place)) if with_ratio else None
            baseline_busbw = report.result(size, baseline.seconds, factor, None, None).busbw \
                if baseline else None
            parts.append(report.result(size, point.seconds, factor, point.wrong,
                                       baseline_busbw))
        rows.append(report.Row(size, case.count, options.dtype.name, _redop(options),
                               options.root if options.collective == "broadcast" else -1,
                               algorithm, parts[0], parts[1]))
    return rows


def _redop(options: Options) -> str:
    return options.op if options.collective in ("allreduce", "reducescatter") else "none"


def describe(options: Options, ranks: int) -> dict[str, str]:
    """What the header says about the run: versions, ranks, nodes, buffers, method."""
    library = MPI.Get_library_version().strip().splitlines()[0].strip()
    calls = options.iterations or (f"{AUTO_ITERATIONS[0]}-{AUTO_ITERATIONS[1]} (enough for "
                                   f"{AUTO_ROUND_BYTES >> 20} MiB)")
    compression = "" if options.compression == "none" else \
        f", {options.compression} compression (native uncompressed)"
    return {
        "ringtrain-bench": f"{options.collective}, ringtrain {_version()}",
        "MPI": library,
        "ranks": f"{ranks} on {rt.cross_size()} node(s)",
        "buffers": f"host memory (numpy), {options.dtype.name}{compression}",
        "method": (f"{options.warmup} warm-up calls, then {options.rounds} rounds of "
                   f"{calls} calls per algorithm, interleaved; median round; "
                   f"time averaged over ranks; GB = 1e9 B; '{NATIVE}' is the MPI library's "
                   f"own collective called directly"),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ringtrain")
    except PackageNotFoundError:
        return "unknown"
