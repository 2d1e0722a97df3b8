"""Run several of the examples/ scripts in one launch, one after the other, each as
``python examples/NAME.py ARG ...`` would run it (as ``__main__``, with its ``sys.argv``
and ``sys.path[0]``).

Run: mpiexec -n K python tests/mpi/examples.py RUNS
     (RUNS: a JSON list of [NAME, [ARG, ...]] pairs)

Rank 0 prints ``##### example I: NAME ARG ... #####`` before run I and ``##### end of
example I #####`` after it, every rank having finished it; an exception on one rank
aborts every rank (mpi4py's runner does the same for one script), so the others never
wait for it and the runs after it are left out.
"""

import faulthandler
import json
import runpy
import signal
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(index: int, name: str, arguments: list[str]) -> None:
    path = str(EXAMPLES / f"{name}.py")
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"##### example {index}: {' '.join([name, *arguments])} #####", flush=True)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[0] = [path, *arguments], str(EXAMPLES)
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit:
        if exit.code not in (None, 0):
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"##### end of example {index} #####", flush=True)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks on a hang
    for index, (name, arguments) in enumerate(json.loads(sys.argv[1])):
        try:
            run(index, name, arguments)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
