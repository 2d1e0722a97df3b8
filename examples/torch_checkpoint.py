"""Save and load a sharded model with torch.distributed.checkpoint, on ringtrain's backend.

    mpiexec -n 2 python examples/torch_checkpoint.py
    mpiexec -n 2 python examples/torch_checkpoint.py --checkpoint-dir /shared/ckpt

An FSDP2 model trains for a while; ``torch.distributed.checkpoint.save`` writes every
rank's shards of the weights and of AdamW's state (the ranks agree on a plan with
gather and broadcast calls, which on the ``"ringtrain"`` backend are ringtrain's); a
fresh model and optimizer ``load`` them back, the weights are compared with the saved
ones, and training goes on from there. With ``--backend gloo`` the same script runs on
gloo.

Rank 0 prints ``restored N tensors exactly`` and ``N ranks: final loss ... (backend
...)``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)

FEATURES, HIDDEN = 16, 64


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def run_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
              generator: torch.Generator) -> float:
    loss = torch.zeros(())
    for _ in range(steps):
        inputs = torch.randn(32, FEATURES, generator=generator)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), inputs.sum(1, keepdim=True).cos())
        loss.backward()
        optimizer.step()
    return loss.item()


def train(backend: str = "ringtrain", steps: int = 10, checkpoint_dir: str | None = None,
          seed: int = 0) -> dict[str, torch.Tensor]:
    """Train, save, load into a fresh model, train on; return the full weights."""
    dist.init_process_group(backend)
    temporary = checkpoint_dir is None
    try:
        if temporary:
            chosen = [tempfile.mkdtemp(prefix="ringtrain-dcp-") if dist.get_rank() == 0
                      else None]
            dist.broadcast_object_list(chosen, src=0)  # one node: a folder all ranks see
            checkpoint_dir = chosen[0]
        generator = torch.Generator().manual_seed(seed + dist.get_rank())
        model, optimizer = make_model(seed)
        run_steps(model, optimizer, steps, generator)
        weights, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=checkpoint_dir)
        saved = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))

        model, optimizer = make_model(seed + 1)  # other weights, until the load
        weights, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": weights, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=checkpoint_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        loaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        for name, value in saved.items():
            if not torch.equal(value, loaded[name]):
                raise RuntimeError(f"{name} differs after the load")
        loss = run_steps(model, optimizer, steps, generator)
        if dist.get_rank() == 0:
            print(f"restored {len(saved)} tensors exactly", flush=True)
            print(f"{dist.get_world_size()} ranks: final loss {loss:.5f} (backend {backend})",
                  flush=True)
        final = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if temporary:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(checkpoint_dir)
        return final
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="ringtrain", help="torch.distributed backend")
    parser.add_argument("--steps", type=int, default=10, help="steps before and after")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="a folder every rank sees (default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.backend, args.steps, args.checkpoint_dir, args.seed)


if __name__ == "__main__":
    main()
