"""Run several of the programs under tests/mpi/ in one launch: every program's checks,
program after program, and one summary line per program, as if each had run alone
(``allreduce.py np=2: all 14 checks passed``). One launch saves each program's start
(Python, numpy, numba's caches, torch, MPI), which for most programs takes longer than
their checks.

Run: mpiexec -n K python tests/mpi/bundle.py PROGRAM [PROGRAM ...] [--only SUBSTRING]
     (a PROGRAM is a file under tests/mpi/, no .py)
"""

import importlib
import sys

import ringtrain as rt
from _harness import main

if __name__ == "__main__":
    programs = sys.argv[1:sys.argv.index("--only")] if "--only" in sys.argv else sys.argv[1:]
    rt.init()  # some programs register checks by the number of ranks
    for program in programs:
        importlib.import_module(program)
    main()
