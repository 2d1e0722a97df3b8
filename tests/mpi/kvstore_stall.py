"""A worker of an async KVStore that does not come to a call every worker makes, for the
stall inspector's tests.

    RINGTRAIN_STALL_CHECK_SECONDS=1 mpiexec -n 3 python tests/mpi/kvstore_stall.py init
        worker 1 sleeps before ``init``: worker 0 waits in it and must report worker 1.
    ... kvstore_stall.py barrier
        worker 1 skips the ``barrier`` after ``init`` and goes on pushing.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ringtrain import kvstore


def main() -> None:
    late = sys.argv[1]
    kv = kvstore.create("dist_async")
    if late == "init" and kv.rank == 1:
        time.sleep(60)
    kv.init("w", np.zeros(4))
    if late == "barrier" and kv.rank == 1:
        for _ in range(6000):
            kv.push("w", np.ones(4))
            time.sleep(0.01)
    kv.barrier()
    print(f"worker {kv.rank} done", flush=True)


if __name__ == "__main__":
    main()
