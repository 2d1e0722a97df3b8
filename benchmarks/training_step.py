"""Training-step benchmark: ringtrain's DistributedOptimizer against PyTorch DDP (gloo).

    mpiexec -n 2 python benchmarks/training_step.py                  # both models
    mpiexec -n 2 python benchmarks/training_step.py --model few-large --rounds 9
    mpiexec -n 2 python benchmarks/training_step.py --fusion-threshold 32M --configs fused,local

One model, one per-rank batch, five ways to train it (``--configs``; the first four by
default):

    fused          ringtrain DistributedOptimizer, fusion buckets (the default threshold,
                   or --fusion-threshold)
    unfused        ringtrain DistributedOptimizer with fusion_threshold=0: one allreduce
                   per tensor
    ddp            torch DistributedDataParallel on a gloo process group (its defaults:
                   25 MiB buckets, the first 1 MiB)
    local          every rank trains alone, with no communication at all: the
                   compute-only time
    ddp-ringtrain  the same DistributedDataParallel on ringtrain's torch.distributed
                   backend (``ringtrain.torch``)

Models (``--model``): ``many-small``, 50 blocks of Linear(64, 64) + LayerNorm(64) + ReLU
(200 tensors, 0.86 MB of gradients), where per-message costs dominate; ``few-large``, 3
Linear(2048, 2048) with ReLU between (6 tensors, 50 MB), where bandwidth does; ``medium``,
24 blocks of Linear(512, 512) + LayerNorm(512) + ReLU (96 tensors, 25 MB), where the
fusion threshold matters most (not run by default). A step is
``zero_grad(); mse_loss(model(x), y).backward(); step()`` with SGD (momentum 0.9) on random
data made once per rank. Every configuration trains its own copy of the model, built from
the same seed (the same initial weights on every rank).

How the numbers are produced: each configuration runs --warmup untimed steps; then come
--rounds rounds, each timing --steps steps of every configuration in turn, each after a
barrier, the order rotated by one every round, so machine noise hits all alike. --steps
defaults to enough steps for the slowest configuration's last warm-up step to fill
--round-seconds (2 to 100; the same on every rank). A round's time per step is the
slowest rank's; ``step ms`` is the median over rounds and ``spread`` the range of the
rounds over that median. ``samples/s`` = ranks x batch / step time. ``comm ms`` = step ms
minus the ``local`` step ms: the communication not hidden behind compute (noise can make
it slightly negative). ``allreduces`` counts the messages a step reduces (buckets; DDP's
as it rebuilt them after its first step); the bucket sizes are listed above the table,
``*`` marking those whose gradients are copied into a bucket buffer and back. Every rank
runs torch with usable cores / ranks on the node threads, in every configuration alike.

Reduce only: after training, the gradients of the last backward pass are reduced again
and again, with no compute: by each ringtrain optimizer's GradientReducer (every gradient
marked ready in the order backward produces them, then ``wait()``); with ``ddp``, by
gloo's allreduce of one flat buffer holding all gradients (pack, allreduce, divide,
unpack: what one fused bucket costs in gloo); with ``ddp-ringtrain``, by
``torch.distributed.all_reduce`` of that buffer on the ringtrain backend; and by
``MPI_Allreduce`` of the same flat buffer, the MPI library's own collective, the bar on
one node. ``busbw`` = gradient
bytes x 2(n-1)/n / time (GB = 1e9 B), as nccl-tests counts it; ``x fused`` = time over
ringtrain fused's. Timing as above, one reduction per step.

Check: at the end, every distributed configuration takes the same weights and runs one
more backward pass; its reduced gradients must equal, to float32 rounding, the average of
the ranks' gradients computed in float64 by MPI_Allreduce. The check line gives the
largest error, and the exit status is 1 when one is out of tolerance.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mpi4py
from mpi4py import MPI
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ringtrain as rt

CONFIGS = ("fused", "unfused", "ddp", "local", "ddp-ringtrain")
DEFAULT_CONFIGS = CONFIGS[:4]
DDP_CONFIGS = ("ddp", "ddp-ringtrain")
LABELS = {"fused": "ringtrain fused", "unfused": "ringtrain unfused", "ddp": "DDP gloo",
          "local": "one process", "ddp-ringtrain": "DDP ringtrain backend",
          "gloo-flat": "gloo, one flat buffer",
          "torch-flat": "ringtrain via torch, flat",
          "mpi-flat": "MPI_Allreduce, flat buffer"}
LEARNING_RATE = 1e-3
MOMENTUM = 0.9
MIN_STEPS, MAX_STEPS = 2, 100
CHECK_TOLERANCE = 1e-5
"""Largest error of a configuration's reduced gradients against the exact average, relative
to the largest gradient: a float32 average of n values is off by about n x 6e-8 of it; a
reduction gone wrong (a term lost or counted twice, a wrong divisor) by far more."""


@dataclass(frozen=True)
class ModelSpec:
    """A model to train: how to build it and the widths of its input and output."""

    name: str
    description: str
    features: int
    build: Callable[[], nn.Module]


def many_small() -> nn.Module:
    """50 blocks of Linear(64, 64) + LayerNorm(64) + ReLU: 200 small tensors."""
    blocks: list[nn.Module] = []
    for _ in range(50):
        blocks += [nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU()]
    return nn.Sequential(*blocks)


def few_large() -> nn.Module:
    """3 Linear(2048, 2048) with ReLU between: 6 tensors, 50 MB."""
    return nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 2048))


def medium() -> nn.Module:
    """24 blocks of Linear(512, 512) + LayerNorm(512) + ReLU: 96 tensors of 2 KB to 1 MB,
    25 MB in all, the middle ground where the fusion threshold matters most."""
    blocks: list[nn.Module] = []
    for _ in range(24):
        blocks += [nn.Linear(512, 512), nn.LayerNorm(512), nn.ReLU()]
    return nn.Sequential(*blocks)


MODELS = {
    "many-small": ModelSpec("many-small", "50 x (Linear(64, 64) + LayerNorm(64) + ReLU)", 64,
                            many_small),
    "few-large": ModelSpec("few-large", "3 x Linear(2048, 2048), ReLU between", 2048,
                           few_large),
    "medium": ModelSpec("medium", "24 x (Linear(512, 512) + LayerNorm(512) + ReLU)", 512,
                        medium),
}


@dataclass
class Case:
    """One timed row: what one step (or one reduction) runs, and its allreduces per step."""

    name: str
    run: Callable[[], Any]
    allreduces: str


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """Command-line options."""
    from ringtrain.collectives.config import parse_size
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="many-small,few-large",
                        help=f"comma-separated models: {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per configuration per round (default: enough "
                             "for the slowest configuration's warm-up step to fill "
                             "--round-seconds; at least 2, at most 100)")
    parser.add_argument("--round-seconds", type=float, default=0.5,
                        help="sets the default --steps (see there)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved rounds; the median round is reported")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per configuration before the rounds")
    parser.add_argument("--fusion-threshold", default=None,
                        help="bucket limit of the fused configuration, bytes or 64K/8M "
                             "(default: RINGTRAIN_FUSION_THRESHOLD or ringtrain's default)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help=f"comma-separated subset of {', '.join(CONFIGS)}")
    parser.add_argument("--no-reduce-only", dest="reduce_only", action="store_false",
                        help="skip the reduce-only measurement")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    parser.add_argument("--json", default=None,
                        help="also write the rows, every round's time, and the header to "
                             "this JSON file")
    arguments = parser.parse_args(argv)
    arguments.model = _choices(parser, "--model", arguments.model, MODELS)
    arguments.configs = _choices(parser, "--configs", arguments.configs, CONFIGS)
    if arguments.fusion_threshold is not None:
        try:
            arguments.fusion_threshold = parse_size(arguments.fusion_threshold)
        except ValueError:
            parser.error(f"--fusion-threshold takes a size (65536, 64K, 8M), got "
                         f"{arguments.fusion_threshold!r}")
        if arguments.fusion_threshold == 0:
            parser.error("--fusion-threshold 0 is the 'unfused' configuration; "
                         "give the fused one a positive size")
    if min(arguments.batch, arguments.rounds) < 1 or arguments.warmup < 0 or \
            (arguments.steps is not None and arguments.steps < 1) or \
            not arguments.round_seconds > 0:
        parser.error("--batch, --steps, --rounds and --round-seconds must be positive, "
                     "--warmup >= 0")
    if arguments.steps is None and arguments.warmup == 0:
        parser.error("--warmup 0 needs --steps: the default --steps is set from the "
                     "warm-up steps' time")
    return arguments


def _choices(parser: argparse.ArgumentParser, option: str, text: str,
             known: Any) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        parser.error(f"{option}: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                     f"choose from {', '.join(known)}")
    return [name for name in known if name in names]  # known order, no repeats


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ----------------------------------------------------------------------------- DDP's group


def start_process_groups() -> Any:
    """torch.distributed on the ranks ringtrain knows: the default group on ringtrain's
    backend (no variable needed under mpiexec), and a gloo group of the same ranks, which
    this returns."""
    import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)

    dist.init_process_group("ringtrain")
    return dist.new_group(backend="gloo")


# ----------------------------------------------------------------------------- the cases


def make_data(spec: ModelSpec, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets, made once."""
    generator = torch.Generator().manual_seed(seed * 1000 + rt.rank())
    return (torch.randn(batch, spec.features, generator=generator),
            torch.randn(batch, spec.features, generator=generator))


