"""pytest configuration of ringtrain's tests.

The single-process tests never communicate, so MPI is not initialized in the pytest
process: importing ringtrain (which imports mpi4py.MPI) must not start an MPI singleton.
The multi-rank programs under tests/mpi/ run in their own processes under mpiexec.
"""

import os

import mpi4py

mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

# The tests expect ringtrain's built-in tuning table, whatever `ringtrain-bench --tune`
# left in this user's cache (the programs under tests/mpi/ inherit the environment).
os.environ.setdefault("RINGTRAIN_TUNING_FILE", "")
