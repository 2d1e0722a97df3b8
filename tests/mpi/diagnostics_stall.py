"""A stalled collective, for the stall inspector's tests.

    RINGTRAIN_STALL_CHECK_SECONDS=1 mpiexec -n K python tests/mpi/diagnostics_stall.py late SECONDS
        every rank calls allreduce 'v', then the last rank sleeps SECONDS before
        allreduce 'w': the others must report it.
    ... diagnostics_stall.py elsewhere SECONDS   (4 ranks)
        ranks 0,1 allreduce 'w' on all ranks; rank 2 waits in an allreduce 'x' of the
        process set {2, 3} for rank 3, which sleeps SECONDS first.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ringtrain as rt


def main() -> None:
    mode, seconds = sys.argv[1], float(sys.argv[2])
    rt.init()
    pair = rt.add_process_set([2, 3]) if mode == "elsewhere" else None
    rt.allreduce(np.ones(3), name="v")
    if mode == "late" and rt.rank() == rt.size() - 1:
        time.sleep(seconds)
        print(f"rank {rt.rank()} woke up", flush=True)
    if mode == "elsewhere" and rt.rank() >= 2:
        if rt.rank() == 3:
            time.sleep(seconds)
            print("rank 3 woke up", flush=True)
        rt.allreduce(np.ones(2), name="x", process_set=pair)
    rt.allreduce(np.ones(3), name="w")
    print(f"rank {rt.rank()} done", flush=True)


if __name__ == "__main__":
    main()
