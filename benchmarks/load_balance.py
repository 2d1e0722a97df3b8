"""Load-balancing benchmark: throughput with one slow rank, balanced shares against even ones.

    mpiexec -n 2 python benchmarks/load_balance.py
    mpiexec -n 4 python benchmarks/load_balance.py --factors 2,1.5,1 --rounds 7

The model: an MLP, Linear(``--features``, ``--hidden``), ``--layers`` - 1 more
Linear(``--hidden``, ``--hidden``) and a Linear(``--hidden``, 10), ReLU between, trained
with SGD by a DistributedOptimizer on a global batch of ``--batch-size`` x N samples.
The last rank is made slower by a factor F of ``--factors``, before each step's forward
pass, in one of two ways (``--slowdown``):

    work   it computes forward and backward passes of a copy of the model over F - 1
           times its samples (results thrown away): F times the others' work per sample.
           On a machine whose ranks share cores, this work also takes cores from them.
    sleep  it sleeps F - 1 times as long as its last step's forward and backward took:
           a slower device, which leaves the cores to the other ranks.

For each factor two configurations train, each with its own model:

    even      every rank takes batch-size samples per step (no LoadBalancer)
    balanced  a LoadBalancer (``--interval`` steps between agreements) sets the shares,
              and the optimizer weights each rank's gradient by its samples

Timing: the balanced configuration first trains ``--warmup`` steps (its shares settle;
the even one trains a few too); then ``--rounds`` rounds, each timing ``--steps`` steps
of both configurations, in turn and in alternating order, after a barrier; a round's
time is the slowest rank's. ``samples/s`` is the global batch over the median time per
step (samples of all ranks per second); ``balanced / even`` is the median over rounds
of the ratio of the two throughputs measured in the same round (``rounds from-to``: the
smallest and largest of those ratios); ``shares`` are the balanced run's at the end.
With one rank F times slower and N ranks the ideal ratio is ``(N - 1 + 1/F) / (N/F)``
(1.5 for F = 2 at N = 2), less what the communication and per-step costs take: they do
not shrink with a rank's share. At F = 1 the ranks are even: the ratio is what
balancing costs when there is nothing to balance, within the run's noise (the ranks
share the machine's cores; torch gets cores / ranks threads each).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import numpy as np
import torch

import ringtrain as rt

CONFIGURATIONS = ("even", "balanced")


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512,
                        help="samples per rank per step with even shares")
    parser.add_argument("--factors", default="2,1.5,1",
                        help="how many times slower the last rank is, one run each")
    parser.add_argument("--slowdown", choices=("work", "sleep"), default="work",
                        help="how the last rank is made slower")
    parser.add_argument("--interval", type=int, default=10,
                        help="steps between the balancer's agreements")
    parser.add_argument("--hysteresis", type=float, default=0.05,
                        help="the balancer's hysteresis (0.99: shares that hardly move)")
    parser.add_argument("--warmup", type=int, default=100,
                        help="untimed steps of the balanced configuration first")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    return parser.parse_args()


class Configuration:
    """A model, its optimizer and data, with the last rank ``factor`` times slower."""

    def __init__(self, args: argparse.Namespace, factor: float, balanced: bool):
        torch.manual_seed(0)
        widths = [args.features] + [args.hidden] * args.layers
        layers: list[torch.nn.Module] = []
        for width_in, width_out in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))
        self.shadow = copy.deepcopy(self.model)       # the slow rank's extra work
        global_batch = args.batch_size * rt.size()
        self.balancer = rt.LoadBalancer(global_batch, interval=args.interval,
                                        hysteresis=args.hysteresis) if balanced else None
        self.optimizer = rt.DistributedOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=1e-3),
            named_parameters=self.model.named_parameters(), balance=self.balancer)
        self.extra = factor - 1.0 if rt.rank() == rt.size() - 1 else 0.0
        self.slowdown = args.slowdown
        self.compute_seconds = 0.0          # of the last forward and backward
        self.even_share = args.batch_size
        generator = torch.Generator().manual_seed(rt.rank())
        self.inputs = torch.randn(global_batch, args.features, generator=generator)
        self.targets = torch.randint(0, 10, (global_batch,), generator=generator)

    @property
    def share(self) -> int:
        return self.even_share if self.balancer is None else self.balancer.share

    def step(self) -> None:
        share = self.share
        x, y = self.inputs[:share], self.targets[:share]
        self.optimizer.zero_grad()
        if self.slowdown == "work":
            self._extra_work(x, y)
        elif self.extra:
            time.sleep(self.extra * self.compute_seconds)
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(self.model(x), y).backward()
        self.compute_seconds = time.perf_counter() - start
        self.optimizer.step()

    def _extra_work(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Forward and backward passes of the shadow model over ``extra`` times the samples."""
        left = self.extra
        while left > 1e-9:
            rows = len(x) if left >= 1.0 else max(1, round(left * len(x)))
            loss = torch.nn.functional.cross_entropy(self.shadow(x[:rows]), y[:rows])
            torch.autograd.grad(loss, list(self.shadow.parameters()))
            left -= min(1.0, left)


