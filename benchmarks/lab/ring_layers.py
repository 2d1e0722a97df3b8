"""What a ring allreduce costs at each layer, against the MPI library's own allreduce.

    mpiexec -n 2 python benchmarks/lab/ring_layers.py
    mpiexec -n 2 python benchmarks/lab/ring_layers.py --in-place
    mpiexec -n 4 python benchmarks/lab/ring_layers.py --sizes 1M,4M

For each size (float32, ``op=Sum``, out of place): MPI's own ``Allreduce`` through
mpi4py into a buffer it reuses; the ring's data phase alone, written in Python
(``_ring.allreduce``) and compiled (``_compiled_ring.ring_allreduce``), each into a
reused buffer with no agreement; and ``ringtrain.allreduce(x, algorithm="ring")``, the
whole call (its check and data phase in one compiled call, its result from the result
pool), as a training script makes it. The four are timed in turn within each round, so
that the machine's noise hits them alike. A time is the median over ``--rounds`` rounds
of rank 0's mean per call; ``x MPI`` is MPI's time over the whole call's (above 1:
ringtrain faster).

With ``--in-place`` every call reduces its input in place (``MPI_IN_PLACE``,
``ringtrain.allreduce_``) after filling it with ones, as a training step writes its
gradients before reducing them; the fill alone is timed too and taken off the others.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.collectives.algorithms import _compiled_ring, _ring
from ringtrain.collectives.world._world import world
from ringtrain.common.environment import parse_size

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/small_calls.py
from small_calls import mean_time  # noqa: E402


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", default="256K,512K,1M,4M",
                        help="bytes per rank, comma-separated (K, M suffixes)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--in-place", action="store_true",
                        help="reduce in place, the input refilled before every call")
    return parser.parse_args()


def layers(nbytes: int, comm: MPI.Comm, in_place: bool) -> dict[str, Callable[[], object]]:
    """Each layer's call for ``nbytes`` of float32 (in place: after refilling the input,
    whose time is the ``fill`` entry's)."""
    group = world().group
    segment_bytes = rt.current_settings().segment_bytes
    source = np.ones(nbytes // 4, np.float32)
    target = source if in_place else np.empty_like(source)

    def compiled() -> None:
        if not _compiled_ring.ring_allreduce(group, source, target, np.add, None,
                                             segment_bytes):
            raise SystemExit("the compiled ring cannot run here (RINGTRAIN_COMPILED_EXCHANGE=0?)")

    calls = {
        "MPI's own": lambda: comm.Allreduce(MPI.IN_PLACE if in_place else source, target,
                                            MPI.SUM),
        "Python ring": lambda: _ring.allreduce(group, source, target, np.add, None,
                                               segment_bytes),
        "compiled ring": compiled,
        "allreduce": (lambda: rt.allreduce_(source, rt.Sum, algorithm="ring")) if in_place
        else (lambda: rt.allreduce(source, rt.Sum, algorithm="ring")),
    }
    if not in_place:
        return calls

    def refilled(call: Callable[[], object]) -> Callable[[], object]:
        return lambda: (source.fill(1), call())

    return {"fill": lambda: source.fill(1),
            **{name: refilled(call) for name, call in calls.items()}}


def main() -> None:
    arguments = parse_arguments()
    rt.init()
    comm = MPI.COMM_WORLD
    sizes = [parse_size(size) for size in arguments.sizes.split(",")]
    names = [name for name in layers(sizes[0], comm, arguments.in_place) if name != "fill"]
    if comm.rank == 0:
        mode = "in place, refilled (the fill's time taken off)" if arguments.in_place \
            else "out of place"
        print(f"# {comm.size} ranks, float32 sum {mode}, median of {arguments.rounds} "
              f"rounds, µs per call")
        print(f"{'bytes':>10} " + " ".join(f"{name:>14}" for name in names) + f" {'x MPI':>7}")
    for nbytes in sizes:
        count = max(20, min(2000, (64 << 20) // nbytes))
        calls = layers(nbytes, comm, arguments.in_place)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(arguments.rounds):
            for name, call in calls.items():
                times[name].append(mean_time(call, count, comm, warmup=5))
        fill = statistics.median(times.pop("fill", [0.0]))
        medians = {name: (statistics.median(times[name]) - fill) * 1e6 for name in names}
        if comm.rank == 0:
            print(f"{nbytes:>10} " + " ".join(f"{medians[name]:14.1f}" for name in names)
                  + f" {medians[names[0]] / medians['allreduce']:7.2f}")


if __name__ == "__main__":
    main()
