"""Sharded optimizer state: memory and step time of ringtrain's ShardedOptimizer (stage 1
and 2) against the DistributedOptimizer and PyTorch's ZeroRedundancyOptimizer (gloo).

    mpiexec -n 2 python benchmarks/sharded_optimizer.py
    mpiexec -n 2 python benchmarks/sharded_optimizer.py --width 3584 --layers 4 --rounds 6

The model: ``--layers`` Linear(width, width) with ReLU between (default 4 x 3584: 51.4 M
float32 parameters, 206 MB), Adam, a batch of ``--batch`` random rows per rank. Four
configurations train their own copy of it, one after the other in the same run:

    plain     rt.DistributedOptimizer (every rank keeps the whole Adam state)
    stage1    rt.ShardedOptimizer(stage=1)
    stage2    rt.ShardedOptimizer(stage=2)
    torch     torch DistributedDataParallel (gloo, gradient allreduce) with
              torch.distributed.optim.ZeroRedundancyOptimizer (Adam state sharded,
              parameters broadcast from their owners after the step)

For each: ``state MB`` = bytes of the optimizer-state tensors this rank holds (the
largest over ranks); ``peak MB`` = the rank's peak resident memory while the
configuration is built and trained (Linux's VmHWM, reset before it through
/proc/self/clear_refs) minus its resident memory before, the largest over ranks, so it
counts the model, gradients, optimizer state and transient buffers of that configuration
alone (large allocations are mmap-ed, so freed memory is returned at once); the
configurations are built one after the other and all kept, and each is measured from
its construction to the end of its ``--warmup`` steps. ``step ms`` = median of the
slowest rank's step time (each step after a barrier) over ``--rounds`` rounds of
``--steps`` steps of every configuration in turn, the order rotated each round, so that
the noise of a shared machine hits all alike. Ratios are against ``plain``. Every
configuration first runs once on a small model, so first-use costs (threads, compiled
kernels, gloo's buffers) fall outside the measured runs.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

import ringtrain as rt

CONFIGS = ("plain", "stage1", "stage2", "torch")
M_MMAP_THRESHOLD = -3


def return_freed_memory_to_the_system() -> None:
    """glibc: allocations of 128 KiB and more get their own mapping, unmapped on free."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
    except OSError:
        pass


def resident_mb() -> float:
    return psutil.Process().memory_info().rss / 1e6


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def peak_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def start_process_group() -> None:
    """torch.distributed's gloo group on the ranks ringtrain knows (rank 0's TCP store)."""
    host = "127.0.0.1" if rt.local_size() == rt.size() else socket.gethostname()
    store = None
    if rt.rank() == 0:
        store = dist.TCPStore(host, 0, rt.size(), is_master=True, wait_for_workers=False)
    host, port = rt.broadcast_object((host, store.port) if store else None, 0,
                                     name="gloo rendezvous")
    if store is None:
        store = dist.TCPStore(host, port, rt.size(), is_master=False)
    dist.init_process_group("gloo", store=store, rank=rt.rank(), world_size=rt.size())


def build_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for index in range(layers):
        modules.append(nn.Linear(width, width))
        if index + 1 < layers:
            modules.append(nn.ReLU())
    return nn.Sequential(*modules)


def state_bytes(state: Any) -> int:
    return sum(value.numel() * value.element_size() for entries in state.values()
               for value in entries.values()
               if isinstance(value, torch.Tensor) and value.dim() > 0)


def make(config: str, model: nn.Module, lr: float) -> tuple[Callable[[], Any], Any, nn.Module]:
    """(step function's optimizer holder, the state to measure, the module to call)."""
    adam = torch.optim.Adam
    if config == "plain":
        optimizer = rt.DistributedOptimizer(adam(model.parameters(), lr=lr),
                                            named_parameters=model.named_parameters())
        return optimizer, lambda: optimizer.state, model
    if config in ("stage1", "stage2"):
        optimizer = rt.ShardedOptimizer(adam(model.parameters(), lr=lr),
                                        model.named_parameters(), stage=int(config[-1]))
        return optimizer, lambda: optimizer.state, model
    from torch.distributed.optim import ZeroRedundancyOptimizer
    wrapped = nn.parallel.DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=adam, lr=lr)
    return optimizer, lambda: optimizer.optim.state, wrapped


class Case:
    """One configuration, built and trained for its warm-up steps, measured for memory."""

    def __init__(self, config: str, arguments: argparse.Namespace):
        gc.collect()
        rt.barrier()
        before = resident_mb()
        reset_peak()
        self.model = build_model(arguments.width, arguments.layers)
        self.optimizer, self.state, self.forward = make(config, self.model, 1e-4)
        generator = torch.Generator().manual_seed(rt.rank())
        self.x = torch.randn(arguments.batch, arguments.width, generator=generator)
        self.y = torch.randn(arguments.batch, arguments.width, generator=generator)
        for _ in range(arguments.warmup):
            self.step()
        self.state_mb = max(rt.allgather_object(state_bytes(self.state()), name="state")) / 1e6
        self.peak_mb = max(rt.allgather_object(peak_mb() - before, name="peak"))
        self.times: list[float] = []

    def step(self) -> float:
        """One training step after a barrier; the slowest rank's seconds."""
        rt.barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        nn.functional.mse_loss(self.forward(self.x), self.y).backward()
        self.optimizer.step()
        return max(rt.allgather_object(time.perf_counter() - start, name="step time"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    arguments = parser.parse_args()
    return_freed_memory_to_the_system()
    rt.init()
    torch.set_num_threads(max(1, (psutil.cpu_count() or 1) // rt.local_size()))
    configs = arguments.configs.split(",")
    if "torch" in configs:
        start_process_group()
    parameters = sum(p.numel() for p in build_model(arguments.width, arguments.layers).parameters())
    warm_up = argparse.Namespace(**{**vars(arguments), "width": 64, "layers": 2,
                                    "warmup": 1})
    for config in configs:  # first-use costs (threads, compiled kernels) outside the runs
        Case(config, warm_up)
    gc.collect()
    cases = {config: Case(config, arguments) for config in configs}
    for round_index in range(arguments.rounds):
        order = configs[round_index % len(configs):] + configs[:round_index % len(configs)]
        for config in order:
            cases[config].times += [cases[config].step() for _ in range(arguments.steps)]
    results = {config: {"state": case.state_mb, "peak": case.peak_mb,
                        "step": statistics.median(case.times) * 1e3}
               for config, case in cases.items()}
    if rt.rank() == 0:
        print(f"{rt.size()} ranks, {arguments.layers} x Linear({arguments.width}, "
              f"{arguments.width}): {parameters / 1e6:.1f} M float32 parameters "
              f"({parameters * 4 / 1e6:.0f} MB), Adam, batch {arguments.batch} per rank, "
              f"torch {torch.__version__}")
        print("| configuration | state MB | peak MB | step ms | state ratio | peak ratio | "
              "step ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        base = results.get("plain")
        for config, result in results.items():
            ratios = ["", "", ""] if base is None else [
                f"{result[key] / base[key]:.2f}" for key in ("state", "peak", "step")]
            print(f"| {config} | {result['state']:.0f} | {result['peak']:.0f} | "
                  f"{result['step']:.0f} | {' | '.join(ratios)} |")
    if dist.is_initialized():
        dist.destroy_process_group()
    rt.shutdown()


if __name__ == "__main__":
    main()
