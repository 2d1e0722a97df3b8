"""Where a call's time goes: a small broadcast and allgather and mid-size alltoalls, layer
by layer, against MPI's own.

    mpiexec -n 2 python benchmarks/lab/call_layers.py

A small broadcast on one node is one compiled call (the agreement's check and the move
through the node's mailboxes) under a few layers of Python. Each row times the call
from one layer down, in turn within each round so that the machine's noise hits all
alike: MPI's own ``MPI_Bcast`` into a buffer it reuses, and behind an ``MPI_Barrier``
(MPI's own made to wait for every rank, as the check does); the compiled call alone;
the fewest steps a checked call from Python takes (a new result, the byte views, a
lock for program order, the record the stall inspector reads, the compiled call); the
checked collective (the record, the status); the whole ``ringtrain.broadcast`` (plan
lookup, result, program order). The whole allgather and alltoall of as many bytes
follow for comparison. One more row is what the check would cost made by MPI:
``MPI_Allreduce`` of 16 bytes, MPI's own collective in which every rank hears from
every rank, as a rank must before it knows that every rank made its call.

An allgather of as many bytes per rank is timed the same way: ``MPI_Allgather`` into a
buffer it reuses, the compiled call alone (the check, every rank's row count and rows
through the mailboxes), the whole ``ringtrain.allgather``.

An alltoall of ``--alltoall-sizes`` bytes per rank (MPI's own behind the check, on one
node) is timed the same way: ``MPI_Alltoall`` into a buffer it reuses, into a new numpy
array, into a result from ringtrain's pool; the checked collective into a reused buffer
and into a pooled result; the whole ``ringtrain.alltoall``.

A time is the median over ``--rounds`` rounds of rank 0's mean per call.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.collectives import _allgather, _alltoall, _broadcast
from ringtrain.collectives.base._activity import ACTIVITY
from ringtrain.collectives.base._checks import byte_view
from ringtrain.collectives.base._result_pool import RESULTS


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--elements", type=int, default=2,
                        help="float32 values of the small broadcast")
    parser.add_argument("--calls", type=int, default=4000, help="small calls per round")
    parser.add_argument("--alltoall-sizes", default="131072,524288",
                        help="bytes per rank of the alltoalls (empty: none)")
    parser.add_argument("--rounds", type=int, default=9)
    return parser.parse_args()


def broadcast_layers(elements: int, comm: MPI.Comm) -> dict[str, Callable[[], object]]:
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
    ranks, fields, compiled = checked.group.world_ranks, checked.call.fields, checked._run
    order = threading.Lock()
    header16 = np.zeros(2, np.int64)

    def fewest_steps() -> np.ndarray:
        output = np.empty(data.shape, data.dtype)
        with order:
            ACTIVITY.enter(ranks, fields)
            try:
                compiled(header, byte_view(data), byte_view(output))
            finally:
                ACTIVITY.agreed()
        return output

    return {
        "MPI_Bcast": lambda: comm.Bcast(out, 0),
        "Barrier + Bcast": lambda: (comm.Barrier(), comm.Bcast(out, 0)),
        "Allreduce 16 B": lambda: comm.Allreduce(MPI.IN_PLACE, header16, MPI.MAX),
        "compiled call": lambda: checked._run(header, source, result),
        "fewest steps": fewest_steps,
        "checked collective": lambda: checked.run(source, result),
        "rt.broadcast": lambda: rt.broadcast(data, 0),
        "rt.allgather": lambda: rt.allgather(data),
        "rt.alltoall": lambda: rt.alltoall(data),
    }


def allgather_layers(elements: int, comm: MPI.Comm) -> dict[str, Callable[[], object]]:
    """The layers of an allgather of ``elements`` float32 per rank; empty where its rows
    do not ride in the compiled call through the mailboxes."""
    data, out = np.ones(elements, np.float32), np.empty(elements * comm.size, np.float32)
    rt.allgather(data)  # makes the plan
    plan = _allgather._PLANS.get(_allgather._key(False, data, None, None, None), None,
                                 "allgather", None)
    gather = None if plan is None else plan.carried
    checked = None if gather is None or not gather.carries_data else gather._held
    if checked is None:
        return {}
    header, source = checked.call.fresh_array, gather._source
    result = np.empty(source.size, np.uint8)
    return {
        "MPI_Allgather": lambda: comm.Allgather(data, out),
        "compiled call": lambda: checked._run(header, source, result),
        "rt.allgather": lambda: rt.allgather(data),
    }


def alltoall_layers(nbytes: int, comm: MPI.Comm) -> dict[str, Callable[[], object]]:
    """The layers of an alltoall of ``nbytes`` per rank; empty where ``auto`` does not
    take MPI's own behind the check."""
    data, out = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    rt.alltoall(data)  # makes the plan
    plan = _alltoall._PLANS.get(_alltoall._key(False, data, None, None, None), None,
                                "alltoall", None)
    checked = None if plan is None else plan.checked
    if checked is None or plan.even_move.algorithm != "native":
        return {}
    source, result = byte_view(data), byte_view(out)
    return {
        "MPI_Alltoall": lambda: comm.Alltoall(data, out),
        "into np.empty": lambda: comm.Alltoall(data, np.empty(data.shape, data.dtype)),
        "into pooled": lambda: comm.Alltoall(data, RESULTS.empty(data.shape, data.dtype)),
        "checked": lambda: checked.run(source, result),
        "checked, pooled": lambda: checked.run(
            source, byte_view(RESULTS.empty(data.shape, data.dtype))),
        "rt.alltoall": lambda: rt.alltoall(data),
    }


