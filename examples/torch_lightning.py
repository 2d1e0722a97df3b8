"""A PyTorch Lightning ``Trainer`` with DDP on ringtrain's torch.distributed backend.

    mpiexec -n 2 python examples/torch_lightning.py
    mpiexec -n 2 python examples/torch_lightning.py --backend gloo   # the same on gloo

The one word: ``DDPStrategy(process_group_backend="ringtrain")`` (after ``import
ringtrain.torch``). Under mpiexec Lightning finds its MPI cluster environment and wants
``devices`` (the ranks on each node) times ``num_nodes`` to be the number of ranks, as
on any cluster; the script reads them from the variables the MPI launcher sets.

Rank 0 prints ``N ranks: final loss ... (backend ...)``.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)

FEATURES = 16


def launched_ranks() -> tuple[int, int]:
    """(ranks on this node, ranks in all) as MPICH's, Open MPI's or torchrun's launcher
    announces them."""
    def first(*names: str) -> int:
        return next((int(os.environ[n]) for n in names if os.environ.get(n)), 1)

    here = first("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
    return here, first("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")


class Regression(L.LightningModule):
    """A small network fitting a smooth function of its inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))
        self.last_loss = torch.zeros(())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.net(inputs), targets)
        self.last_loss = loss.detach()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def train(backend: str = "ringtrain", epochs: int = 2, samples: int = 1024,
          seed: int = 0) -> dict[str, torch.Tensor]:
    """Fit on ``backend``; return the weights (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    targets = torch.sin(inputs.sum(1, keepdim=True))
    torch.manual_seed(seed)
    model = Regression()
    here, everyone = launched_ranks()
    trainer = L.Trainer(accelerator="cpu", devices=here, num_nodes=everyone // here,
                        strategy=DDPStrategy(process_group_backend=backend),
                        max_epochs=epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(model, DataLoader(TensorDataset(inputs, targets), batch_size=32))
        loss = model.last_loss.clone()
        dist.all_reduce(loss)
        if trainer.global_rank == 0:
            print(f"{trainer.world_size} ranks: final loss "
                  f"{loss.item() / trainer.world_size:.5f} (backend {backend})", flush=True)
        return {name: value.detach().clone() for name, value in model.state_dict().items()}
    finally:
        if dist.is_initialized():  # Lightning leaves the group for the next fit
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
