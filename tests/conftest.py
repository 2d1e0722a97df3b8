"""pytest configuration of ringtrain's tests.

The single-process tests never communicate, so MPI is not initialized in the pytest
process: importing ringtrain (which imports mpi4py.MPI) must not start an MPI singleton.
The multi-rank programs under tests/mpi/ run in their own processes under mpiexec.
"""

import os
import shlex
import subprocess
import sys
from typing import Any

import mpi4py
import pytest

mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

# The tests expect ringtrain's built-in tuning table, whatever `ringtrain-bench --tune`
# left in this user's cache (the programs under tests/mpi/ inherit the environment).
os.environ.setdefault("RINGTRAIN_TUNING_FILE", "")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "processes: starts other processes (MPI ranks, the launcher, a fresh "
        "interpreter); `pytest -m 'not processes'` runs the quick tier without them")


LAUNCHED_PROGRAMS = ("python", "mpiexec", "mpirun", "ringtrain-", "horovodrun", "torchrun")
"""Programs whose start makes a test slow (an interpreter, MPI ranks, a launcher); the
helpers that libraries run at import (``ldconfig -p`` behind ``ctypes.util.find_library``)
are not among them."""


@pytest.fixture(scope="session")
def _compiled_once() -> None:
    """numba's cache filled before the first test that starts processes, every CPU
    compiling its share once (:mod:`ringtrain.collectives.warm_up`): the ranks of a
    program would otherwise each compile the same functions at the same time."""
    subprocess.run([sys.executable, "-m", "ringtrain.collectives.warm_up"], check=True,
                   timeout=900)


@pytest.fixture(autouse=True)
def _only_marked_tests_start_processes(request: pytest.FixtureRequest,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that starts an interpreter, MPI ranks or a launcher without the
    ``processes`` mark fails, so the quick tier stays quick."""
    if request.node.get_closest_marker("processes") is not None:
        request.getfixturevalue("_compiled_once")
        return
    start = subprocess.Popen.__init__

    def refuse_launches(process: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if isinstance(args, str):
            words = shlex.split(args)
        elif isinstance(args, (bytes, os.PathLike)):
            words = [os.fsdecode(args)]
        else:
            words = [os.fsdecode(word) for word in args]
        program = os.path.basename(words[0]) if words else ""
        if words and (words[0] == sys.executable or program.startswith(LAUNCHED_PROGRAMS)):
            raise AssertionError(f"{request.node.nodeid} starts {program}: mark it "
                                 "pytest.mark.processes")
        start(process, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_launches)