def timed(calls: dict[str, Callable[[], object]], count: int, rounds: int,
          comm: MPI.Comm) -> dict[str, float]:
    """Median seconds per call of each of ``calls``, timed in turn within each round."""
    times: dict[str, list[float]] = {layer: [] for layer in calls}
    for _ in range(rounds):
        for layer, call in calls.items():
            for _ in range(min(50, count)):
                call()
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(count):
                call()
            times[layer].append((time.perf_counter() - start) / count)
    return {layer: statistics.median(seconds) for layer, seconds in times.items()}


def report(title: str, medians: dict[str, float]) -> None:
    """Each layer's time, and over the first layer's (MPI's own)."""
    print(title)
    print(f"{'layer':>20} {'us':>8} {'x MPI':>7}")
    mpi = next(iter(medians.values()))
    for layer, seconds in medians.items():
        print(f"{layer:>20} {seconds * 1e6:8.2f} {seconds / mpi:7.2f}")


def main() -> None:
    arguments = parse_arguments()
    rt.init()
    comm = MPI.COMM_WORLD
    calls = broadcast_layers(arguments.elements, comm)
    if not calls:
        if comm.rank == 0:
            print("the broadcast does not take the compiled call through the mailboxes here "
                  "(run 2 or more ranks on one node)")
        rt.shutdown()
        return
    medians = timed(calls, arguments.calls, arguments.rounds, comm)
    if comm.rank == 0:
        report(f"# {comm.size} ranks, broadcast of {arguments.elements} float32, median of "
               f"{arguments.rounds} rounds of {arguments.calls} calls", medians)
    calls = allgather_layers(arguments.elements, comm)
    if calls:
        medians = timed(calls, arguments.calls, arguments.rounds, comm)
        if comm.rank == 0:
            report(f"# {comm.size} ranks, allgather of {arguments.elements} float32 per rank, "
                   f"median of {arguments.rounds} rounds of {arguments.calls} calls", medians)
    for nbytes in [int(size) for size in arguments.alltoall_sizes.split(",") if size]:
        calls = alltoall_layers(nbytes, comm)
        count = max(50, (20 << 20) // nbytes)
        if not calls:
            if comm.rank == 0:
                print(f"# alltoall of {nbytes} bytes: not MPI's own behind the check here")
            continue
        medians = timed(calls, count, arguments.rounds, comm)
        if comm.rank == 0:
            report(f"# alltoall of {nbytes} bytes per rank, median of {arguments.rounds} "
                   f"rounds of {count} calls", medians)
    rt.shutdown()


if __name__ == "__main__":
    main()
