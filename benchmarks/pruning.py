"""Pruning benchmark: bytes and time of the gradient reduction as a model is pruned, dense
DistributedOptimizer buckets against pruning-aware ones.

    mpiexec -n 4 python benchmarks/pruning.py
    simhosts.sh mpiexec 2 2 python benchmarks/pruning.py --rounds 7      # 2 hosts x 2 ranks
    simhosts.sh mpiexec 2 2 python benchmarks/pruning.py --optimizer sharded

The model: ``--layers`` Linear(``--hidden``, ``--hidden``) with ReLU between (3 x 1024 x
1024 by default: 12.6 MB of float32 gradients). For each sparsity of ``--sparsities`` a
copy of the model is pruned once to it (global magnitude pruning, the same masks on
every rank) and trained by a DistributedOptimizer (SGD, momentum 0.9) in two ways:

    dense    the Pruner keeps the masks to itself: every gradient travels whole
             (``shrink_communication=False``), zeros included
    pruned   the Pruner hands the masks to the optimizer: its buckets carry only the
             kept elements

With ``--optimizer sharded`` the optimizer is a ShardedOptimizer (stage 1), whose pruned
buckets reduce-scatter the kept gradients and allgather the kept parameters; its
communication is spread over the backward pass and the step, so only whole steps are
timed (``reduce ms`` shows ``-``).

Columns: ``bytes`` = what each rank handed to the allreduces (reduce-scatters) per step,
as the optimizer counts it; ``reduce ms`` = the gradient reduction alone (every gradient
of the last backward pass marked ready, then ``wait()``; no compute), which for pruned
buckets includes gathering the kept elements into them and scattering them back;
``allreduce ms`` = the communication alone: arrays of the sizes of the optimizer's
buckets (the kept elements' where pruned), allreduced one after the other in place as
its buckets are (same op, names and algorithm choice), no packing; ``step ms`` = a whole
step (``zero_grad``, forward, backward overlapped with the reduction, ``step``); ``x
dense`` = pruned over dense at the same sparsity, in the same run, for the bytes, the
allreduces, the reduction and the step; ``kept`` = the share of the weights left, the
target for ``x dense`` of the communication.

Timing: --warmup untimed steps per configuration; then --rounds rounds, each timing
--steps reductions and --steps steps of every configuration in turn, after a barrier;
a round's time is the slowest rank's; the tables give the median over rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

import ringtrain as rt
from ringtrain import pruning

MODES = ("dense", "pruned")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument("--sparsities", default="0,0.5,0.8,0.95")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument("--first-bucket-bytes", type=int, default=1 << 20,
                        help="the optimizer's first bucket limit")
    parser.add_argument("--optimizer", choices=("distributed", "sharded"),
                        default="distributed")
    return parser.parse_args()


class Configuration:
    """One model, pruned to ``sparsity``, with its optimizer and data."""

    def __init__(self, args: argparse.Namespace, sparsity: float, mode: str):
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1])
        wrap = rt.DistributedOptimizer if args.optimizer == "distributed" else \
            rt.ShardedOptimizer
        self.optimizer = wrap(torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9),
                              named_parameters=self.model.named_parameters(),
                              first_bucket_bytes=args.first_bucket_bytes)
        self.sharded = args.optimizer == "sharded"
        self.bucket_arrays: list[tuple[str, np.ndarray]] | None = None
        self.pruner = pruning.Pruner(self.model, optimizer=self.optimizer,
                                     shrink_communication=mode == "pruned")
        if sparsity:
            self.pruner.prune(sparsity)
        generator = torch.Generator().manual_seed(rt.rank())
        self.inputs = torch.randn(args.batch_size, args.hidden, generator=generator)
        self.targets = torch.randn(args.batch_size, args.hidden, generator=generator)

    def step(self) -> None:
        self.optimizer.zero_grad()
        torch.nn.functional.mse_loss(self.model(self.inputs), self.targets).backward()
        self.optimizer.step()

    @property
    def bytes_per_step(self) -> int:
        """What each rank hands to the reductions per step."""
        return self.optimizer.bytes_per_step if self.sharded else \
            self.optimizer.reducer.bytes_per_step

    def reduce(self) -> None:
        """Reduce the last backward pass's gradients again, with no compute."""
        reducer = self.optimizer.reducer
        for index, parameter in enumerate(self.optimizer.master_parameters()):
            reducer.mark_ready(index, parameter.grad)
        reducer.wait()

    def allreduce(self) -> None:
        """Allreduce arrays the sizes of the reducer's buckets, one after the other."""
        if self.bucket_arrays is None:
            self.bucket_arrays = [(bucket.name, np.zeros(bucket.layout.total_size,
                                                         bucket.layout.dtype))
                                  for bucket in self.optimizer.reducer.buckets]
        for name, array in self.bucket_arrays:
            rt.allreduce_(array, name=name)


