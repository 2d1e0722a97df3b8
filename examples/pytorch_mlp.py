"""Train a PyTorch MLP classifier on every rank, with gradients averaged across ranks.

    mpiexec -n 2 python examples/pytorch_mlp.py
    mpiexec -n 4 python examples/pytorch_mlp.py --epochs 10 --compression fp16

The data are made up here, from ``--seed`` alone, so every rank builds the same set
without downloading anything: random inputs labelled by a fixed random "teacher"
network (8 classes; the most frequent holds about a fifth of the samples, the level
to beat). The pieces of a data-parallel training script:

- ``rt.DistributedSampler`` in ``"pad"`` mode deals each rank its own shard of the
  training set, reshuffled every epoch (``set_epoch``); every rank gets as many
  batches, so every gradient allreduce has all ranks taking part;
- ``rt.DistributedOptimizer`` averages the gradients across ranks while ``backward()``
  runs (fusion buckets, optional fp16/bf16 compression), then steps Adam;
- ``rt.broadcast_parameters`` and ``rt.broadcast_optimizer_state`` start every rank
  from rank 0's weights (each rank initialises its own differently here, on purpose);
- the held-out set is split with ``mode="exact"`` (every sample once, on one rank), and
  the counts are summed with ``rt.allreduce(..., op=rt.Sum)``: the accuracy printed is
  that of the whole held-out set.

Rank 0 prints a line per epoch (training loss over all ranks, held-out accuracy,
samples per second over all ranks, seconds) and a last line ``N ranks: final accuracy
...``; with ``--progress always`` (or when stdout is a terminal, which it is not under
mpiexec) also a progress bar. ``--batch-size`` is per rank: the global batch is ``N``
times larger.
"""

import argparse
import hashlib
import os
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt
from _progress import (PROGRESS_CHOICES, PROGRESS_HELP, ProgressBar, epoch_line,
                       show_bar)

FEATURES = 16
CLASSES = 8
TEACHER_HIDDEN = 32


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--samples", type=int, default=16384,
                        help="training samples (the held-out set has a quarter as many)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the hidden layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none",
                        help="how gradients travel")
    parser.add_argument("--fusion-threshold", type=int, default=None,
                        help="gradient bucket size in bytes, 0 for one allreduce per "
                             "parameter (default: RINGTRAIN_FUSION_THRESHOLD or 8 MiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data")
    parser.add_argument("--progress", choices=PROGRESS_CHOICES, default="auto",
                        help=PROGRESS_HELP)
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < 1 or args.samples < 4:
        parser.error("--epochs and --batch-size must be at least 1, --samples at least 4")
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


def make_loaders(args: argparse.Namespace,
                 ) -> tuple[rt.DistributedSampler, DataLoader, DataLoader]:
    """This rank's training sampler and loader (a padded shard, reshuffled by
    ``set_epoch``) and its held-out loader (every sample once, on one rank)."""
    train_set, held_out_set = make_datasets(args.samples, args.seed)
    train_sampler = rt.DistributedSampler(len(train_set), mode="pad", seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    held_out_loader = DataLoader(
        held_out_set, batch_size=1024,
        sampler=rt.DistributedSampler(len(held_out_set), mode="exact", shuffle=False))
    return train_sampler, train_loader, held_out_loader


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader,
                bar: ProgressBar) -> tuple[float, int]:
    """One pass over this rank's shard; returns (sum of the losses, samples seen)."""
    model.train()
    loss_function = nn.CrossEntropyLoss()
    total, seen = 0.0, 0
    for step, (inputs, labels) in enumerate(loader, 1):
        optimizer.zero_grad()
        loss = loss_function(model(inputs), labels)
        loss.backward()  # the gradient allreduces start here, bucket by bucket
        optimizer.step()  # waits for them, then steps Adam with the averages
        total += loss.item() * len(labels)
        seen += len(labels)
        bar.update(step, loss.item())
    bar.close()
    return total, seen


def evaluate(model: nn.Module, loader: DataLoader) -> float:
    """Accuracy over the whole held-out set: each rank counts its shard, the counts are summed."""
    model.eval()
    correct, seen = 0, 0
    with torch.no_grad():
        for inputs, labels in loader:
            correct += int((model(inputs).argmax(dim=1) == labels).sum())
            seen += len(labels)
    counts = rt.allreduce(np.array([correct, seen], np.int64), op=rt.Sum, name="accuracy")
    return int(counts[0]) / int(counts[1])


def parameters_digest(model: nn.Module) -> str:
    """A hash of the parameters' bits: equal on every rank while training is in sync."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    args = parse_arguments()
    rt.init()
    rank, size = rt.rank(), rt.size()
    draw_bars = rank == 0 and show_bar(args.progress)
    # The ranks on a node share its cores.
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rt.local_size()))

    train_sampler, train_loader, held_out_loader = make_loaders(args)

    torch.manual_seed(args.seed + rank)  # different weights on every rank, until broadcast
    model = make_model(args.hidden)
    optimizer = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr),
        named_parameters=model.named_parameters(),
        compression=getattr(rt.Compression, args.compression),
        fusion_threshold=args.fusion_threshold)
    # Every rank starts from rank 0's weights and optimizer state (the state matters
    # when rank 0 has loaded a checkpoint; here it is still empty).
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    rt.broadcast_optimizer_state(optimizer, root_rank=0)

    start = time.perf_counter()
    trained = 0
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        train_sampler.set_epoch(epoch)
        bar = ProgressBar(f"epoch {epoch}/{args.epochs}", len(train_loader), enabled=draw_bars)
        loss_sum, seen = train_epoch(model, optimizer, train_loader, bar)
        train_seconds = time.perf_counter() - epoch_start
        loss_sum, seen = rt.allreduce(np.array([loss_sum, seen], np.float64), op=rt.Sum,
                                      name="training loss")
        loss, seen = loss_sum / seen, int(seen)
        trained += seen
        accuracy = evaluate(model, held_out_loader)
        if rank == 0:
            print(epoch_line(epoch, args.epochs, loss, accuracy, seen, time.perf_counter() -
                             epoch_start, train_seconds), flush=True)
    seconds = time.perf_counter() - start

    if len(set(rt.allgather_object(parameters_digest(model), name="digest"))) != 1:
        raise RuntimeError("the ranks' parameters differ after training")
    if rank == 0:
        print(f"{size} ranks: final accuracy {accuracy:.3f}, loss {loss:.4f}, "
              f"{trained:,} samples in {seconds:.1f} s, compression {args.compression}, "
              f"parameters identical on every rank", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
