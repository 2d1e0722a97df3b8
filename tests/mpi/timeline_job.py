"""A job that records a timeline under a plain mpiexec: a few collectives, then the end of
the program, with or without ringtrain.shutdown() (argument ``shutdown``). Rank 0 should
merge the ranks' files into the path of RINGTRAIN_TIMELINE (or HOROVOD_TIMELINE)."""

import sys

import numpy as np

import ringtrain as rt

rt.init()
for step in range(3):
    rt.allreduce(np.full(16, float(rt.rank())), name=f"step {step}")
rt.broadcast(np.arange(4.0), root_rank=0, name="weights")
if sys.argv[1:] == ["shutdown"]:
    rt.shutdown()
print(f"rank {rt.rank() if rt.is_initialized() else 'done'} ok", flush=True)
