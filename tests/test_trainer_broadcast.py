"""broadcast_parameters and broadcast_optimizer_state on 1, 2, 3 and 4 ranks.

The checks live in tests/mpi/trainer_broadcast.py (see tests/mpi/_harness.py); a failure
shows which checks failed on which ranks, with tracebacks, and a hang shows the stacks
of the ranks.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpi_launch import TRAINING, run_in_bundle

pytestmark = pytest.mark.processes

NPROCS = [1, 2, 3, 4]
TIMEOUT = 180


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_trainer_broadcast(nprocs):
    run_in_bundle("trainer_broadcast", TRAINING, nprocs, timeout=240 * len(TRAINING))


def test_importing_the_module_does_not_import_torch(tmp_path):
    probe = ("import sys\n"
             "import mpi4py\n"
             "mpi4py.rc.initialize = False\n"
             "import ringtrain.trainer.state_broadcast\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
