"""A Hugging Face Accelerate training loop on ringtrain's torch.distributed backend.

    mpiexec -n 2 python examples/torch_accelerate.py
    mpiexec -n 2 python examples/torch_accelerate.py --backend gloo   # the same on gloo

Accelerate picks gloo by itself for several CPU processes (and refuses another backend
in ``InitProcessGroupKwargs`` there), but takes a process group that is already made:
``init_process_group("ringtrain")`` before ``Accelerator(...)`` is the one line to add.
On GPUs Accelerate passes ``InitProcessGroupKwargs(backend="ringtrain")`` through as it
is. ``accelerator.prepare`` wraps the model in DDP and deals each rank its part of the
data; ``accelerator.backward`` runs DDP's reduction, here on ringtrain.

Rank 0 prints ``N ranks: final loss ... (backend ...)``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)

FEATURES = 16


def train(backend: str = "ringtrain", epochs: int = 2, samples: int = 1024,
          seed: int = 0) -> dict[str, torch.Tensor]:
    """Train on ``backend``; return the weights (the same on every rank)."""
    dist.init_process_group(backend)
    try:
        accelerator = Accelerator(cpu=True)
        generator = torch.Generator().manual_seed(seed)
        inputs = torch.randn(samples, FEATURES, generator=generator)
        targets = torch.cos(inputs.sum(1, keepdim=True))
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True,
                            generator=torch.Generator().manual_seed(seed))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for _ in range(epochs):
            for batch_inputs, batch_targets in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(batch_inputs), batch_targets)
                accelerator.backward(loss)
                optimizer.step()
        mean = accelerator.reduce(loss.detach(), reduction="mean")
        if accelerator.is_main_process:
            print(f"{accelerator.num_processes} ranks: final loss {mean.item():.5f} "
                  f"(backend {backend})", flush=True)
        weights = accelerator.unwrap_model(model).state_dict()
        return {name: value.detach().clone() for name, value in weights.items()}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # for a next Accelerator
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="ringtrain", help="torch.distributed backend")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.backend, args.epochs, args.samples, args.seed)


if __name__ == "__main__":
    main()
