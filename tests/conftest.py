"""pytest configuration of ringtrain's tests.

The single-process tests never communicate, so MPI is not initialized in the pytest
process: importing ringtrain (which imports mpi4py.MPI) must not start an MPI singleton.
The multi-rank programs under tests/mpi/ run in their own processes under mpiexec.
"""

import mpi4py

mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
