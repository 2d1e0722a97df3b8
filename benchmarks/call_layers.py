"""Where a small call's time goes: a broadcast of a few bytes, layer by layer, against MPI's own.

    mpiexec -n 2 python benchmarks/call_layers.py

A small broadcast on one node is one compiled call (the agreement's check and the move
through the node's mailboxes) under a few layers of Python. Each row times the call
from one layer down, in turn within each round so that the machine's noise hits all
alike: MPI's own ``MPI_Bcast`` into a buffer it reuses; the compiled call alone; the
checked collective around it (the activity record the stall inspector reads, the
status); the whole ``ringtrain.broadcast`` (plan lookup, result, program order). The
whole allgather and alltoall of as many bytes follow for comparison. A time is the
median over ``--rounds`` rounds of rank 0's mean per call over ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.collectives import _broadcast
from ringtrain.collectives._checks import byte_view


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--elements", type=int, default=2, help="float32 values")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=9)
    return parser.parse_args()


def layers(elements: int, comm: MPI.Comm) -> dict[str, Callable[[], object]]:
    """Each layer's call, outermost last; empty where the broadcast does not take the
    compiled call through the mailboxes (one rank, or no shared memory)."""
    data, out = np.ones(elements, np.float32), np.empty(elements, np.float32)
    rt.broadcast(data, 0)  # makes the plan
    plan = _broadcast._PLANS.get(_broadcast._key("broadcast", False, data, 0, None, None,
                                                 None), None, "broadcast", None)
    checked = getattr(plan.carried, "_held", None) if plan is not None and \
        plan.carried is not None else None
    if checked is None:
        return {}
    header, source, result = checked.call.fresh_array, byte_view(data), byte_view(out)
    return {
        "MPI_Bcast": lambda: comm.Bcast(out, 0),
        "compiled call": lambda: checked._run(header, source, result),
        "checked collective": lambda: checked.run(source, result),
        "rt.broadcast": lambda: rt.broadcast(data, 0),
        "rt.allgather": lambda: rt.allgather(data),
        "rt.alltoall": lambda: rt.alltoall(data),
    }


def main() -> None:
    arguments = parse_arguments()
    rt.init()
    comm = MPI.COMM_WORLD
    calls = layers(arguments.elements, comm)
    if not calls:
        if comm.rank == 0:
            print("the broadcast does not take the compiled call through the mailboxes here "
                  "(run 2 or more ranks on one node)")
        rt.shutdown()
        return
    times: dict[str, list[float]] = {layer: [] for layer in calls}
    for _ in range(arguments.rounds):
        for layer, call in calls.items():
            for _ in range(50):
                call()
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(arguments.calls):
                call()
            times[layer].append((time.perf_counter() - start) / arguments.calls)
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {arguments.elements} float32, median of "
              f"{arguments.rounds} rounds of {arguments.calls} calls")
        print(f"{'layer':>20} {'us':>7} {'x MPI':>7}")
        mpi = statistics.median(times["MPI_Bcast"])
        for layer, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{layer:>20} {median * 1e6:7.2f} {median / mpi:7.2f}")
    rt.shutdown()


if __name__ == "__main__":
    main()
