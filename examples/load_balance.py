"""Train with one rank slower than the others, with even shares and with load balancing.

    mpiexec -n 2 python examples/load_balance.py
    mpiexec -n 4 python examples/load_balance.py --slow-rank 1 --slow-factor 1.5

Synchronous data parallelism runs at the pace of its slowest rank. Here the rank
``--slow-rank`` (the last by default) does ``--slow-factor`` times the work per sample of
the others: before each forward pass it runs forward and backward passes of a copy of
the model over ``factor - 1`` times its samples (as a GPU of an older generation, or a
machine shared with a noisy neighbour, would be slower). The same model is then trained
twice from the same weights, on a global batch of ``--batch-size`` x N samples:

- **even**: ``rt.DistributedSampler`` gives every rank ``--batch-size`` samples per
  step; the fast ranks wait for the slow one at every step;
- **balanced**: an ``rt.LoadBalancer`` measures each rank's compute per sample and every
  ``--interval`` steps moves samples from the slow rank to the others;
  ``rt.BalancedBatchSampler`` deals each rank its share of every global batch, and the
  optimizer (``balance=balancer``) weights each rank's gradient by its samples, so every
  step is still the mean over the global batch.

Rank 0 prints a line per run (samples per second over all ranks from the second epoch
on, held-out accuracy, the shares at the end) and a last line ``N ranks: final accuracy
...`` comparing the two.
Set ``RINGTRAIN_LOG_LEVEL=INFO`` to see each change of the shares. The data are made up
here, as in pytorch_mlp.py.
"""

import argparse
import copy
import os
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt

FEATURES = 16
CLASSES = 8
TEACHER_HIDDEN = 32


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of each run")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per rank per step with even shares")
    parser.add_argument("--samples", type=int, default=16384,
                        help="training samples (the held-out set has a quarter as many)")
    parser.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--slow-rank", type=int, default=-1,
                        help="the rank made slower (-1: the last)")
    parser.add_argument("--slow-factor", type=float, default=2.0,
                        help="how many times the work per sample the slow rank does")
    parser.add_argument("--interval", type=int, default=10,
                        help="steps between the balancer's agreements on the shares")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data")
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.samples < 4 or args.slow_factor < 1:
        parser.error("--epochs and --batch-size must be at least 1, --samples at least 4, "
                     "--slow-factor at least 1")
    return args


def make_datasets(samples: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Training and held-out sets, a function of ``samples`` and ``seed`` only."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((FEATURES, TEACHER_HIDDEN)) / np.sqrt(FEATURES)
    output = rng.standard_normal((TEACHER_HIDDEN, CLASSES))
    inputs = rng.standard_normal((samples + samples // 4, FEATURES)).astype(np.float32)
    labels = np.argmax(np.tanh(inputs @ hidden) @ output, axis=1)
    inputs, labels = torch.from_numpy(inputs), torch.from_numpy(labels)
    return (TensorDataset(inputs[:samples], labels[:samples]),
            TensorDataset(inputs[samples:], labels[samples:]))


def make_model(hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


class ExtraWork:
    """Forward and backward passes of a copy of the model over ``extra`` times a batch's
    samples (results thrown away): ``extra`` = slow factor - 1 on the slow rank, else 0."""

    def __init__(self, model: nn.Module, extra: float):
        self.shadow = copy.deepcopy(model)
        self.extra = extra

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        left = self.extra
        while left > 1e-9:
            rows = len(inputs) if left >= 1.0 else max(1, round(left * len(inputs)))
            loss = nn.functional.cross_entropy(self.shadow(inputs[:rows]), labels[:rows])
            torch.autograd.grad(loss, list(self.shadow.parameters()))
            left -= min(1.0, left)


def evaluate(model: nn.Module, held_out: TensorDataset) -> float:
    """Accuracy over the whole held-out set: each rank counts its shard, the counts are summed."""
    loader = DataLoader(held_out, batch_size=1024, sampler=rt.DistributedSampler(
        len(held_out), mode="exact", shuffle=False))
    correct, seen = 0, 0
    with torch.no_grad():
        for inputs, labels in loader:
            correct += int((model(inputs).argmax(dim=1) == labels).sum())
            seen += len(labels)
    counts = rt.allreduce(np.array([correct, seen], np.int64), op=rt.Sum, name="accuracy")
    return int(counts[0]) / int(counts[1])


def train(args: argparse.Namespace, balanced: bool, slow: float) -> tuple[float, float, list]:
    """One run; returns (samples per second over all ranks, held-out accuracy, shares)."""
    train_set, held_out = make_datasets(args.samples, args.seed)
    model = make_model(args.hidden, args.seed)
    extra_work = ExtraWork(model, slow - 1.0)
    global_batch = args.batch_size * rt.size()
    balancer = rt.LoadBalancer(global_batch, interval=args.interval) if balanced else None
    if balanced:
        sampler = rt.BalancedBatchSampler(len(train_set), balancer, seed=args.seed)
        loader = DataLoader(train_set, batch_sampler=sampler)
    else:
        sampler = rt.DistributedSampler(len(train_set), mode="pad", seed=args.seed)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    optimizer = rt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                        named_parameters=model.named_parameters(),
                                        balance=balancer)
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    start, trained = time.perf_counter(), 0
    for epoch in range(args.epochs):
        if epoch == min(1, args.epochs - 1):
            # Timed from the second epoch on: the first compiles kernels and, balanced,
            # lets the shares settle.
            rt.barrier()
            start, trained = time.perf_counter(), 0
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            optimizer.zero_grad()
            extra_work(inputs, labels)
            nn.functional.cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            trained += len(labels)
    rt.barrier()
    seconds = time.perf_counter() - start
    trained = int(rt.allreduce(np.array([trained], np.int64), op=rt.Sum, name="samples")[0])
    shares = list(balancer.shares) if balanced else [args.batch_size] * rt.size()
    return trained / seconds, evaluate(model, held_out), shares


def main() -> None:
    args = parse_arguments()
    rt.init()
    rank, size = rt.rank(), rt.size()
    # The ranks on a node share its cores.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rt.local_size()))
    slow_rank = args.slow_rank % size
    slow = args.slow_factor if rank == slow_rank else 1.0
    results = {}
    for name, balanced in (("even", False), ("balanced", True)):
        results[name] = train(args, balanced, slow)
        speed, accuracy, shares = results[name]
        if rank == 0:
            print(f"{name:>8}: {speed:8.0f} samples/s, held-out accuracy {accuracy:.3f}, "
                  f"shares {shares} (rank {slow_rank} {args.slow_factor:g}x slower)",
                  flush=True)
    if rank == 0:
        (even, even_accuracy, _), (fast, accuracy, _) = results["even"], results["balanced"]
        print(f"{size} ranks: final accuracy {accuracy:.3f} balanced, {even_accuracy:.3f} "
              f"even; balancing gave {fast / even:.2f}x the samples per second", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
