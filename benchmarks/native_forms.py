"""What MPI's own collectives cost in the forms ringtrain's ``native`` calls them: the
``v`` forms against the plain ones when every block has the same size, and a reused
receive buffer against a new one, in the same run.

    mpiexec -n 2 python benchmarks/native_forms.py
    mpiexec -n 4 python benchmarks/native_forms.py --megabytes 8 --rounds 5

Per round, in turn, each of: ``MPI_Allgather`` and ``MPI_Allgatherv`` of ``--megabytes``
MiB gathered (bytes, equal blocks), ``MPI_Alltoall`` and ``MPI_Alltoallv`` of that many
MiB sent per rank, ``MPI_Allgather`` into a buffer made for each call (as an out-of-place
collective's result is), and ringtrain's ``allgather`` with ``algorithm="native"`` and
``"ring"``. Times are the slowest rank's per call, median over the rounds; ratios are
to ``MPI_Allgather`` into a reused buffer (``MPI_Alltoall`` for the alltoalls).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import ringtrain as rt


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=32.0,
                        help="MiB gathered, and sent per rank by the alltoalls (default 32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5, help="timed calls per round")
    return parser.parse_args()


def seconds_per_call(call: Callable[[], object], calls: int, comm: MPI.Comm) -> float:
    """The slowest rank's seconds per call over ``calls`` calls."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return comm.allreduce((time.perf_counter() - start) / calls, MPI.MAX)


def main() -> None:
    arguments = parse_arguments()
    rt.init()
    comm = MPI.COMM_WORLD
    ranks = comm.Get_size()
    block = int(arguments.megabytes * (1 << 20)) // ranks
    total = block * ranks
    mine, gathered = np.ones(block, np.uint8), np.empty(total, np.uint8)
    send, received = np.ones(total, np.uint8), np.empty(total, np.uint8)
    blocks, offsets = [block] * ranks, [r * block for r in range(ranks)]
    forms: dict[str, Callable[[], object]] = {
        "MPI_Allgather": lambda: comm.Allgather(mine, gathered),
        "MPI_Allgatherv": lambda: comm.Allgatherv(mine, [gathered, blocks, offsets,
                                                         MPI.BYTE]),
        "MPI_Allgather, new buffer": lambda: comm.Allgather(mine, np.empty(total, np.uint8)),
        "rt.allgather native": lambda: rt.allgather(mine, algorithm="native"),
        "rt.allgather ring": lambda: rt.allgather(mine, algorithm="ring"),
        "MPI_Alltoall": lambda: comm.Alltoall(send, received),
        "MPI_Alltoallv": lambda: comm.Alltoallv([send, blocks, offsets, MPI.BYTE],
                                                [received, blocks, offsets, MPI.BYTE]),
    }
    for call in forms.values():
        call()
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(arguments.rounds):
        for name, call in forms.items():
            times[name].append(seconds_per_call(call, arguments.calls, comm))
    if comm.Get_rank() == 0:
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"# {ranks} ranks, {total / (1 << 20):.1f} MiB, median of {arguments.rounds} "
              f"rounds of {arguments.calls} calls, slowest rank; "
              f"{MPI.Get_library_version().splitlines()[0]}")
        for name, value in medians.items():
            baseline = medians["MPI_Alltoall" if "toall" in name else "MPI_Allgather"]
            print(f"{name:>26}: {value * 1e3:9.2f} ms  {value / baseline:5.2f}x the time")
    rt.shutdown()


if __name__ == "__main__":
    main()
