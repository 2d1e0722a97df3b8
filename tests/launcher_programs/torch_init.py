"""``init_process_group("ringtrain")`` and one all_reduce: what a launcher test starts."""

import torch
import torch.distributed as dist

import ringtrain.torch  # noqa: F401 (registers the backend)

dist.init_process_group("ringtrain")
tensor = torch.ones(1)
dist.all_reduce(tensor)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {tensor.item():g}", flush=True)
dist.destroy_process_group()