@dataclass
class Trainer:
    """One configuration's model, optimizer and step."""

    config: str
    model: nn.Module
    forward: nn.Module
    optimizer: Any
    case: Case


def make_trainer(config: str, spec: ModelSpec, data: tuple[torch.Tensor, torch.Tensor],
                 fusion_threshold: int | None, seed: int, gloo: Any = None) -> Trainer:
    """A fresh copy of the model (same weights on every rank) trained the ``config`` way."""
    torch.manual_seed(seed)
    model = spec.build()
    forward: nn.Module = model
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE,
                                     momentum=MOMENTUM)
    if config in ("fused", "unfused"):
        optimizer = rt.DistributedOptimizer(
            optimizer, named_parameters=model.named_parameters(),
            fusion_threshold=fusion_threshold if config == "fused" else 0)
    elif config == "ddp":
        forward = nn.parallel.DistributedDataParallel(model, process_group=gloo)
    elif config == "ddp-ringtrain":
        forward = nn.parallel.DistributedDataParallel(model)
    inputs, targets = data

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(forward(inputs), targets).backward()
        optimizer.step()

    return Trainer(config, model, forward, optimizer, Case(config, step, "0"))


def bucket_sizes(trainer: Trainer) -> list[tuple[int, bool]] | None:
    """The bytes of every bucket in launch order, and whether its gradients are packed into
    a fusion buffer (ringtrain reduces a bucket of one contiguous gradient where it lies).

    DDP's come from its logging data, a private API (None where it is missing); DDP
    rebuilds its buckets after the first step, in the order backward made the gradients,
    and always copies gradients into its buckets (gradient_as_bucket_view is off).
    """
    if trainer.config in ("fused", "unfused"):
        return [(bucket.nbytes, len(bucket.members) > 1)
                for bucket in trainer.optimizer.reducer.buckets]
    try:
        data = trainer.forward._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return [(int(size), True) for size in str(sizes).split(",")]
    except Exception:  # another torch version: the sizes are not shown, nothing else changes
        return None


