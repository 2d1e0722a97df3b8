"""The KVStore's modes measured: pushes/s and pulled GB/s per worker, and what one slow
worker costs the others in dist_sync and in dist_async.

Run: ``mpiexec -n 4 python benchmarks/kvstore.py`` (dist_sync: 4 workers; dist_async:
3 workers and 1 server, the last rank).

1. For each value size (4 KiB to 16 MiB of float32) and mode, every worker pushes the
   key repeatedly (pushes/s, the sync mode's pushes each ending in the pull that waits
   for them) and then pulls it (GB/s of pulled values). The baselines, in the same run:
   ringtrain's ``allreduce`` of the same array (sync) and a bare MPI ``Send`` of the same
   bytes to the server rank (async, as benchmarks/kvstore_transport.py sends); ``ratio``
   is the mode's pushes/s over its baseline's.
2. The same training loop (pull, ``--compute`` seconds of work, push) in both modes, with
   every worker at full speed and then with one worker 3 times slower: the fast workers'
   steps/s, and their slowed/unslowed ratio (the target in dist_async: >= 0.8).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from kvstore_transport import p2p
from ringtrain import kvstore
from ringtrain.common.environment import parse_size

WORLD = MPI.COMM_WORLD


def mean_over_workers(value: float | None) -> float:
    """The mean of the workers' values (servers pass None), on every rank."""
    values = [v for v in WORLD.allgather(value) if v is not None]
    return float(np.mean(values)) if values else 0.0


def transfer_rates(mode: str, nbytes: int, repeats: int, threshold: float | None):
    """(pushes/s, pulled GB/s) per worker of one mode and size."""
    kv = kvstore.create(mode, exit_server=False)
    if kv is None:  # a server: serves until the workers are done
        return mean_over_workers(None), mean_over_workers(None)
    if threshold is not None:
        kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    grad = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(grad)
    kv.init("k", np.zeros_like(grad))
    kv.pushpull("k", grad, out=out)  # the kernels compiled (or loaded) before timing
    kv.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        kv.push("k", grad)
    kv.pull("k", out=out)
    pushes = repeats / (time.perf_counter() - start)
    kv.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        kv.pull("k", out=out)
    pulled = repeats * nbytes / (time.perf_counter() - start) / 1e9
    kv.barrier()
    kv.close()
    return mean_over_workers(pushes), mean_over_workers(pulled)


def allreduce_rate(nbytes: int, repeats: int) -> float:
    grad = np.ones(nbytes // 4, np.float32)
    rt.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        rt.allreduce(grad, op=rt.Sum, name="baseline")
    return mean_over_workers(repeats / (time.perf_counter() - start))


def send_rate(nbytes: int, repeats: int) -> float:
    comm = WORLD.Dup()
    rate = p2p(comm, comm.Get_size() - 1, np.ones(nbytes // 4, np.float32), repeats)
    comm.Free()
    return mean_over_workers(rate if WORLD.Get_rank() < WORLD.Get_size() - 1 else None)


def training_rate(mode: str, steps: int, compute: float, slow: bool) -> float:
    """Steps/s of the fast workers; with ``slow``, the last worker computes 3 times longer."""
    kv = kvstore.create(mode, exit_server=False)
    if kv is None:
        return mean_over_workers(None)
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.01))
    kv.init("w", np.zeros(1 << 16, np.float32))
    weight = np.empty(1 << 16, np.float32)
    lagging = slow and kv.rank == kv.num_workers - 1
    kv.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        kv.pull("w", out=weight)
        time.sleep(compute * (3 if lagging else 1))  # the forward and backward pass
        kv.push("w", np.full_like(weight, 0.001))
    rate = steps / (time.perf_counter() - start)
    kv.barrier()
    kv.close()
    return mean_over_workers(None if lagging else rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M")
    parser.add_argument("--seconds", type=float, default=0.3, help="about this long per case")
    parser.add_argument("--steps", type=int, default=40, help="training steps per worker")
    parser.add_argument("--compute", type=float, default=0.03,
                        help="seconds of work per training step (a sleep)")
    options = parser.parse_args()
    rt.init()
    root = WORLD.Get_rank() == 0
    if WORLD.Get_size() < 2:
        raise SystemExit("run with at least 2 ranks")
    if root:
        print(f"{WORLD.Get_size()} ranks: dist_sync {WORLD.Get_size()} workers; dist_async "
              f"{WORLD.Get_size() - 1} workers + 1 server")
        print(f"{'bytes':>9} {'mode':>15} {'pushes/s':>9} {'baseline':>9} {'ratio':>6} "
              f"{'pull GB/s':>9}")
    for text in options.sizes.split(","):
        nbytes = parse_size(text)
        repeats = max(3, min(500, int(options.seconds * 1e9 / max(nbytes, 1 << 16) / 4)))
        baselines = {"allreduce": allreduce_rate(nbytes, repeats),
                     "send": send_rate(nbytes, repeats)}
        for mode, baseline, threshold in (("dist_sync", "allreduce", None),
                                          ("dist_async", "send", None),
                                          ("dist_async", "send", 0.5)):
            pushes, pulled = transfer_rates(mode, nbytes, repeats, threshold)
            label = mode if threshold is None else f"{mode} 2bit"
            if root:
                print(f"{nbytes:>9} {label:>15} {pushes:>9.0f} {baselines[baseline]:>9.0f} "
                      f"{pushes / baselines[baseline]:>6.2f} {pulled:>9.3f}")
    if root:
        print(f"\ntraining: {options.steps} steps of {options.compute * 1e3:.0f} ms, the "
              f"slow worker 3x; steps/s of the fast workers")
        print(f"{'mode':>11} {'unslowed':>9} {'slowed':>9} {'ratio':>6}")
    for mode in ("dist_sync", "dist_async"):
        full = training_rate(mode, options.steps, options.compute, slow=False)
        slowed = training_rate(mode, options.steps, options.compute, slow=True)
        if root:
            print(f"{mode:>11} {full:>9.1f} {slowed:>9.1f} {slowed / full:>6.2f}")


if __name__ == "__main__":
    main()
