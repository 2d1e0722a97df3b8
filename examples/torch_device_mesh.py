"""Data x tensor parallelism on a 2-D DeviceMesh, on ringtrain's torch.distributed backend.

    mpiexec -n 4 python examples/torch_device_mesh.py                # 2 x 2
    mpiexec -n 4 python examples/torch_device_mesh.py --backend gloo # the same on gloo

The ranks form a ``(dp, tp)`` mesh: along ``tp`` each feed-forward block is split
Megatron-style (the first linear layer by columns, the second by rows, one all-reduce
per block in the forward pass), along ``dp`` the model is sharded with FSDP2 and each
``dp`` group trains on its own batches. DeviceMesh makes a process group per row and
per column of the mesh; on the ``"ringtrain"`` backend each is a ringtrain process set.

Rank 0 prints the loss per epoch and ``N ranks: final loss ... (backend ...)``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)

FEATURES, HIDDEN = 32, 128


class Block(nn.Module):
    """A residual feed-forward block."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def train(backend: str = "ringtrain", epochs: int = 3, steps: int = 8, batch_size: int = 16,
          tp: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Train on ``backend``; return the full weights, the same on every rank."""
    dist.init_process_group(backend)
    try:
        size = dist.get_world_size()
        if size % tp:
            raise SystemExit(f"--tp {tp} must divide the number of ranks ({size})")
        mesh = init_device_mesh("cpu", (size // tp, tp), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(seed)
        model = nn.Sequential(Block(), Block())
        for block in model:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(),
                                                   "down": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        generator = torch.Generator().manual_seed(seed)
        teacher = torch.randn(FEATURES, FEATURES, generator=generator) / FEATURES ** 0.5
        generator.manual_seed(seed + 1 + mesh.get_local_rank("dp"))  # one data stream per dp
        for epoch in range(epochs):
            total = torch.zeros(2)
            for _ in range(steps):
                inputs = torch.randn(batch_size, FEATURES, generator=generator)
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(inputs), torch.sin(inputs @ teacher))
                loss.backward()
                optimizer.step()
                total += torch.tensor([loss.item(), 1.0])
            dist.all_reduce(total)
            if dist.get_rank() == 0:
                print(f"epoch {epoch}: loss {total[0] / total[1]:.5f}", flush=True)
        if dist.get_rank() == 0:
            print(f"{size} ranks: final loss {total[0] / total[1]:.5f} (backend {backend}, "
                  f"mesh {size // tp} x {tp})", flush=True)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="ringtrain", help="torch.distributed backend")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--tp", type=int, default=2, help="ranks along the tensor dimension")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.backend, args.epochs, args.steps, args.batch_size, args.tp, args.seed)


if __name__ == "__main__":
    main()
