"""ringtrain.elastic and ringtrain-run --max-restarts on real MPI: commit and restore on
every rank, a rank killed mid-training and the job restarted from the last commit, a
restart with fewer ranks found by a host discovery script, and too few ranks refused.

Each run has a hard timeout (the helpers of test_launcher_runs kill the whole tree).
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from test_launcher_runs import PROGRAMS, assert_nothing_left, launch, needs_mpi

pytestmark = pytest.mark.processes

TRAIN = str(PROGRAMS / "elastic_train.py")
STATE = str(PROGRAMS / "elastic_state.py")
TIMEOUT = 40.0
STEPS = "8"
KILL = "--env=RINGTRAIN_TEST_KILL_AT_STEP=5"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> np.ndarray:
    """The parameters of a run with two ranks that nothing interrupts."""
    output = tmp_path_factory.mktemp("uninterrupted") / "params.npy"
    run = launch("-np", "2", sys.executable, TRAIN, str(output), STEPS, timeout=TIMEOUT)
    assert run.returncode == 0, run
    return np.load(output)


def _discovery_script(directory: Path, first: str, later: str) -> Path:
    script = directory / "discover.sh"
    script.write_text("#!/bin/sh\n"
                      f'if [ "$RINGTRAIN_RESTART_COUNT" = 0 ]; then echo {first}; '
                      f"else echo {later}; fi\n")
    script.chmod(0o755)
    return script


@needs_mpi
@pytest.mark.parametrize("nprocs", ["1", "2"])
def test_commit_and_restore_on_every_rank(tmp_path, nprocs):
    run = launch("-np", nprocs, sys.executable, STATE, str(tmp_path), timeout=TIMEOUT)
    assert run.returncode == 0, run
    assert sorted(run.stdout.splitlines()) == [f"[{rank}] rank {rank} ok"
                                               for rank in range(int(nprocs))], run


@needs_mpi
def test_a_killed_rank_restarts_the_job_from_the_last_commit(tmp_path, uninterrupted):
    output = tmp_path / "params.npy"
    token = f"token-{uuid.uuid4().hex}"
    run = launch("-np", "2", "--max-restarts", "1", KILL, sys.executable, TRAIN, str(output),
                 STEPS, token, timeout=TIMEOUT)
    assert_nothing_left(token)
    assert run.returncode == 0, run
    assert ("ringtrain-run: rank 1 failed (was killed by signal 9 (SIGKILL)); restarting "
            "with 2 ranks (restart 1 of 1)") in run.stderr.splitlines(), run
    assert "[0] start 0 at step 0 with 2 ranks" in run.stdout, run
    assert "[0] start 1 at step 5 with 2 ranks" in run.stdout, run
    assert np.array_equal(np.load(output), uninterrupted), run


@needs_mpi
def test_without_restarts_left_the_failure_ends_the_job(tmp_path):
    run = launch("-np", "2", "--max-restarts", "0", KILL, sys.executable, TRAIN,
                 str(tmp_path / "params.npy"), STEPS, timeout=TIMEOUT)
    assert run.returncode == 128 + 9, run
    assert run.stderr.splitlines()[-1] == ("ringtrain-run: rank 1 was killed by signal 9 "
                                           "(SIGKILL); the job was stopped (exit code 137)"), run
    assert "restarting" not in run.stderr, run


@needs_mpi
def test_a_restart_with_fewer_discovered_ranks_gives_the_same_result(tmp_path, uninterrupted):
    output = tmp_path / "params.npy"
    script = _discovery_script(tmp_path, "localhost:2", "localhost:1")
    run = launch("--min-np", "1", "--max-restarts", "2", "--host-discovery-script", str(script),
                 KILL, sys.executable, TRAIN, str(output), STEPS, timeout=TIMEOUT)
    assert run.returncode == 0, run
    assert ("ringtrain-run: rank 1 failed (was killed by signal 9 (SIGKILL)); restarting "
            "with 1 rank (restart 1 of 2)") in run.stderr.splitlines(), run
    assert "[0] start 1 at step 5 with 1 ranks" in run.stdout, run
    assert np.array_equal(np.load(output), uninterrupted), run


@needs_mpi
def test_fewer_discovered_ranks_than_min_np_stop_the_restart(tmp_path):
    script = _discovery_script(tmp_path, "localhost:2", "localhost:1")
    run = launch("--min-np", "2", "--max-restarts", "1", "--host-discovery-script", str(script),
                 KILL, sys.executable, TRAIN, str(tmp_path / "params.npy"), STEPS,
                 timeout=TIMEOUT)
    assert run.returncode == 128 + 9, run
    assert run.stderr.splitlines()[-1] == (
        "ringtrain-run: rank 1 was killed by signal 9 (SIGKILL); the job was stopped (exit "
        "code 137); cannot restart: the host discovery script offers 1 slot (localhost:1), "
        "fewer than --min-np 2"), run


@needs_mpi
def test_fewer_discovered_ranks_than_min_np_start_nothing(tmp_path):
    script = _discovery_script(tmp_path, "localhost:1", "localhost:1")
    run = launch("--min-np", "2", "--host-discovery-script", str(script), sys.executable,
                 TRAIN, str(tmp_path / "params.npy"), timeout=TIMEOUT)
    assert run.returncode == 1, run
    assert run.stdout == "", run
    assert run.stderr == ("ringtrain-run: error: the host discovery script offers 1 slot "
                          "(localhost:1), fewer than --min-np 2\n"), run


@needs_mpi
def test_a_job_that_fails_on_every_start_ends_when_no_restart_is_left():
    token = f"token-{uuid.uuid4().hex}"
    run = launch("-np", "2", "--max-restarts", "1", sys.executable,
                 str(PROGRAMS / "rank1_fails.py"), "kill", token, timeout=TIMEOUT)
    assert_nothing_left(token)
    assert run.returncode == 128 + 9, run
    lines = [line for line in run.stderr.splitlines() if line.startswith("ringtrain-run:")]
    assert lines == [
        "ringtrain-run: rank 1 failed (was killed by signal 9 (SIGKILL)); restarting with 2 "
        "ranks (restart 1 of 1)",
        "ringtrain-run: rank 1 was killed by signal 9 (SIGKILL); the job was stopped (exit "
        "code 137); no restart left (--max-restarts 1)"], run
    assert run.stdout.count("[0] rank 0 waits in allreduce") == 2, run
