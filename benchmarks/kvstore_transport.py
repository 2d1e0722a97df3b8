"""How the async KVStore's workers should reach its servers: point-to-point or one-sided.

Run: ``mpiexec -n 3 python benchmarks/kvstore_transport.py`` (the last rank serves, the
others push float32 arrays to it as fast as they can, each push added to the held value).

- ``p2p``: what ringtrain.kvstore does: a header and the data with ``Send``; the server
  waits in ``Recv(ANY_SOURCE)`` and adds each push as it arrives.
- ``rma``: the server exposes its value in an MPI window; a push is ``Lock(shared)``,
  ``Accumulate(SUM)``, ``Unlock``; the server waits in a barrier (inside MPI).
- ``rma busy``: the same, while the server computes in Python between short visits to MPI
  (``Test`` every ~2 ms), as a server that also ran an optimizer would: passive-target
  RMA then only completes while the target is inside MPI (MPICH without
  ``MPIR_CVAR_ASYNC_PROGRESS=1``).

Prints pushes/s per worker and the ratio to ``p2p`` measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from ringtrain.common.environment import parse_size

REQUEST, DATA = 1, 2


def p2p(comm: MPI.Comm, server: int, data: np.ndarray, pushes: int) -> float:
    workers = comm.Get_size() - 1
    if comm.Get_rank() == server:
        value = np.zeros_like(data)
        grad = np.empty_like(data)
        head = np.empty(4, np.int64)
        status = MPI.Status()
        for _ in range(workers * pushes):
            comm.Recv(head, MPI.ANY_SOURCE, REQUEST, status)
            comm.Recv(grad, status.Get_source(), DATA)
            value += grad
        assert value[0] == workers * pushes
        return 0.0
    head = np.zeros(4, np.int64)
    start = time.perf_counter()
    for _ in range(pushes):
        comm.Send(head, server, REQUEST)
        comm.Send(data, server, DATA)
    return pushes / (time.perf_counter() - start)


def rma(comm: MPI.Comm, server: int, data: np.ndarray, pushes: int, busy: bool) -> float:
    workers = comm.Get_size() - 1
    serving = comm.Get_rank() == server
    value = np.zeros_like(data) if serving else None
    window = MPI.Win.Create(value if serving else None, data.itemsize, comm=comm)
    rate = 0.0
    if serving:
        done = comm.Ibarrier()
        if busy:
            work = np.random.default_rng(0).standard_normal(20_000)
            while not done.Test():
                deadline = time.perf_counter() + 0.002
                while time.perf_counter() < deadline:
                    np.sin(work, out=work)
        else:
            done.Wait()
        assert value[0] == workers * pushes
    else:
        start = time.perf_counter()
        for _ in range(pushes):
            window.Lock(server, MPI.LOCK_SHARED)
            window.Accumulate(data, server, op=MPI.SUM)
            window.Unlock(server)
        rate = pushes / (time.perf_counter() - start)
        comm.Ibarrier().Wait()
    window.Free()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,256K,4M", help="bytes per push")
    parser.add_argument("--seconds", type=float, default=0.5, help="about this long per case")
    options = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_size() < 2:
        raise SystemExit("run with at least 2 ranks (workers + 1 server)")
    server = comm.Get_size() - 1
    if comm.Get_rank() == 0:
        library = MPI.Get_library_version().splitlines()[0]
        print(f"{comm.Get_size() - 1} worker(s), 1 server; {library}")
        print(f"{'bytes':>9} {'transport':>10} {'pushes/s':>10} {'ratio':>6}")
    for text in options.sizes.split(","):
        nbytes = parse_size(text)
        data = np.ones(nbytes // 4, np.float32)
        pushes = max(4, min(2000, int(options.seconds * 2e9 / max(nbytes, 4096) / 50)))
        rates = {}
        for name, run in (("p2p", lambda: p2p(comm, server, data, pushes)),
                          ("rma", lambda: rma(comm, server, data, pushes, False)),
                          ("rma busy", lambda: rma(comm, server, data, pushes, True))):
            comm.Barrier()
            rate = run()
            rates[name] = np.mean([r for r in comm.allgather(rate) if r])
        if comm.Get_rank() == 0:
            for name, rate in rates.items():
                print(f"{nbytes:>9} {name:>10} {rate:>10.0f} {rate / rates['p2p']:>6.2f}")
    comm.Free()


if __name__ == "__main__":
    main()
