"""Run one of the examples/ scripts as ``__main__`` on every rank.

Run: mpiexec -n K python tests/mpi/example.py NAME   (NAME: a file in examples/, no .py)
"""

import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

if __name__ == "__main__":
    runpy.run_path(str(EXAMPLES / f"{sys.argv[1]}.py"), run_name="__main__")
