"""Pipeline parallelism: GPipe against 1F1B, the bubble against its model, and
point-to-point tensors against mpi4py's own Send/Recv.

    mpiexec -n 2 python benchmarks/pipeline.py
    mpiexec -n 4 python benchmarks/pipeline.py --width 512 --batch 256

**Point-to-point** (ranks 0 and 1): a ping-pong of float32 messages of every power of
two from 16 B to ``--max-bytes``; ``rt.send``/``rt.recv`` (header checked by the pair;
data in the header's message up to 4 KiB, behind it above) against
``comm.Send``/``comm.Recv`` on a duplicate of ``MPI.COMM_WORLD``, on the same buffers,
interleaved round by round. Each
row: the median over ``--rounds`` rounds of the one-way time (half a round trip, averaged
over the round's repeats), the bandwidth, and ringtrain's time over mpi4py's. Then the
same ping-pong of torch CPU tensors against numpy arrays over the same memory, at a few
sizes; and of the asynchronous forms, each completed by ``rt.synchronize`` at once,
against the blocking ones: ``isend`` with ``irecv`` into an array, and with
``irecv(None)`` (a new array of the sender's shape, as the pipeline trainer receives).

**Pipeline** (every rank a stage): an MLP of ``--layers`` Linear(width, width) + ReLU
layers split evenly, a batch of ``--batch`` rows, SGD; for 1, 2, 4 and 8 micro-batches
and each schedule, samples/s (the median step over ``--rounds`` rounds of ``--steps``
steps, schedules interleaved), the bubble measured and the model's
``(p - 1) / (m + p - 1)``. The bubble measured is ``1 - busy / step``, averaged over the
stages, where ``busy`` is the time the stage takes to run its forwards and backwards of
the same micro-batches alone (no messages): it counts the idle time of the schedule and
the time spent moving activations and gradients.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

import ringtrain as rt
from ringtrain.pipeline import PipelineTrainer, bubble_fraction

MICROBATCHES = (1, 2, 4, 8)
TORCH_BYTES = (16, 4096, 65536, 1 << 20)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-bytes", type=int, default=16 << 20)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    return parser.parse_args()


# ------------------------------------------------------------------ point-to-point

def ping_pong(send, recv, peer: int, first: bool, repeats: int) -> float:
    """Seconds of one one-way trip, averaged over ``repeats`` round trips."""
    start = time.perf_counter()
    for _ in range(repeats):
        if first:
            send(peer)
            recv(peer)
        else:
            recv(peer)
            send(peer)
    return (time.perf_counter() - start) / (2 * repeats)


def interleaved_medians(methods: dict[str, tuple], rounds: int, peer: int, first: bool,
                        nbytes: int) -> list[float]:
    """Each method's median one-way seconds over ``rounds`` rounds, the methods taken in
    turn within each round (after a warm-up of each), as many round trips a round as
    moves about 4 MiB (3 to 200)."""
    repeats = max(3, min(200, (4 << 20) // nbytes))
    for calls in methods.values():
        ping_pong(*calls, peer, first, 2)
    times: dict[str, list[float]] = {method: [] for method in methods}
    for _ in range(rounds):
        for method, calls in methods.items():
            times[method].append(ping_pong(*calls, peer, first, repeats))
    return [statistics.median(times[method]) for method in methods]


def point_to_point(args: argparse.Namespace) -> None:
    me = rt.rank()
    comm = MPI.COMM_WORLD.Dup()
    if me < 2:
        peer, first = 1 - me, me == 0
        if me == 0:
            print("point-to-point, ranks 0 and 1 (one-way time, median of "
                  f"{args.rounds} rounds)")
            print(f"{'bytes':>10} {'ringtrain us':>13} {'mpi4py us':>10} {'GB/s':>7} "
                  f"{'mpi4py GB/s':>12} {'ratio':>6}")
        nbytes = 16
        while nbytes <= args.max_bytes:
            data = np.ones(nbytes // 4, np.float32)
            into = np.empty_like(data)
            ours_s, theirs_s = interleaved_medians({
                "ringtrain": (lambda p: rt.send(data, p, name="x"),
                              lambda p: rt.recv(into, p, name="x")),
                "mpi4py": (lambda p: comm.Send(data, p), lambda p: comm.Recv(into, p)),
            }, args.rounds, peer, first, nbytes)
            if me == 0:
                print(f"{nbytes:>10} {ours_s * 1e6:>13.1f} {theirs_s * 1e6:>10.1f} "
                      f"{nbytes / ours_s / 1e9:>7.2f} {nbytes / theirs_s / 1e9:>12.2f} "
                      f"{ours_s / theirs_s:>6.2f}", flush=True)
            nbytes *= 2
        torch_tensors(args, peer, first)
        asynchronous_forms(args, peer, first)
    comm.Free()
    rt.barrier()


def torch_tensors(args: argparse.Namespace, peer: int, first: bool) -> None:
    """rt.send/rt.recv of torch CPU tensors against the same of numpy arrays over the
    same memory, interleaved round by round."""
    if rt.rank() == 0:
        print(f"\ntorch CPU tensors, ranks 0 and 1 (one-way time, median of {args.rounds} "
              f"rounds)\n{'bytes':>10} {'numpy us':>9} {'torch us':>9} {'ratio':>6}")
    for nbytes in TORCH_BYTES:
        data = np.ones(nbytes // 4, np.float32)
        into = np.empty_like(data)
        tensor, tensor_into = torch.from_numpy(data), torch.from_numpy(into)
        numpy_s, torch_s = interleaved_medians({
            "numpy": (lambda p: rt.send(data, p, name="x"),
                      lambda p: rt.recv(into, p, name="x")),
            "torch": (lambda p: rt.send(tensor, p, name="x"),
                      lambda p: rt.recv(tensor_into, p, name="x")),
        }, args.rounds, peer, first, nbytes)
        if rt.rank() == 0:
            print(f"{nbytes:>10} {numpy_s * 1e6:>9.1f} {torch_s * 1e6:>9.1f} "
                  f"{torch_s / numpy_s:>6.2f}", flush=True)


def asynchronous_forms(args: argparse.Namespace, peer: int, first: bool) -> None:
    """isend/irecv completed by synchronize at once against send/recv, numpy arrays,
    interleaved round by round."""
    if rt.rank() == 0:
        print(f"\nasynchronous forms, ranks 0 and 1 (one-way time, median of {args.rounds} "
              f"rounds)\n{'bytes':>10} {'send/recv us':>13} {'isend/irecv us':>15} "
              f"{'irecv(None) us':>15} {'ratios':>11}")
    for nbytes in TORCH_BYTES:
        data = np.ones(nbytes // 4, np.float32)
        into = np.empty_like(data)
        blocking_s, into_s, new_s = interleaved_medians({
            "blocking": (lambda p: rt.send(data, p, name="x"),
                         lambda p: rt.recv(into, p, name="x")),
            "into": (lambda p: rt.synchronize(rt.isend(data, p, name="x")),
                     lambda p: rt.synchronize(rt.irecv(into, p, name="x"))),
            "new": (lambda p: rt.synchronize(rt.isend(data, p, name="x")),
                    lambda p: rt.synchronize(rt.irecv(None, p, name="x"))),
        }, args.rounds, peer, first, nbytes)
        if rt.rank() == 0:
            print(f"{nbytes:>10} {blocking_s * 1e6:>13.1f} {into_s * 1e6:>15.1f} "
                  f"{new_s * 1e6:>15.1f} {into_s / blocking_s:>5.2f} "
                  f"{new_s / blocking_s:>5.2f}", flush=True)


# ------------------------------------------------------------------ the pipeline

def make_model(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers)


def busy_seconds(trainer: PipelineTrainer, args: argparse.Namespace) -> float:
    """This stage's forwards and backwards of one step's micro-batches, without messages."""
    chunks = torch.tensor_split(torch.randn(args.batch, args.width), trainer.microbatches)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        for chunk in chunks:
            x = chunk.requires_grad_(not trainer.layout.first)
            trainer.module(x).sum().backward()
        times.append(time.perf_counter() - start)
    trainer.module.zero_grad()
    return statistics.median(times)


def pipeline(args: argparse.Namespace) -> None:
    stages = rt.size()
    batch, target = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    trainers = {(kind, m): PipelineTrainer(make_model(args),
                                           lambda p: torch.optim.SGD(p, lr=1e-3),
                                           nn.functional.mse_loss, stages=stages,
                                           split_points=None if stages == 1 else
                                           [2 * args.layers * s // stages
                                            for s in range(1, stages)],
                                           microbatches=m, schedule=kind)
                for m in MICROBATCHES for kind in ("gpipe", "1f1b")}
    step_times: dict[tuple[str, int], list[float]] = {key: [] for key in trainers}
    for trainer in trainers.values():  # warm up
        trainer.train_step(batch, target)
    for _ in range(args.rounds):
        for key, trainer in trainers.items():
            rt.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step(batch, target)
            elapsed = (time.perf_counter() - start) / args.steps
            step_times[key].append(float(rt.allreduce(np.array([elapsed]), op=rt.Max,
                                                      name="step time")[0]))
    if rt.rank() == 0:
        print(f"\npipeline: {stages} stages, {args.layers} x Linear({args.width}, "
              f"{args.width}), batch {args.batch}; median step of {args.rounds} rounds")
        print(f"{'micro':>5} {'schedule':>8} {'samples/s':>10} {'bubble':>7} {'model':>6} "
              f"{'held':>5} {'1f1b/gpipe':>10}")
    for m in MICROBATCHES:
        for kind in ("gpipe", "1f1b"):
            trainer = trainers[(kind, m)]
            step = statistics.median(step_times[(kind, m)])
            busy = busy_seconds(trainer, args)
            bubble = float(rt.allreduce(np.array([1.0 - busy / step]), name="bubble")[0])
            held = int(rt.allreduce(np.array([trainer.peak_activations]), op=rt.Max,
                                    name="held")[0])
            if rt.rank() == 0:
                ratio = "" if kind == "gpipe" else \
                    f"{statistics.median(step_times[('gpipe', m)]) / step:>10.2f}"
                print(f"{m:>5} {kind:>8} {args.batch / step:>10.0f} {bubble:>7.2f} "
                      f"{bubble_fraction(stages, m):>6.2f} {held:>5} {ratio}", flush=True)


def main() -> None:
    args = parse_arguments()
    rt.init()
    torch.set_num_threads(1)
    if rt.size() >= 2:
        point_to_point(args)
    pipeline(args)
    rt.shutdown()


if __name__ == "__main__":
    main()
