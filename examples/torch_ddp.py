"""Train with PyTorch's DistributedDataParallel on ringtrain's torch.distributed backend.

    mpiexec -n 2 python examples/torch_ddp.py
    ringtrain-run -np 4 python examples/torch_ddp.py --hook fp16
    mpiexec -n 2 python examples/torch_ddp.py --backend gloo     # the same script on gloo

A torch.distributed script moves to ringtrain by one word: ``init_process_group("ringtrain")``
(after ``import ringtrain.torch``, which registers the backend). Under mpiexec or
ringtrain-run nothing else is set: rank and size come from MPI. The rest is the script
as PyTorch users write it: ``DistributedSampler`` deals each rank its part of every
epoch, DDP averages the gradients while ``backward()`` runs (optionally through
ringtrain's fp16 or bf16 communication hook), SGD steps.

The data are made up from ``--seed`` (a random linear teacher plus noise), so every
rank builds the same set. Rank 0 prints the loss per epoch and a last line ``N ranks:
final loss ... (backend ...)``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringtrain.torch  # registers the "ringtrain" backend

FEATURES, HIDDEN, OUTPUTS = 32, 64, 4


def make_dataset(samples: int, seed: int) -> TensorDataset:
    """Inputs and targets of a noisy linear teacher: a function of the seed only."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, OUTPUTS, generator=generator) / FEATURES ** 0.5
    targets = inputs @ teacher + 0.01 * torch.randn(samples, OUTPUTS, generator=generator)
    return TensorDataset(inputs, targets)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed + dist.get_rank())  # different on purpose: DDP broadcasts rank 0's
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN),
                         nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))


def train(backend: str = "ringtrain", epochs: int = 3, samples: int = 2048,
          batch_size: int = 32, hook: str = "none", seed: int = 0) -> dict[str, torch.Tensor]:
    """Train on ``backend``; return rank 0's weights (the same on every rank)."""
    dist.init_process_group(backend)
    try:
        model = DistributedDataParallel(make_model(seed))
        if hook != "none":
            hooks = {"fp16": ringtrain.torch.fp16_hook, "bf16": ringtrain.torch.bf16_hook}
            model.register_comm_hook(None, hooks[hook])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        dataset = make_dataset(samples, seed)
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            total = torch.zeros(2)
            for inputs, targets in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(inputs), targets)
                loss.backward()
                optimizer.step()
                total += torch.tensor([loss.item() * len(inputs), len(inputs)])
            dist.all_reduce(total)
            if dist.get_rank() == 0:
                print(f"epoch {epoch}: loss {total[0] / total[1]:.5f}", flush=True)
        if dist.get_rank() == 0:
            print(f"{dist.get_world_size()} ranks: final loss {total[0] / total[1]:.5f} "
                  f"(backend {backend}, hook {hook})", flush=True)
        return {name: value.detach().clone() for name, value in model.module.state_dict().items()}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="ringtrain", help="torch.distributed backend")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--hook", choices=("none", "fp16", "bf16"), default="none",
                        help="ringtrain's DDP communication hook (ringtrain backend only)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.backend, args.epochs, args.samples, args.batch_size, args.hook, args.seed)


if __name__ == "__main__":
    main()
