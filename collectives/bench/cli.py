"""``ringtrain-bench``: parse, measure size after size, print, write the files."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence

from mpi4py import MPI

from ... import collectives as rt
from . import report, tune
from .cases import CUDA, HOST, Case, Variant, bus_factor, native_runs, variants
from .devices import DeviceArrays, NoDevice, open_device
from .measure import Measurement, measure
from .options import AUTO_ITERATIONS, AUTO_ROUND_BYTES, NATIVE, Options, parse_options


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark on every rank; rank 0 prints. Returns 1 if any result was wrong.

    Bad arguments exit with status 2 and a one-line message before any measurement, and
    so does ``--device cuda`` where a rank finds no CUDA device. ``--tune`` measures
    every collective and writes the tuning table instead (see :mod:`.tune`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--tune" in argv:
        argv.remove("--tune")
        return tune.main(argv)
    options = parse_options(argv)
    rt.init()
    comm = MPI.COMM_WORLD
    rank, ranks = comm.Get_rank(), comm.Get_size()
    if options.collective == "broadcast" and not 0 <= options.root < ranks:
        if rank == 0:
            print(f"ringtrain-bench: error: root {options.root} is not a rank of {ranks}",
                  file=sys.stderr)
        return 2
    device = None
    if options.device == CUDA:
        device = open_devices(options, comm)
        if device is None:
            rt.shutdown()
            return 2
    description = describe(options, ranks, device, report.command_line(argv))
    with_ratio = NATIVE in options.algorithms and len(options.algorithms) > 1
    if rank == 0:
        print("\n".join(report.header_lines(description, with_ratio, device is not None)),
              flush=True)
    rows: list[report.Row] = []
    factor = bus_factor(options.collective, ranks)
    for nbytes in options.sizes:
        case = Case(options, nbytes, comm, device)
        for row in rows_of(case, measure(case, options), factor, with_ratio):
            rows.append(row)
            if rank == 0:
                print(report.format_row(row, with_ratio), flush=True)
    copy_line = device_copy_line(case, comm) if device is not None else None
    if rank == 0:
        print("\n".join(report.footer_lines(rows)), flush=True)
        if copy_line:
            print(copy_line, flush=True)
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


def device_copy_line(case: Case, comm: MPI.Comm, repeats: int = 20) -> str | None:
    """The footer line of a ``--device cuda`` run: rank 0's GPU copying the largest
    size's buffer device to device (one driver copy, the fastest way measured), alone
    (the other ranks wait), as GB/s of the bytes copied, the median of ``repeats``: the
    baseline of the GPU rows' busbw."""
    from ...kernels import device as kernels
    source, target = (case.device.bytes_of(array)
                      for array in (case.device_send, case.device_work))
    nbytes = min(kernels.nbytes_of(source), kernels.nbytes_of(target))
    comm.Barrier()
    line = None
    if comm.Get_rank() == 0 and nbytes:
        seconds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            kernels.copy_bytes(kernels.address_of(target), kernels.address_of(source), nbytes)
            kernels.synchronize_default()
            seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds[1:])
        line = (f"# Device-to-device copy: {nbytes / median / 1e9:.2f} GB/s ({nbytes} bytes, "
                f"rank 0's GPU alone, median of {repeats}, this run)")
    comm.Barrier()
    return line


def open_devices(options: Options, comm: MPI.Comm) -> DeviceArrays | None:
    """Every rank's GPU buffers for ``--device cuda``, or None on every rank when some
    rank has no usable device (rank 0 then prints one line saying why)."""
    try:
        device, problem = open_device(options.device_library, rt.local_rank()), None
    except NoDevice as error:
        device, problem = None, str(error)
    problems = comm.gather(problem, root=0)
    failed = comm.bcast(any(problems) if comm.Get_rank() == 0 else None, root=0)
    if not failed:
        return device
    if comm.Get_rank() == 0:
        failing = [rank for rank, found in enumerate(problems) if found]
        where = "" if len(failing) == len(problems) else \
            f"rank{'s' if len(failing) > 1 else ''} {', '.join(map(str, failing))}: "
        print(f"ringtrain-bench: error: --device cuda: {where}{problems[failing[0]]}",
              file=sys.stderr, flush=True)
    return None


