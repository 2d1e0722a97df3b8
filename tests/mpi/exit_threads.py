"""A program that leaves without ``ringtrain.shutdown()`` after reducing on the
collectives thread: by the time the interpreter finalizes, ringtrain's threads have
ended (a daemon thread still running then may drop a torch tensor while Python
finalizes, which aborts the process).

Prints the ringtrain threads still alive from an exit handler registered before
``init`` (exit handlers run last-registered first, so it runs after ringtrain's).

Run: mpiexec -n K python tests/mpi/exit_threads.py
"""

from __future__ import annotations

import atexit
import threading


def report() -> None:
    alive = sorted(thread.name for thread in threading.enumerate()
                   if thread.name.startswith("ringtrain"))
    print(f"ringtrain threads alive at exit: {alive}", flush=True)


atexit.register(report)

import numpy as np  # noqa: E402

import ringtrain as rt  # noqa: E402

rt.init()
handle = rt.allreduce_async(np.arange(10.0), name="reduced on the collectives thread")
assert np.array_equal(rt.synchronize(handle), np.arange(10.0))
print(f"rank {rt.rank()} done", flush=True)
