"""Programs that misbehave on purpose, to test how failures and hangs are reported.

Run: mpiexec -n K python tests/mpi/harness_selftest.py MODE
  fail    rank K-1 fails a check after communicating; the next check still runs
  stuck   rank K-1 fails while the others wait in a collective; the job aborts
  block   every rank waits in a collective that rank 0 never joins (the check timeout
          ends it when it is short; otherwise the launcher's timeout does)
  sleep   rank 0 sleeps (outside any collective) for an hour
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ringtrain as rt
from _harness import check, main

MODE = sys.argv[1] if len(sys.argv) > 1 else ""


@check
def first_check_passes():
    assert rt.allreduce(np.ones(2), rt.Sum)[0] == rt.size()


if MODE == "fail":
    @check
    def fails_on_the_last_rank():
        total = rt.allreduce(np.ones(2), rt.Sum)
        assert rt.rank() != rt.size() - 1, f"deliberate failure on the last rank (total {total})"

    @check
    def runs_after_the_failure():
        assert rt.allreduce(np.ones(2), rt.Sum)[0] == rt.size()

if MODE == "stuck":
    @check
    def last_rank_fails_before_the_collective():
        if rt.rank() == rt.size() - 1:
            raise RuntimeError("deliberate failure before the collective")
        rt.allreduce(np.ones(2), rt.Sum)

if MODE == "block":
    @check
    def waits_for_rank_0():
        if rt.rank() != 0:
            rt.allreduce(np.ones(2), rt.Sum)
        else:
            print("SELFTEST rank 0 waiting", flush=True)
            time.sleep(3600)

if MODE == "sleep":
    @check
    def rank_0_sleeps():
        if rt.rank() == 0:
            print("SELFTEST rank 0 sleeping", flush=True)
            time.sleep(3600)


if __name__ == "__main__":
    main()
