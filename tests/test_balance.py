"""Run the load balancer's multi-rank programs under tests/mpi/ with 1, 2, 3 and 4 ranks, a
rank that fails mid-training, and an elastic restart with more ranks."""

from __future__ import annotations

import sys

import pytest

from mpi_launch import ABORTED, TRAINING, run_in_bundle, run_mpi
from mpi_launch import PROGRAMS as MPI_PROGRAMS
from test_launcher_runs import launch, needs_mpi

pytestmark = pytest.mark.processes

# Each program and the fewest checks it must report passed.
PROGRAMS = {"balance": 9, "balance_gold": 13}
NPROCS = [1, 2, 3, 4]


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_program(program, nprocs):
    run_in_bundle(program, TRAINING, nprocs, PROGRAMS[program], timeout=240 * len(TRAINING))


def test_a_rank_that_raises_mid_training_ends_the_job_on_every_rank():
    pytest.importorskip("torch")
    output = run_mpi("balance_abort", 2, timeout=120, expected_status=ABORTED)
    assert "rank 1 failed in step 3" in output, output
    assert "finished all" not in output, output


@needs_mpi
def test_balanced_training_goes_on_after_a_restart_with_more_ranks(tmp_path):
    """Killed at step 6 with 2 ranks, restarted with 3: the shares start even again, the
    epoch resumes at the committed global batch, the weights are one process's."""
    script = tmp_path / "discover.sh"
    script.write_text('#!/bin/sh\nif [ "$RINGTRAIN_RESTART_COUNT" = 0 ]; then '
                      'echo localhost:2; else echo localhost:3; fi\n')
    script.chmod(0o755)
    run = launch("--min-np", "1", "--max-restarts", "1", "--host-discovery-script",
                 str(script), "--env=RINGTRAIN_TEST_KILL_AT_STEP=6", sys.executable,
                 str(MPI_PROGRAMS / "balance_elastic.py"), timeout=120)
    assert run.returncode == 0, run
    lines = run.stdout.splitlines()
    assert "[0] start 0 at epoch 0 batch 0 with 2 ranks, shares [4, 4]" in lines, run
    assert "[0] start 1 at epoch 1 batch 1 with 3 ranks, shares [3, 3, 2]" in lines, run
    assert any(line.startswith("[0] matches the one-process reference") for line in lines), run