def rows_of(case: Case, measured: dict[tuple[Variant, bool], Measurement], factor: float,
            with_ratio: bool) -> list[report.Row]:
    """The table rows of one size: one per algorithm (and kind of buffer), with both modes,
    the ratio to ``native`` and (``--device cuda``) the ratio to the same algorithm on host
    buffers, all measured in the same rounds."""
    options = case.options
    size = case.count * options.dtype.itemsize
    on_device = case.device is not None

    def busbw(key: tuple[Variant, bool]) -> float | None:
        point = measured.get(key)
        return report.result(size, point.seconds, factor, None, None).busbw \
            if point else None

    rows = []
    for variant in variants(options):
        parts = []
        for in_place in (False, True):
            point = measured.get((variant, in_place))
            if point is None:
                parts.append(None)
                continue
            baseline = busbw((Variant(NATIVE, HOST), in_place)) if with_ratio else None
            part = report.result(size, point.seconds, factor, point.wrong, baseline)
            if on_device:
                host = busbw((Variant(variant.algorithm, HOST), in_place))
                part.host_ratio = part.busbw / host if host else None
            parts.append(part)
        rows.append(report.Row(size, case.count, options.dtype.name, _redop(options),
                               options.root if options.collective == "broadcast" else -1,
                               variant.algorithm, parts[0], parts[1],
                               variant.memory if on_device else None))
    return rows


def _redop(options: Options) -> str:
    return options.op if options.collective in ("allreduce", "reducescatter") else "none"


def describe(options: Options, ranks: int, device: DeviceArrays | None = None,
             command: str | None = None) -> dict[str, str]:
    """What the header says about the run: versions, the command, the machine, ranks,
    nodes, buffers, method (and, with GPU buffers, what made them and whether MPI takes
    device pointers)."""
    library = MPI.Get_library_version().strip().splitlines()[0].strip()
    calls = options.iterations or (f"{AUTO_ITERATIONS[0]}-{AUTO_ITERATIONS[1]} (enough for "
                                   f"{AUTO_ROUND_BYTES >> 20} MiB)")
    compression = "" if options.compression == "none" else \
        f", {options.compression} compression (native uncompressed)"
    if NATIVE in options.algorithms and not native_runs(options):
        compression += f"; {NATIVE} n/a (MPI has no bfloat16 reduction)"
    buffers = f"host memory (numpy), {options.dtype.name}{compression}"
    if device is not None:
        buffers = (f"{CUDA}: {device.description}; {HOST}: numpy; "
                   f"{options.dtype.name}{compression}")
    method = (f"{options.warmup} warm-up calls, then {options.rounds} rounds of "
              f"{calls} calls per algorithm, interleaved; median round; "
              f"time averaged over ranks; GB = 1e9 B; '{NATIVE}' is the MPI library's "
              f"own collective called directly")
    description = {"ringtrain-bench": f"{options.collective}, ringtrain {_version()}"}
    if command:
        description["command"] = command
    description.update({"MPI": library, "machine": report.machine_description()})
    if device is not None:
        description["CUDA-aware MPI"] = _cuda_awareness()
        method += (f" on host buffers; '{report.HOST_RATIO}' is busbw on GPU buffers over "
                   f"the same algorithm's on host buffers")
    description.update({"ranks": f"{ranks} on {rt.cross_size()} node(s)",
                        "buffers": buffers, "method": method})
    return description


def _cuda_awareness() -> str:
    from ..cuda_aware import cuda_awareness
    try:
        return str(cuda_awareness())
    except ValueError as error:
        return f"unknown ({error})"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ringtrain")
    except PackageNotFoundError:
        return "unknown"
