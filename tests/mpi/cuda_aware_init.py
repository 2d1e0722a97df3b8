"""Prints what init decided about CUDA-aware MPI and the GPU (run with
RINGTRAIN_LOG_LEVEL=INFO)."""

import ringtrain as rt
from ringtrain.collectives.world._world import world

rt.init()
print(f"rank {rt.rank()} decided {world().cuda_aware}", flush=True)
print(f"rank {rt.rank()} uses GPU {world().gpu}", flush=True)
rt.shutdown()
