"""Run one of the examples/ scripts as ``__main__`` on every rank.

Run: mpiexec -n K python tests/mpi/example.py NAME [ARG ...]
     (NAME: a file in examples/, no .py; the ARGs are the example's own)

The example runs as ``python examples/NAME.py ARG ...`` would (its ``sys.argv`` and
``sys.path[0]``), under mpi4py's runner: an exception on one rank aborts every rank, so
the others never wait for it.
"""

import faulthandler
import signal
import sys
from pathlib import Path

from mpi4py.run import run_command_line, set_abort_status

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks on a hang
    try:
        run_command_line([str(EXAMPLES / f"{sys.argv[1]}.py"), *sys.argv[2:]])
    except BaseException as error:
        set_abort_status(error)
        raise
