"""Per-call time of every collective's small calls against the MPI library's own.

    mpiexec -n 2 python benchmarks/small_calls.py
    mpiexec -n 4 python benchmarks/small_calls.py --elements 512

Each rank gives ``--elements`` float32 values (allreduce, broadcast, allgather) or that
many per rank (reducescatter, alltoall): ``ringtrain``'s call (``op=Sum``, ``auto``, out
of place, as a training script calls it) and mpi4py's call of the MPI library's own
collective into a buffer it reuses, timed in turn within each round so that the
machine's noise hits both alike. A time is the median over ``--rounds`` rounds of rank
0's mean per call over ``--calls`` calls; ``x MPI`` is ringtrain's time over MPI's.
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--elements", type=int, default=2, help="float32 values per rank")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


def calls(elements: int, comm: MPI.Comm) -> dict[str, tuple[Callable[[], object],
                                                           Callable[[], object]]]:
    """For each collective, ringtrain's call and the MPI library's own."""
    size = comm.Get_size()
    mine = np.ones(elements, np.float32)
    out = np.empty(elements, np.float32)
    everyone = np.ones(elements * size, np.float32)
    gathered = np.empty(elements * size, np.float32)
    return {
        "allreduce": (lambda: rt.allreduce(mine, rt.Sum),
                      lambda: comm.Allreduce(mine, out, MPI.SUM)),
        "broadcast": (lambda: rt.broadcast(mine, 0), lambda: comm.Bcast(out, 0)),
        "allgather": (lambda: rt.allgather(mine), lambda: comm.Allgather(mine, gathered)),
        "reducescatter": (lambda: rt.reducescatter(everyone, rt.Sum),
                          lambda: comm.Reduce_scatter_block(everyone, out, MPI.SUM)),
        "alltoall": (lambda: rt.alltoall(everyone), lambda: comm.Alltoall(everyone, gathered)),
    }


def mean_time(call: Callable[[], object], count: int, comm: MPI.Comm,
              warmup: int = 50) -> float:
    """Seconds per call on this rank after ``warmup`` calls (at most ``count``), the
    ranks starting together."""
    for _ in range(min(count, warmup)):
        call()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - start) / count


def main() -> None:
    arguments = parse_arguments()
    rt.init()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {arguments.elements} float32 per rank, "
              f"median of {arguments.rounds} rounds of {arguments.calls} calls")
        print(f"{'collective':>14} {'ringtrain us':>13} {'MPI us':>8} {'x MPI':>7}")
    for collective, (ours, theirs) in calls(arguments.elements, comm).items():
        times: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(arguments.rounds):
            times["ours"].append(mean_time(ours, arguments.calls, comm))
            times["theirs"].append(mean_time(theirs, arguments.calls, comm))
        ringtrain, mpi = (statistics.median(times[k]) * 1e6 for k in ("ours", "theirs"))
        if comm.rank == 0:
            print(f"{collective:>14} {ringtrain:13.1f} {mpi:8.1f} {ringtrain / mpi:7.2f}")


if __name__ == "__main__":
    main()
