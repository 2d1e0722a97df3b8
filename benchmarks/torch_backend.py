"""torch.distributed on ringtrain's backend against gloo: DDP training steps and
``all_reduce`` from 8 B to 64 MiB, interleaved in one run.

    mpiexec -n 2 python benchmarks/torch_backend.py
    mpiexec -n 4 python benchmarks/torch_backend.py --rounds 9 --json results.json
    mpiexec -n 2 python benchmarks/torch_backend.py --no-training      # all_reduce only

Training: benchmarks/training_step.py's measurement with the configurations ``ddp``
(DistributedDataParallel on gloo), ``ddp-ringtrain`` (the same on ringtrain's backend),
``fused`` (ringtrain's own DistributedOptimizer) and ``local`` (no communication), on its
``many-small`` and ``few-large`` models: step time, the communication it leaves exposed
(step minus local), and the gradient reduction alone (reduce only). Its options after
``--``: ``mpiexec -n 2 python benchmarks/torch_backend.py -- --rounds 9``.

all_reduce: one float32 tensor of zeros per size (so repeated sums stay zeros), summed
in place by ``torch.distributed.all_reduce`` on the default group (``ringtrain``), on a
gloo group of the same ranks, and by ``ringtrain.allreduce_`` on the same memory (as a
numpy array: ringtrain's own fastest call). Every size runs a few untimed calls of each,
then ``--rounds`` rounds, each timing as many calls of each way as fill
``--round-seconds``, the order rotated every round; a round's time per call is the
slowest rank's, and the table shows the median round. ``torch/gloo`` below 1: the
ringtrain backend is faster than gloo; ``torch/rt`` is the cost of going through
torch.distributed over calling ringtrain directly.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import ringtrain as rt
import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)
import training_step

SIZES = [8 * 4 ** k for k in range(12)] + [64 << 20]
"""8 B, 32 B, ... 32 MiB, and 64 MiB."""
WAYS = ("torch on ringtrain", "torch on gloo", "ringtrain.allreduce_")


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size")
    parser.add_argument("--round-seconds", type=float, default=0.1,
                        help="time each way fills in a round (at least 3 calls)")
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="largest size")
    parser.add_argument("--no-training", dest="training", action="store_false",
                        help="skip the DDP training steps")
    parser.add_argument("--json", default=None, help="also write the table to this file")
    parser.add_argument("training_options", nargs="*",
                        help="after --: options of benchmarks/training_step.py")
    return parser.parse_args(argv)


def calls(tensor: torch.Tensor, gloo: object) -> dict[str, Callable[[], object]]:
    view = tensor.numpy()
    return {"torch on ringtrain": lambda: dist.all_reduce(tensor),
            "torch on gloo": lambda: dist.all_reduce(tensor, group=gloo),
            "ringtrain.allreduce_": lambda: rt.allreduce_(view, op=rt.Sum)}


def seconds_per_call(ways: dict[str, Callable[[], object]], rounds: int,
                     round_seconds: float) -> dict[str, float]:
    """The median round's seconds per call of every way (the slowest rank's per round)."""
    count = {}
    for name, call in ways.items():
        for _ in range(2):
            call()
        rt.barrier()
        start = time.perf_counter()
        call()
        took = rt.allreduce(torch.tensor([time.perf_counter() - start]), op=rt.Max).item()
        count[name] = max(3, min(20000, math.ceil(round_seconds / max(took, 1e-7))))
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            call = ways[name]
            rt.barrier()
            start = time.perf_counter()
            for _ in range(count[name]):
                call()
            times[name].append((time.perf_counter() - start) / count[name])
    slowest = rt.allgather_object(times, name="all_reduce times")
    return {name: statistics.median(max(rank[name][i] for rank in slowest)
                                    for i in range(rounds)) for name in names}


def all_reduce_table(arguments: argparse.Namespace, gloo: object) -> list[dict[str, float]]:
    rows = []
    if rt.rank() == 0:
        print(f"\n## torch.distributed.all_reduce, float32 sum in place, {rt.size()} ranks; "
              f"median of {arguments.rounds} interleaved rounds, microseconds per call",
              flush=True)
        print(f"{'bytes':>10} {'torch ringtrain':>16} {'torch gloo':>12} {'ringtrain':>11} "
              f"{'torch/gloo':>11} {'torch/rt':>9}", flush=True)
    for nbytes in SIZES:
        if nbytes > arguments.max_bytes:
            break
        tensor = torch.zeros(nbytes // 4)
        seconds = seconds_per_call(calls(tensor, gloo), arguments.rounds,
                                   arguments.round_seconds)
        ours, theirs, direct = (seconds[name] * 1e6 for name in WAYS)
        row = {"bytes": nbytes, "torch_ringtrain_us": ours, "torch_gloo_us": theirs,
               "ringtrain_us": direct, "torch_over_gloo": ours / theirs,
               "torch_over_ringtrain": ours / direct}
        rows.append(row)
        if rt.rank() == 0:
            print(f"{nbytes:>10} {ours:>16.1f} {theirs:>12.1f} {direct:>11.1f} "
                  f"{row['torch_over_gloo']:>11.2f} {row['torch_over_ringtrain']:>9.2f}",
                  flush=True)
    return rows


def main(argv: list[str]) -> int:
    arguments = parse_arguments(argv)
    status = 0
    if arguments.training:
        status = training_step.main(["--configs", "fused,ddp,ddp-ringtrain,local",
                                     *arguments.training_options])
    rt.init()
    torch.set_num_threads(max(1, training_step.usable_cores() // rt.local_size()))
    if not dist.is_initialized():
        dist.init_process_group("ringtrain")
    gloo = dist.new_group(backend="gloo")
    rows = all_reduce_table(arguments, gloo)
    dist.destroy_process_group()
    if arguments.json and rt.rank() == 0:
        with open(arguments.json, "w") as file:
            json.dump({"ranks": rt.size(), "all_reduce": rows}, file, indent=1)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
