"""The command line of ``ringtrain-bench``: parsed and checked before any measurement."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...kernels import BFLOAT16, is_floating
from ..config import ALGORITHMS, parse_size
from .devices import LIBRARIES

COLLECTIVES = ("allreduce", "broadcast", "allgather", "reducescatter", "alltoall")

DATATYPES = {
    "float": np.float32, "float32": np.float32,
    "half": np.float16, "float16": np.float16,
    "bfloat16": BFLOAT16, "bf16": BFLOAT16,
    "double": np.float64, "float64": np.float64,
    "int8": np.int8, "uint8": np.uint8, "int32": np.int32, "int": np.int32,
    "int64": np.int64,
}
"""Datatype names: nccl-tests' and numpy's (bfloat16 is ``ml_dtypes.bfloat16``)."""

OPS = ("sum", "prod", "max", "min", "avg", "adasum")
REDUCING = ("allreduce", "reducescatter")

AUTO_ROUND_BYTES = 32 << 20
AUTO_ITERATIONS = (20, 2000)

NATIVE = "native"
"""The MPI library's own collective, called directly through mpi4py: the baseline."""

ADASUM_ALGORITHMS = ("auto", NATIVE)
"""What ``-o adasum`` measures: ringtrain's Adasum (its own algorithm, asked as ``auto``)
and MPI's sum of the same buffer as the baseline (MPI has no Adasum)."""


@dataclass(frozen=True)
class Options:
    """What to measure.

    Attributes:
        collective: one of :data:`COLLECTIVES`.
        sizes: message sizes in bytes, ascending (nccl-tests' meaning per collective).
        iterations: timed calls per round, or None to choose per size (see
            :func:`iterations_for`).
        warmup, rounds: untimed calls first, and rounds per size (the median round
            is reported).
        check: verify results against a reference after timing each size.
        dtype, op, root: datatype, reduction op name, broadcast root.
        algorithms: ringtrain algorithm names and/or ``native``, measured in turn.
        compression: ``none``, ``fp16`` or ``bf16`` (allreduce and reducescatter,
            float32 only).
        csv, json, plot: output files, or None.
        device: ``cpu`` (numpy buffers), or ``cuda``: every ringtrain algorithm on GPU
            buffers and on numpy buffers, ``native`` on numpy buffers.
        device_library: which library makes the GPU buffers (see
            :data:`~.devices.LIBRARIES`); ``auto`` for a CPU run.
        round_bytes, iteration_bounds: without ``iterations``, a round makes enough
            calls to move ``round_bytes``, within ``iteration_bounds`` (fewest, most).
        in_place: also time the in-place form where the collective has one.
    """

    collective: str
    sizes: tuple[int, ...]
    iterations: int | None
    warmup: int
    rounds: int
    check: bool
    dtype: np.dtype
    op: str
    root: int
    algorithms: tuple[str, ...]
    compression: str
    csv: str | None
    json: str | None
    plot: str | None
    device: str = "cpu"
    device_library: str = "auto"
    round_bytes: int = AUTO_ROUND_BYTES
    iteration_bounds: tuple[int, int] = AUTO_ITERATIONS
    in_place: bool = True


