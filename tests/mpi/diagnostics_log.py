"""Collectives with ringtrain's log at DEBUG, and an error on the collectives thread.

Run: RINGTRAIN_LOG_LEVEL=DEBUG mpiexec -n K python tests/mpi/diagnostics_log.py
"""

from __future__ import annotations

import traceback

import numpy as np

import ringtrain as rt


def main() -> None:
    rt.init()
    rt.allreduce(np.ones(1000, np.float32), name="grad")
    rt.allreduce(np.ones(100_000, np.float32), name="big", algorithm="ring")
    rt.broadcast(np.ones(10), root_rank=0, name="weights")
    # An error raised on the collectives thread reaches synchronize(), traceback and all.
    shape = (3,) if rt.rank() == 0 else (4,)
    handle = rt.allreduce_async(np.ones(shape), name="uneven")
    try:
        rt.synchronize(handle)
    except rt.MismatchError as error:
        text = "".join(traceback.format_exception(error))
        assert "_resolution.py" in text, text
        print(f"rank {rt.rank()} caught: {error}", flush=True)
    else:
        assert rt.size() == 1
    print(f"rank {rt.rank()} finished", flush=True)


if __name__ == "__main__":
    main()