def timed(configuration: Configuration, steps: int) -> float:
    """Seconds per step of the slowest rank, after a barrier."""
    rt.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        configuration.step()
    seconds = (time.perf_counter() - start) / steps
    return float(rt.allreduce(np.array([seconds]), op=rt.Max, name="benchmark time")[0])


def measure(args: argparse.Namespace, factor: float) -> dict[str, object]:
    """Both configurations for one slow factor: median samples/s, the ratio, the shares."""
    configurations = {name: Configuration(args, factor, name == "balanced")
                      for name in CONFIGURATIONS}
    for _ in range(args.warmup):
        configurations["balanced"].step()
    for _ in range(3):
        configurations["even"].step()
    seconds: dict[str, list[float]] = {name: [] for name in CONFIGURATIONS}
    for round_index in range(args.rounds):
        order = CONFIGURATIONS if round_index % 2 == 0 else CONFIGURATIONS[::-1]
        for name in order:
            seconds[name].append(timed(configurations[name], args.steps))
    global_batch = args.batch_size * rt.size()
    ratios = [even / balanced for even, balanced in zip(seconds["even"], seconds["balanced"])]
    result = {name: global_batch / statistics.median(seconds[name]) for name in CONFIGURATIONS}
    result["ratio"] = statistics.median(ratios)
    result["range"] = (min(ratios), max(ratios))
    result["shares"] = configurations["balanced"].balancer.shares
    return result


def main() -> None:
    args = parse_arguments()
    rt.init()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rt.local_size()))
    factors = [float(f) for f in args.factors.split(",")]
    results = {factor: measure(args, factor) for factor in factors}
    if rt.rank() == 0:
        size = rt.size()
        print(f"{size} ranks, MLP {args.features}-{'-'.join([str(args.hidden)] * args.layers)}"
              f"-10, global batch {args.batch_size * size}, the last rank F times slower "
              f"({args.slowdown}); median of {args.rounds} rounds of {args.steps} steps")
        print(f"{'F':>5} {'even samples/s':>15} {'balanced samples/s':>19} "
              f"{'balanced / even':>16} {'rounds from-to':>15} {'ideal':>6}  shares")
        for factor, result in results.items():
            ideal = (size - 1 + 1 / factor) / (size / factor)
            low, high = result["range"]
            print(f"{factor:>5.2f} {result['even']:>15.0f} {result['balanced']:>19.0f} "
                  f"{result['ratio']:>16.3f} {f'{low:.2f}-{high:.2f}':>15} {ideal:>6.3f}  "
                  f"{list(result['shares'])}")
    rt.shutdown()


if __name__ == "__main__":
    main()
