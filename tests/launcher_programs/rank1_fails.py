"""Rank 1 fails while rank 0 waits in an allreduce that can never complete.

usage: python rank1_fails.py MODE [TOKEN]

MODE says how rank 1 fails: ``raise`` (an unhandled exception), ``kill`` (it kills itself
with SIGKILL), ``exit`` (``sys.exit(3)`` after joining MPI), ``early`` (``sys.exit(3)``
before importing ringtrain, so before MPI starts). TOKEN is ignored: tests put a unique
one on the command line to find the job's processes.
"""

import os
import signal
import sys
import time

MODE = sys.argv[1]

if MODE == "early" and os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
    sys.exit(3)

import numpy as np  # noqa: E402

import ringtrain as rt  # noqa: E402


def fail_on_rank_1() -> None:
    time.sleep(0.5)  # let rank 0 reach the allreduce first
    if MODE == "raise":
        raise ValueError("rank 1 cannot go on")
    if MODE == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "exit":
        sys.exit(3)


rt.init()
if rt.rank() == 1:
    fail_on_rank_1()
print(f"rank {rt.rank()} waits in allreduce", flush=True)
rt.allreduce(np.ones(4))
print("the allreduce returned, so rank 1 did not fail", flush=True)