def iterations_for(options: Options, nbytes: int) -> int:
    """Timed calls per round: ``-n`` if given, else enough calls to move
    ``options.round_bytes`` (many for small messages, whose few microseconds would
    otherwise drown in the start and end of the round), within
    ``options.iteration_bounds``."""
    if options.iterations is not None:
        return options.iterations
    low, high = options.iteration_bounds
    return max(low, min(high, options.round_bytes // max(nbytes, 1)))


def sizes_between(minimum: int, maximum: int, factor: int) -> tuple[int, ...]:
    """``minimum``, ``minimum * factor``, ... up to ``maximum`` (inclusive)."""
    if minimum < 1 or maximum < minimum:
        raise ValueError(f"need 1 <= minbytes <= maxbytes, got {minimum} and {maximum}")
    if factor < 2:
        raise ValueError(f"stepfactor must be at least 2, got {factor}")
    sizes, size = [], minimum
    while size <= maximum:
        sizes.append(size)
        size *= factor
    return tuple(sizes)


def size_argument(text: str) -> int:
    """A size on the command line (see :func:`parse_size`), or an argparse error."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_size_arguments(parser: argparse.ArgumentParser, maxbytes: int, stepfactor: int,
                       range_help: str) -> None:
    """``-b/--minbytes`` (default 8), ``-e/--maxbytes`` and ``-f/--stepfactor``."""
    parser.add_argument("-b", "--minbytes", type=size_argument, default=8,
                        help="smallest size (K/M/G suffixes, binary units; default 8)")
    parser.add_argument("-e", "--maxbytes", type=size_argument, default=maxbytes,
                        help=f"largest size (default {maxbytes >> 20}M){range_help}")
    parser.add_argument("-f", "--stepfactor", type=int, default=stepfactor,
                        help=f"multiply the size by this much per step (default {stepfactor})")


def parsed_sizes(parser: argparse.ArgumentParser, arguments: argparse.Namespace,
                 sizes: Callable[[int, int, int], tuple[int, ...]]) -> tuple[int, ...]:
    """``sizes(minbytes, maxbytes, stepfactor)``; a ValueError ends the program with
    status 2 and its message."""
    try:
        return sizes(arguments.minbytes, arguments.maxbytes, arguments.stepfactor)
    except ValueError as error:
        parser.error(str(error))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (nccl-tests' short flags)."""
    parser = argparse.ArgumentParser(
        prog="ringtrain-bench",
        description="Collective microbenchmarks: time, algbw and busbw per size, with the "
                    "MPI library's own collective ('native') measured in the same run "
                    "(and, with --device cuda, each algorithm on GPU and on host buffers).")
    parser.add_argument("collective", choices=COLLECTIVES)
    add_size_arguments(parser, 32 << 20, 2, "")
    parser.add_argument("-n", "--iters", type=int, default=None,
                        help="timed calls per round (default: enough to move "
                             f"{AUTO_ROUND_BYTES >> 20} MiB, from {AUTO_ITERATIONS[0]} "
                             f"to {AUTO_ITERATIONS[1]} calls)")
    parser.add_argument("-w", "--warmup", type=int, default=5,
                        help="untimed calls before timing (default 5)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per size, algorithms interleaved; the median is "
                             "reported (default 3)")
    parser.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                        help="check results after timing (default 1)")
    parser.add_argument("-d", "--datatype", choices=sorted(DATATYPES), default="float")
    parser.add_argument("-o", "--op", choices=OPS, default="sum",
                        help="reduction (default sum); adasum: allreduce only, with MPI's "
                             "sum of the same buffer as the native baseline")
    parser.add_argument("-r", "--root", type=int, default=0, help="broadcast root")
    parser.add_argument("--algo", default="auto,native",
                        help="comma-separated algorithms (auto, ring, recursive_doubling, "
                             "hierarchical, node_leader, pipeline, binomial, pairwise, "
                             "native; default auto,native)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: numpy buffers; cuda: each algorithm also on GPU buffers, "
                             "with ratio column xhost = busbw on GPU buffers / busbw of "
                             "the same algorithm on numpy buffers ('native' stays on host "
                             "buffers; default cpu)")
    parser.add_argument("--device-library", choices=LIBRARIES, default="auto",
                        help="what makes the GPU buffers for --device cuda: CuPy arrays, "
                             "torch CUDA tensors or numba device arrays (default auto: "
                             "CuPy if it sees a GPU, else numba)")
    parser.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none")
    parser.add_argument("--csv", metavar="FILE")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--plot", metavar="FILE.png")
    return parser


def parse_options(argv: Sequence[str] | None = None) -> Options:
    """Parse and check the command line; errors exit with status 2 and one line."""
    parser = build_parser()
    arguments = parser.parse_args(argv)
    sizes = parsed_sizes(parser, arguments, sizes_between)
    algorithms = tuple(dict.fromkeys(a.strip() for a in arguments.algo.split(",") if a.strip()))
    offered = ALGORITHMS[arguments.collective] + (NATIVE,)
    unknown = [a for a in algorithms if a not in offered]
    if not algorithms or unknown:
        parser.error(f"{arguments.collective} offers the algorithms {', '.join(offered)}; "
                     f"got {arguments.algo!r}")
    dtype = np.dtype(DATATYPES[arguments.datatype])
    if arguments.collective in REDUCING and arguments.op == "avg" and not is_floating(dtype):
        parser.error(f"avg needs a floating datatype, got {arguments.datatype}")
    if arguments.op == "adasum":
        if arguments.collective != "allreduce" or not is_floating(dtype) or \
                arguments.compression != "none" or arguments.device != "cpu":
            parser.error("-o adasum measures allreduce of a floating datatype on host "
                         "buffers, without compression")
        if any(a not in ADASUM_ALGORITHMS for a in algorithms):
            parser.error(f"-o adasum runs its own algorithm: --algo takes "
                         f"{' and '.join(ADASUM_ALGORITHMS)} (MPI's sum, the baseline), got "
                         f"{arguments.algo!r}")
    compressible = arguments.collective in ("allreduce", "reducescatter") and \
        dtype == np.float32
    if arguments.compression != "none" and not compressible:
        parser.error("--compression applies to allreduce and reducescatter of float32 "
                     "(-d float)")
    if arguments.compression != "none" and arguments.op == "prod":
        parser.error("--compression supports sum, avg, min and max, not prod")
    if arguments.device != "cuda" and "ipc" in algorithms:
        parser.error("--algo ipc reduces GPU buffers: add --device cuda")
    if arguments.device == "cuda" and algorithms == (NATIVE,):
        parser.error("--device cuda measures ringtrain's algorithms on GPU buffers; --algo "
                     "names only native, which runs on host buffers")
    if arguments.device != "cuda" and arguments.device_library != "auto":
        parser.error("--device-library applies to --device cuda")
    if arguments.device == "cuda" and dtype == BFLOAT16 and \
            arguments.device_library not in ("torch", "numba"):
        parser.error("-d bfloat16 with --device cuda needs --device-library torch or numba "
                     "(CuPy has no bfloat16)")
    if arguments.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'ringtrain[plot]'")
    iterations = 1 if arguments.iters is None else arguments.iters
    for flag, value, least in (("-n/--iters", iterations, 1),
                               ("-w/--warmup", arguments.warmup, 0),
                               ("--rounds", arguments.rounds, 1)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    return Options(arguments.collective, sizes, arguments.iters, arguments.warmup,
                   arguments.rounds, bool(arguments.check), dtype, arguments.op,
                   arguments.root, algorithms, arguments.compression, arguments.csv,
                   arguments.json, arguments.plot, arguments.device,
                   arguments.device_library)
