"""Train with PyTorch's FSDP2 (``fully_shard``) on ringtrain's torch.distributed backend.

    mpiexec -n 2 python examples/torch_fsdp.py
    mpiexec -n 2 python examples/torch_fsdp.py --backend gloo     # the same script on gloo

Each rank keeps 1/N of every weight, of its gradient and of AdamW's state; FSDP
all-gathers a layer's weights before its forward and backward and reduce-scatters its
gradients after, and on the ``"ringtrain"`` backend those are ringtrain's allgather and
reducescatter. The script differs from a torchrun one in one word:
``init_process_group("ringtrain")`` (after ``import ringtrain.torch``).

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

import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)

FEATURES, HIDDEN, OUTPUTS = 32, 64, 4


def make_batches(steps: int, batch_size: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's batches: a noisy linear teacher's, from the seed and the rank."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, OUTPUTS, generator=generator) / FEATURES ** 0.5
    generator.manual_seed(seed + 1000 * (dist.get_rank() + 1))
    batches = []
    for _ in range(steps):
        inputs = torch.randn(batch_size, FEATURES, generator=generator)
        batches.append((inputs, inputs @ teacher))
    return batches


def train(backend: str = "ringtrain", epochs: int = 3, steps: int = 16, batch_size: int = 32,
          seed: int = 0) -> dict[str, torch.Tensor]:
    """Train on ``backend``; return the full (unsharded) weights, the same on every rank."""
    dist.init_process_group(backend)
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(seed)  # every rank starts from the same weights
        model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(),
                              nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUTPUTS))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batches = make_batches(steps, batch_size, seed)
        for epoch in range(epochs):
            total = torch.zeros(2)
            for inputs, targets in batches:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(inputs), targets)
                loss.backward()
                optimizer.step()
                total += torch.tensor([loss.item(), 1.0])
            dist.all_reduce(total)
            if dist.get_rank() == 0:
                print(f"epoch {epoch}: loss {total[0] / total[1]:.5f}", flush=True)
        if dist.get_rank() == 0:
            print(f"{dist.get_world_size()} ranks: final loss {total[0] / total[1]:.5f} "
                  f"(backend {backend})", flush=True)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="ringtrain", help="torch.distributed backend")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.backend, args.epochs, args.steps, args.batch_size, args.seed)


if __name__ == "__main__":
    main()