def timed(function, steps: int) -> float:
    """Seconds per call of the slowest rank, after a barrier."""
    rt.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        function()
    seconds = (time.perf_counter() - start) / steps
    return float(rt.allreduce(np.array([seconds]), op=rt.Max, name="benchmark time")[0])


def main() -> None:
    args = parse_arguments()
    rt.init()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rt.local_size()))
    sparsities = [float(s) for s in args.sparsities.split(",")]
    configurations = {(s, mode): Configuration(args, s, mode)
                      for s in sparsities for mode in MODES}
    for configuration in configurations.values():
        for _ in range(args.warmup):
            configuration.step()
    times: dict[tuple[float, str], dict[str, list[float]]] = {
        key: {"allreduce": [], "reduce": [], "step": []} for key in configurations}
    order = list(configurations)
    for round_index in range(args.rounds):
        rotated = order[round_index % len(order):] + order[:round_index % len(order)]
        for key in rotated:
            configuration = configurations[key]
            if not configuration.sharded:
                times[key]["allreduce"].append(timed(configuration.allreduce, args.steps))
                times[key]["reduce"].append(timed(configuration.reduce, args.steps))
            times[key]["step"].append(timed(configuration.step, args.steps))
    if rt.rank() != 0:
        rt.shutdown()
        return
    gradient_bytes = configurations[(sparsities[0], "dense")].bytes_per_step
    print(f"{rt.size()} ranks, {args.optimizer} optimizer, {args.layers} x "
          f"Linear({args.hidden}, {args.hidden}): "
          f"{gradient_bytes / 1e6:.1f} MB of gradients; first bucket "
          f"{args.first_bucket_bytes:,} bytes; median of {args.rounds} rounds of "
          f"{args.steps} steps")
    print(f"{'sparsity':>8} {'kept':>6} {'mode':>7} {'bytes':>12} {'allreduce ms':>13} "
          f"{'reduce ms':>10} {'step ms':>9} {'x dense bytes':>14} {'x dense allreduce':>18} "
          f"{'x dense reduce':>15} {'x dense step':>13}")
    for sparsity in sparsities:
        kept = 1.0 - configurations[(sparsity, "pruned")].pruner.sparsity()
        dense = configurations[(sparsity, "dense")]
        for mode in MODES:
            configuration = configurations[(sparsity, mode)]
            sent = configuration.bytes_per_step
            measured = {measure: _median_and_ratio(times[(sparsity, mode)][measure],
                                                   times[(sparsity, "dense")][measure])
                        for measure in ("allreduce", "reduce", "step")}
            print(f"{sparsity:>8.2f} {kept:>6.3f} {mode:>7} {sent:>12,} "
                  f"{measured['allreduce'][0]:>13} {measured['reduce'][0]:>10} "
                  f"{measured['step'][0]:>9} {sent / dense.bytes_per_step:>14.3f} "
                  f"{measured['allreduce'][1]:>18} {measured['reduce'][1]:>15} "
                  f"{measured['step'][1]:>13}")
    rt.shutdown()


def _median_and_ratio(seconds: list[float], dense_seconds: list[float]) -> tuple[str, str]:
    """The median of ``seconds`` in ms and its ratio to the dense median, or dashes where
    not timed."""
    if not seconds:
        return "-", "-"
    median = statistics.median(seconds)
    return f"{median * 1e3:.2f}", f"{median / statistics.median(dense_seconds):.3f}"


if __name__ == "__main__":
    main()