def reduce_cases(trainers: list[Trainer], mpi_comm: Any, gloo: Any) -> list[Case]:
    """Rows of the reduce-only measurement, on the gradients the trainers left behind;
    ``MPI_Allreduce`` runs on ``mpi_comm``, gloo on the group ``gloo``."""
    cases = []
    for trainer in trainers:
        if trainer.config in ("fused", "unfused"):
            cases.append(Case(trainer.config, _ringtrain_reduction(trainer.optimizer),
                              trainer.case.allreduces))
    gradients = [p.grad for p in trainers[0].model.parameters()]
    configs = {trainer.config for trainer in trainers}
    if "ddp" in configs:
        cases.append(Case("gloo-flat", _flat_reduction(
            gradients, lambda flat: dist.all_reduce(flat, group=gloo)), "1"))
    if "ddp-ringtrain" in configs:
        cases.append(Case("torch-flat", _flat_reduction(gradients, dist.all_reduce), "1"))
    cases.append(Case("mpi-flat", _flat_reduction(gradients, _mpi_allreduce(mpi_comm)), "1"))
    return cases


def _ringtrain_reduction(optimizer: Any) -> Callable[[], None]:
    reducer = optimizer.reducer
    arrays = optimizer.gradient_arrays()
    # Backward finishes the last layer's gradients first; marking them in that order lets
    # the first buckets start while the others are still being marked, as in training.
    order = list(reversed(range(len(arrays))))

    def reduce() -> None:
        for index in order:
            reducer.mark_ready(index, arrays[index])
        reducer.wait()

    return reduce


