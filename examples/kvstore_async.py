"""Train a linear model on a parameter server with ``dist_async``: one slow worker does
not hold the others back.

    mpiexec -n 4 python examples/kvstore_async.py                 # 3 workers, 1 server
    mpiexec -n 4 python examples/kvstore_async.py --mode dist_sync  # 4 workers, allreduce
    ringtrain-run -np 5 --servers 2 python examples/kvstore_async.py

The same script is worker and server, as MXNet's were: on the last rank (or the last
``--servers``), ``kvstore.create`` serves the keys until every worker has closed its
store, then exits. Each worker draws its own batches of a made-up regression problem
(targets from a fixed random "teacher" vector plus noise), pulls the current weights,
computes the gradient of the mean squared error and pushes it; the server runs SGD on
every push as it arrives. The last worker sleeps ``--slow-sleep`` seconds every step.

Each worker prints its steps per second: in ``dist_async`` the fast workers keep their
pace while the slow one lags; in ``dist_sync`` every worker waits for the slowest at every
step. The first worker prints a last line ``N ranks: final loss ...`` (the loss of the
final weights on held-out data; the noise alone gives about 0.01). With one rank there is
no one to serve: the example runs ``local``.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

from ringtrain import kvstore


def batch(rng: np.random.Generator, teacher: np.ndarray, size: int):
    inputs = rng.standard_normal((size, teacher.size)).astype(np.float32)
    targets = inputs @ teacher + 0.1 * rng.standard_normal(size).astype(np.float32)
    return inputs, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="dist_async", choices=kvstore.MODES)
    parser.add_argument("--steps", type=int, default=200, help="steps per worker")
    parser.add_argument("--dim", type=int, default=64, help="weights of the model")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--slow-sleep", type=float, default=0.02,
                        help="seconds the last worker sleeps every step")
    options = parser.parse_args()
    size = MPI.COMM_WORLD.Get_size()
    mode = options.mode if size > 1 or not options.mode.startswith("dist") else "local"
    kv = kvstore.create(mode)  # a server rank serves here, then exits
    teacher = np.random.default_rng(0).standard_normal(options.dim).astype(np.float32)
    kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=options.lr,
                                           rescale_grad=1.0 / options.batch_size))
    kv.init("weight", np.zeros(options.dim, np.float32))
    rng = np.random.default_rng(1 + kv.rank)
    weight = np.empty(options.dim, np.float32)
    slow = kv.rank == kv.num_workers - 1 and kv.num_workers > 1
    start = time.perf_counter()
    for _ in range(options.steps):
        kv.pull("weight", out=weight)
        inputs, targets = batch(rng, teacher, options.batch_size)
        error = inputs @ weight - targets
        kv.push("weight", 2 * inputs.T @ error)  # summed over the batch: rescale_grad averages
        if slow:
            time.sleep(options.slow_sleep)
    elapsed = time.perf_counter() - start
    print(f"worker {kv.rank}{' (slow)' if slow else ''}: {options.steps} steps in "
          f"{elapsed:.2f} s, {options.steps / elapsed:.1f} steps/s", flush=True)
    kv.barrier()
    if kv.rank == 0:
        inputs, targets = batch(np.random.default_rng(12345), teacher, 1000)
        loss = float(np.mean((inputs @ kv.pull("weight") - targets) ** 2))
        servers = size - kv.num_workers
        print(f"{size} ranks: final loss {loss:.4f} ({kv.type}, {kv.num_workers} workers, "
              f"{servers} servers)", flush=True)
    kv.close()


if __name__ == "__main__":
    main()
