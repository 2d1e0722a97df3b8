"""Prints what init decided about CUDA-aware MPI (run with RINGTRAIN_LOG_LEVEL=INFO)."""

import ringtrain as rt
from ringtrain.collectives._world import world

rt.init()
print(f"rank {rt.rank()} decided {world().cuda_aware}", flush=True)
rt.shutdown()
