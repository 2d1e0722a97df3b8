"""Prune a PyTorch MLP to 80% sparsity while it trains on every rank; gradients of pruned
weights stop travelling.

    mpiexec -n 2 python examples/pruning.py
    mpiexec -n 2 python examples/pruning.py --sparsity 0.95 --method structured

The data and the model are those of ``pytorch_mlp.py`` (a made-up 8-class problem; the
most frequent class holds about a fifth of the samples). What pruning adds:

- ``pruning.Pruner`` puts ``torch.nn.utils.prune``'s masks on the Linear layers'
  weights and, called after each ``optimizer.step()``, recomputes them on Zhu & Gupta's
  schedule: the sparsity rises from 0 at ``begin_step`` (half an epoch in) to
  ``--sparsity`` at ``end_step`` (the end of the next-to-last epoch), every quarter
  epoch; the last epoch trains the pruned network. Every rank computes the masks from
  its weights and the ranks check that they agree;
- the pruner hands the masks to the ``DistributedOptimizer``, whose buckets then carry
  only the gradients of the weights left, so the bytes sent per step fall with the
  sparsity (``optimizer.reducer.last_step_bytes``);
- pruned weights and their Adam moments are kept at exactly zero.

Rank 0 prints a line per epoch (training loss, held-out accuracy, sparsity of the pruned
weights, bytes each rank sent per step against the dense model's) and a last line ``N
ranks: final accuracy ...``. ``--batch-size`` is per rank.
"""

import argparse
import os

import numpy as np
import torch
from torch import nn

import ringtrain as rt
from pytorch_mlp import evaluate, make_loaders, make_model, parameters_digest
from ringtrain import pruning


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--samples", type=int, default=16384,
                        help="training samples (the held-out set has a quarter as many)")
    parser.add_argument("--hidden", type=int, default=128, help="width of the hidden layers")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--sparsity", type=float, default=0.8, help="the final sparsity")
    parser.add_argument("--method", choices=pruning.METHODS, default="magnitude")
    parser.add_argument("--scope", choices=pruning.SCOPES, default="global")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data")
    args = parser.parse_args()
    if args.epochs < 2 or args.batch_size < 1 or args.samples < 4:
        parser.error("--epochs must be at least 2, --batch-size 1, --samples 4")
    if not 0 <= args.sparsity < 1:
        parser.error("--sparsity must be in [0, 1)")
    return args


def main() -> None:
    args = parse_arguments()
    rt.init()
    rank, size = rt.rank(), rt.size()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // rt.local_size()))

    sampler, loader, held_out_loader = make_loaders(args)

    torch.manual_seed(args.seed + rank)  # different weights on every rank, until broadcast
    model = make_model(args.hidden)
    optimizer = rt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=args.lr),
                                        named_parameters=model.named_parameters())
    steps = len(loader)
    schedule = pruning.GradualSchedule(
        args.sparsity, begin_step=steps // 2, end_step=(args.epochs - 1) * steps,
        frequency=max(1, steps // 4))
    pruner = pruning.Pruner(model, schedule, method=args.method, scope=args.scope,
                            optimizer=optimizer)
    rt.broadcast_parameters(model.state_dict(), root_rank=0)  # the masks travel too
    pruner.refresh()
    dense_bytes = optimizer.reducer.bytes_per_step

    loss_function = nn.CrossEntropyLoss()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        total, seen = 0.0, 0
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = loss_function(model(inputs), labels)
            loss.backward()
            optimizer.step()
            pruner.step()
            total += loss.item() * len(labels)
            seen += len(labels)
        total, seen = rt.allreduce(np.array([total, seen], np.float64), op=rt.Sum,
                                   name="training loss")
        accuracy = evaluate(model, held_out_loader)
        sent = optimizer.reducer.last_step_bytes
        if rank == 0:
            print(f"epoch {epoch}/{args.epochs}: loss {total / seen:.4f}, accuracy "
                  f"{accuracy:.3f}, sparsity {pruner.sparsity():.3f}, bytes sent per step "
                  f"{sent:,} ({sent / dense_bytes:.2f} of dense {dense_bytes:,})", flush=True)

    if len(set(rt.allgather_object(parameters_digest(model), name="digest"))) != 1:
        raise RuntimeError("the ranks' parameters differ after training")
    if rank == 0:
        print(f"{size} ranks: final accuracy {accuracy:.3f}, sparsity {pruner.sparsity():.3f} "
              f"({args.method}, {args.scope}), bytes per step {sent:,} of {dense_bytes:,} "
              f"dense, parameters identical on every rank", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