def _flat_reduction(gradients: list[torch.Tensor],
                    allreduce: Callable[[torch.Tensor], None]) -> Callable[[], None]:
    """Pack every gradient into one buffer, sum it across ranks, average, unpack."""
    flat = torch.empty(sum(g.numel() for g in gradients), dtype=gradients[0].dtype)
    views, offset = [], 0
    for gradient in gradients:
        views.append(flat[offset:offset + gradient.numel()].view_as(gradient))
        offset += gradient.numel()
    sources = [g.reshape(-1) for g in gradients]
    size = rt.size()

    def reduce() -> None:
        torch.cat(sources, out=flat)
        allreduce(flat)
        flat.div_(size)
        # One call for all copies (what torch's own optimizers use): a Python loop over
        # 200 tensors would cost more than the reduction it is measured with.
        torch._foreach_copy_(gradients, views)

    return reduce


def _mpi_allreduce(comm: Any) -> Callable[[torch.Tensor], None]:
    """MPI_Allreduce (sum) in place on ``comm``."""
    return lambda flat: comm.Allreduce(MPI.IN_PLACE, flat.numpy(), MPI.SUM)


# ----------------------------------------------------------------------------- timing


def measure(cases: list[Case], arguments: argparse.Namespace
            ) -> tuple[dict[str, list[float]], int]:
    """Seconds per step of every case in every round (the slowest rank's), and the steps
    per round.

    Every case runs ``--warmup`` steps; then each of ``--rounds`` rounds runs the steps of
    every case in turn, each case after a barrier, starting one case later each round.
    """
    slowest = 0.0
    for case in cases:
        rt.barrier()
        for _ in range(arguments.warmup):
            start = time.perf_counter()
            case.run()
        if arguments.warmup:  # the last warm-up step's time
            slowest = max(slowest, time.perf_counter() - start)
    steps = arguments.steps
    if steps is None:  # every rank must run as many steps: agree on the slowest rank's
        slowest = max(rt.allgather_object(slowest, name="warm-up step time"))
        steps = min(MAX_STEPS, max(MIN_STEPS, math.ceil(arguments.round_seconds / slowest)))
    rounds = arguments.rounds
    seconds: dict[str, list[float]] = {case.name: [] for case in cases}
    for round_index in range(rounds):
        shift = round_index % len(cases)
        for case in cases[shift:] + cases[:shift]:
            rt.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                case.run()
            seconds[case.name].append((time.perf_counter() - start) / steps)
    every_rank = rt.allgather_object(seconds, name="step times")
    return {name: [max(times[name][r] for times in every_rank) for r in range(rounds)]
            for name in seconds}, steps


@dataclass
class Row:
    """One reported line."""

    model: str
    measurement: str
    config: str
    allreduces: str
    steps: int
    ms: float
    spread: float
    rounds_ms: list[float]
    samples_per_s: float | None = None
    comm_ms: float | None = None
    busbw: float | None = None
    versus_fused: float | None = None

    @property
    def label(self) -> str:
        return LABELS[self.config]

    def record(self) -> dict[str, Any]:
        fields = {key: value for key, value in vars(self).items() if key != "rounds_ms"}
        return {**fields, "label": self.label}


