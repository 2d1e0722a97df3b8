"""Train a PyTorch MLP split into pipeline stages, with data parallelism across pipelines.

    mpiexec -n 2 python examples/pipeline_parallel.py                 # 2 stages
    mpiexec -n 4 python examples/pipeline_parallel.py --stages 2      # 2 stages × 2 replicas
    mpiexec -n 4 python examples/pipeline_parallel.py --stages 4 --schedule gpipe

The data are those of ``pytorch_mlp.py`` (made up from ``--seed``). The model is an
``nn.Sequential``; ``rt.pipeline.PipelineTrainer`` splits it into ``--stages`` stages
(balancing the layers' measured forward+backward time), keeps this rank's stage only,
and trains it with ``--microbatches`` micro-batches per step under the ``--schedule``.
With more ranks than stages, the ranks form ``np / stages`` pipelines, each fed its own
shard of the data by ``rt.DistributedSampler`` over the pipelines, and every stage's
gradients are averaged across its replicas.

Rank 0 prints a line per epoch (training loss, held-out accuracy, samples per second
over all pipelines, seconds) and a last line ``N ranks: final accuracy ...``.
``--batch-size`` is per pipeline.
"""

import argparse
import os
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import ringtrain as rt
from ringtrain.pipeline import PipelineTrainer
from _progress import epoch_line
from pytorch_mlp import CLASSES, FEATURES, make_datasets


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline depth (default: 2 on an even number of ranks, else "
                             "every rank a stage)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples per pipeline per step")
    parser.add_argument("--samples", type=int, default=16384,
                        help="training samples (the held-out set has a quarter as many)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the hidden layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data")
    args = parser.parse_args()
    if args.epochs < 1 or args.batch_size < args.microbatches:
        parser.error("--epochs must be at least 1, --batch-size at least --microbatches")
    return args


def make_model(hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


def main() -> None:
    args = parse_arguments()
    rt.init()
    size = rt.size()
    stages = args.stages or (2 if size % 2 == 0 else size)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rt.local_size()))

    train_set, held_out_set = make_datasets(args.samples, args.seed)
    torch.manual_seed(args.seed)
    sample = train_set.tensors[0][:args.batch_size]
    trainer = PipelineTrainer(make_model(args.hidden),
                              lambda params: torch.optim.Adam(params, lr=args.lr),
                              nn.CrossEntropyLoss(), stages=stages,
                              microbatches=args.microbatches, schedule=args.schedule,
                              sample=sample)
    layout = trainer.layout
    # Each pipeline takes its own shard; the stages of one pipeline see the same batches.
    sampler = rt.DistributedSampler(len(train_set), mode="drop", seed=args.seed,
                                    num_replicas=layout.replicas, rank=layout.replica)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True)
    held_out, labels = held_out_set.tensors

    start = time.perf_counter()
    trained = 0
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        sampler.set_epoch(epoch)
        losses = [trainer.train_step(inputs, targets) for inputs, targets in loader]
        train_seconds = time.perf_counter() - epoch_start
        seen = len(loader) * args.batch_size * layout.replicas
        trained += seen
        loss = float(np.mean(losses))
        outputs = trainer.eval(held_out)
        correct = int((outputs.argmax(dim=1) == labels).sum()) \
            if layout.last and layout.replica == 0 else 0
        accuracy = int(rt.allreduce(np.array([correct]), op=rt.Sum, name="accuracy")[0]) \
            / len(labels)
        if rt.rank() == 0:
            print(epoch_line(epoch, args.epochs, loss, accuracy, seen,
                             time.perf_counter() - epoch_start, train_seconds), flush=True)
    seconds = time.perf_counter() - start
    if rt.rank() == 0:
        print(f"{size} ranks: final accuracy {accuracy:.3f}, loss {loss:.4f}, "
              f"{trained:,} samples in {seconds:.1f} s, {stages} stages × "
              f"{layout.replicas} replicas, {args.schedule}, split at {trainer.split_points}",
              flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
