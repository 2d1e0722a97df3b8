"""Traffic between hosts per allreduce, from the hosts' link byte counters.

Run on simulated hosts (see tests/test_hierarchical.py), nodes of equal size, ranks
placed host by host:  mpiexec -n K python tests/mpi/hierarchical_hosts.py

Each host's first rank reads its link's transmit counter before and after a few
allreduces of S bytes; the bytes per allreduce must match each algorithm's model:
a flat ring carries 2(p-1)/p*S out of each host, the hierarchical schedules
2(N-1)/N*S (N hosts), and with fp16 between the hosts half of that.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.collectives.world._topology import layout_of
from ringtrain.collectives.world._world import world
from _harness import check, log, main

COUNTER = Path("/sys/class/net/eth0/statistics/tx_bytes")
NBYTES = 8 << 20
CALLS = 3
OVERHEAD = 0.12
"""Headers (TCP/IP, ~4%), MPI's own messages and the agreement: at most this much more."""


def transmitted(comm: MPI.Comm, local: MPI.Comm, call) -> float:
    """Bytes per call sent by this rank's host, as measured on its link."""
    comm.Barrier()
    before = int(COUNTER.read_text()) if local.Get_rank() == 0 else 0
    for _ in range(CALLS):
        call()
    comm.Barrier()
    after = int(COUNTER.read_text()) if local.Get_rank() == 0 else 0
    return local.bcast((after - before) / CALLS, root=0)


@check(min_size=2)
def link_bytes_match_each_algorithms_model() -> None:
    layout = layout_of(world().group, rt.current_settings())
    nodes, p = len(layout.nodes), rt.size()
    assert nodes > 1 and layout.uniform, f"needs equal hosts, got {layout.describe()}"
    assert COUNTER.exists(), f"{COUNTER} is missing: not on a simulated host"
    x = np.ones(NBYTES // 4, np.float32)
    comm, local = MPI.COMM_WORLD, world().local_comm
    cases = {
        "ring": (dict(algorithm="ring"), 2 * (p - 1) / p),
        "hierarchical": (dict(algorithm="hierarchical"), 2 * (nodes - 1) / nodes),
        "node_leader": (dict(algorithm="node_leader"), 2 * (nodes - 1) / nodes),
        "hierarchical fp16": (dict(algorithm="hierarchical", compression=rt.Compression.fp16),
                              (nodes - 1) / nodes),
    }
    measured = {}
    for label, (arguments, model) in cases.items():
        rt.allreduce(x, rt.Sum, name="bytes", **arguments)  # builds the communicators
        ratio = transmitted(comm, local, lambda: rt.allreduce(x, rt.Sum, name="bytes",
                                                              **arguments)) / NBYTES
        measured[label] = ratio
        everyone = comm.allgather(ratio)
        if rt.rank() == 0:
            shown = ", ".join(f"{r:.3f}" for r in everyone)
            log(f"rank 0: {label}: {shown} x S out of each rank's host (model {model:.3f})")
        for r in everyone:
            assert model * 0.97 <= r <= model * (1 + OVERHEAD), \
                f"{label}: {r:.3f} x S left a host, the model says {model:.3f}"
    local_size = len(layout.nodes[0])
    saved = measured["hierarchical"] / measured["ring"]
    expected = (2 * (nodes - 1) / nodes) / (2 * (p - 1) / p)
    assert saved <= expected * 1.05, \
        f"hierarchical / ring = {saved:.3f}, expected {expected:.3f} (local size {local_size})"


if __name__ == "__main__":
    main()