def make_row(model: str, measurement: str, case: Case, seconds: list[float], steps: int) -> Row:
    median = statistics.median(seconds)
    return Row(model, measurement, case.name, case.allreduces, steps, median * 1e3,
               (max(seconds) - min(seconds)) / median, [s * 1e3 for s in seconds])


# ----------------------------------------------------------------------------- report


def header(arguments: argparse.Namespace, argv: list[str], fusion_threshold: int,
           threads: int) -> dict[str, str]:
    """What the header says about the run."""
    from ringtrain import kernels
    library = MPI.Get_library_version().strip().splitlines()[0].strip()
    source = "--fusion-threshold" if arguments.fusion_threshold is not None else \
        "RINGTRAIN_FUSION_THRESHOLD" if "RINGTRAIN_FUSION_THRESHOLD" in os.environ else \
        "ringtrain's default"
    description = {
        "command": shlex.join(["mpiexec", "-n", str(rt.size()), "python", sys.argv[0], *argv]),
        "versions": f"ringtrain {rt.__version__}, torch {torch.__version__}, mpi4py "
                    f"{mpi4py.__version__}, numpy {np.__version__}, python "
                    f"{platform.python_version()}",
        "MPI": library,
        "ranks": f"{rt.size()} on {rt.cross_size()} node(s), {rt.local_size()} on this one",
        "cores": f"{os.cpu_count()} CPUs, {usable_cores()} usable per rank; torch threads "
                 f"per rank {threads}, ringtrain kernel threads {kernels.host_threads()}",
        "fusion threshold": f"{fusion_threshold} bytes ({fusion_threshold / (1 << 20):g} MiB, "
                            f"{source}); unfused: 0",
        "method": f"batch {arguments.batch} per rank; {arguments.warmup} warm-up steps per "
                  f"configuration, then {arguments.rounds} rounds of "
                  f"{arguments.steps or 'N'} steps of each, interleaved; median round of "
                  f"the slowest rank; comm ms = step ms - one-process step ms",
    }
    if set(DDP_CONFIGS) & set(arguments.configs):
        description["DDP"] = ("torch DistributedDataParallel's defaults (25 MiB buckets, the "
                              "first 1 MiB, gradient_as_bucket_view off) on a gloo group of "
                              "the same ranks, or on ringtrain's torch.distributed backend")
    return description


def model_line(spec: ModelSpec, model: nn.Module, batch: int) -> str:
    tensors = list(model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return (f"## {spec.name}: {spec.description}; {len(tensors)} tensors, "
            f"{nbytes / 1e6:.2f} MB of gradients; batch {batch} per rank")


def check_lines(trainers: list[Trainer], spec: ModelSpec,
                data: tuple[torch.Tensor, torch.Tensor], mpi_comm: Any
                ) -> tuple[list[str], bool]:
    """Whether every distributed configuration averages gradients right; and the line
    saying so.

    Every distributed configuration takes the first one's weights and runs one more
    backward pass (no step); its reduced gradients are compared with the average of the
    same gradients computed in float64 by ``MPI_Allreduce`` on ``mpi_comm``.
    """
    distributed = [t for t in trainers if t.config != "local"]
    if not distributed:
        return [], True
    inputs, targets = data
    weights = distributed[0].model.state_dict()
    plain = spec.build()  # no hooks: its gradients stay this rank's own
    plain.load_state_dict(weights)
    F.mse_loss(plain(inputs), targets).backward()
    exact = _flat_gradients(plain)
    mpi_comm.Allreduce(MPI.IN_PLACE, exact, MPI.SUM)
    exact /= rt.size()
    errors: dict[str, float] = {}
    for trainer in distributed:
        trainer.model.load_state_dict(weights)
        trainer.optimizer.zero_grad()
        F.mse_loss(trainer.forward(inputs), targets).backward()
        if trainer.config not in DDP_CONFIGS:  # DDP's backward returns them reduced
            trainer.optimizer.synchronize()
        error = np.abs(_flat_gradients(trainer.model) - exact).max()
        errors[trainer.config] = float(error / max(np.abs(exact).max(), 1e-30))
    every_rank = rt.allgather_object(errors, name="gradient errors")
    worst = {config: max(rank[config] for rank in every_rank) for config in errors}
    right = all(value <= CHECK_TOLERANCE for value in worst.values())
    shown = ", ".join(f"{LABELS[config]} {value:.1e}" for config, value in worst.items())
    verdict = "right" if right else f"WRONG (tolerance {CHECK_TOLERANCE:g})"
    return [f"check: reduced gradients {verdict}; largest error against a float64 average, "
            f"relative to the largest gradient, over ranks: {shown}"], right


def _flat_gradients(model: nn.Module) -> np.ndarray:
    return np.concatenate([p.grad.detach().numpy().reshape(-1) for p in model.parameters()]
                          ).astype(np.float64)


def bucket_lines(trainers: list[Trainer]) -> list[str]:
    """Bucket sizes of the fused and DDP configurations (unfused: one per tensor)."""
    lines = []
    for trainer in trainers:
        if trainer.config not in ("fused", *DDP_CONFIGS):
            continue
        sizes = bucket_sizes(trainer)
        shown = "unknown" if sizes is None else ", ".join(
            f"{nbytes / 1e6:.2f}{'*' if packed else ''}" for nbytes, packed in sizes[:8])
        more = f", +{len(sizes) - 8} more" if sizes and len(sizes) > 8 else ""
        lines.append(f"{LABELS[trainer.config]} buckets in launch order, MB: {shown}{more}")
    if lines:
        lines.append("(* copied into and out of a bucket buffer; the others are reduced "
                     "where they lie)")
    return lines


def train_lines(rows: list[Row]) -> list[str]:
    lines = [f"{'configuration':<26} {'allreduces':>10} {'step ms':>9} {'spread':>7} "
             f"{'samples/s':>10} {'comm ms':>8}"]
    for row in rows:
        comm = f"{row.comm_ms:>8.2f}" if row.comm_ms is not None else f"{'-':>8}"
        lines.append(f"{row.label:<26} {row.allreduces:>10} {row.ms:>9.2f} "
                     f"{row.spread:>6.0%} {row.samples_per_s:>10.0f} {comm}")
    by = {row.config: row for row in rows}
    if "fused" in by and "unfused" in by and by["fused"].comm_ms is not None:
        fused, unfused = by["fused"].comm_ms, by["unfused"].comm_ms
        ratio = f"{unfused / fused:.2f}" if fused > 0 else \
            f"n/a (fused comm {fused:.2f} ms: hidden behind compute, or noise)"
        lines.append(f"unfused comm / fused comm: {ratio}")
    if "fused" in by and "ddp" in by:
        lines.append(f"ringtrain fused step / DDP-gloo step: "
                     f"{by['fused'].ms / by['ddp'].ms:.2f} (below 1: ringtrain faster)")
    if "ddp-ringtrain" in by and "ddp" in by:
        lines.append(f"DDP on ringtrain step / DDP on gloo step: "
                     f"{by['ddp-ringtrain'].ms / by['ddp'].ms:.2f} (below 1: ringtrain faster)")
    if "ddp-ringtrain" in by and "fused" in by:
        lines.append(f"DDP on ringtrain step / ringtrain fused step: "
                     f"{by['ddp-ringtrain'].ms / by['fused'].ms:.2f}")
    return lines


def reduce_lines(rows: list[Row], nbytes: int, steps: int) -> list[str]:
    lines = [f"reduce only, {nbytes / 1e6:.2f} MB of gradients, {steps} reductions per "
             f"configuration per round:",
             f"{'reduction':<26} {'allreduces':>10} {'ms':>9} {'spread':>7} "
             f"{'busbw GB/s':>10} {'x fused':>8}"]
    for row in rows:
        versus = f"{row.versus_fused:>8.2f}" if row.versus_fused is not None else f"{'-':>8}"
        busbw = f"{row.busbw:>10.3f}" if row.busbw else f"{'-':>10}"  # none with one rank
        lines.append(f"{row.label:<26} {row.allreduces:>10} {row.ms:>9.2f} "
                     f"{row.spread:>6.0%} {busbw} {versus}")
    lines.append("x fused = time / ringtrain fused time (above 1: slower than fused)")
    return lines


def write_files(arguments: argparse.Namespace, description: dict[str, str],
                rows: list[Row]) -> None:
    if arguments.csv:
        records = [row.record() for row in rows]
        with open(arguments.csv, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump({"header": description,
                       "rows": [{**row.record(), "rounds_ms": row.rounds_ms} for row in rows]},
                      file, indent=1)


# ----------------------------------------------------------------------------- main


def benchmark_model(spec: ModelSpec, arguments: argparse.Namespace, mpi_comm: Any,
                    gloo: Any = None) -> tuple[list[Row], bool]:
    """Train, time and (on rank 0) print one model's rows; say whether every distributed
    configuration reduced the gradients right."""
    data = make_data(spec, arguments.batch, arguments.seed)
    trainers = [make_trainer(config, spec, data, arguments.fusion_threshold, arguments.seed,
                             gloo) for config in arguments.configs]
    seconds, steps = measure([t.case for t in trainers], arguments)
    for trainer in trainers:
        sizes = bucket_sizes(trainer) if trainer.config != "local" else []
        trainer.case.allreduces = "?" if sizes is None else str(len(sizes))
    rows = [make_row(spec.name, "train", t.case, seconds[t.config], steps) for t in trainers]
    samples = rt.size() * arguments.batch
    local = next((row.ms for row in rows if row.config == "local"), None)
    for row in rows:
        row.samples_per_s = samples / (row.ms / 1e3)
        if local is not None:
            row.comm_ms = row.ms - local
    nbytes = sum(p.numel() * p.element_size() for p in trainers[0].model.parameters())
    lines = [model_line(spec, trainers[0].model, arguments.batch), *bucket_lines(trainers),
             f"{steps} steps per configuration per round", *train_lines(rows)]
    if arguments.reduce_only:
        cases = reduce_cases(trainers, mpi_comm, gloo)
        seconds, steps = measure(cases, arguments)
        reduced = [make_row(spec.name, "reduce", case, seconds[case.name], steps)
                   for case in cases]
        fused = next((row.ms for row in reduced if row.config == "fused"), None)
        factor = 2 * (rt.size() - 1) / rt.size()
        for row in reduced:
            row.busbw = nbytes * factor / (row.ms / 1e3) / 1e9
            row.versus_fused = row.ms / fused if fused else None
        lines += reduce_lines(reduced, nbytes, steps)
        rows += reduced
    checks, right = check_lines(trainers, spec, data, mpi_comm)
    lines += checks
    if rt.rank() == 0:
        print("\n".join(["", *lines]), flush=True)
    return rows, right


def main(argv: list[str]) -> int:
    """Measure and print the tables on rank 0; 1 when a configuration reduced the
    gradients wrong, else 0."""
    arguments = parse_arguments(argv)
    rt.init()
    threads = max(1, usable_cores() // rt.local_size())
    torch.set_num_threads(threads)
    threshold = rt.GradientReducer([("probe", np.empty(1, np.float32))],
                                   fusion_threshold=arguments.fusion_threshold).fusion_threshold
    description = header(arguments, argv, threshold, threads)
    if rt.rank() == 0:
        print("\n".join(f"# {key}: {value}" for key, value in description.items()),
              flush=True)
    gloo = start_process_groups() if set(DDP_CONFIGS) & set(arguments.configs) else None
    # MPI_Allreduce's own communicator: its messages never meet ringtrain's.
    mpi_comm = MPI.COMM_WORLD.Dup()
    rows: list[Row] = []
    all_right = True
    for name in arguments.model:
        model_rows, right = benchmark_model(MODELS[name], arguments, mpi_comm, gloo)
        rows += model_rows
        all_right = all_right and right
    if dist.is_initialized():
        dist.destroy_process_group()
    mpi_comm.Free()
    if rt.rank() == 0:
        write_files(arguments, description, rows)
    rt.shutdown()
    return 0 if all_right else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SystemExit:
        raise
    except BaseException:
        # One failing rank would leave the others waiting in a collective forever.
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
