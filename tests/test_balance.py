"""Run the load balancer's multi-rank programs under tests/mpi/ with 1, 2, 3 and 4 ranks."""

from __future__ import annotations

import pytest

from mpi_launch import ABORTED, run_checks, run_mpi

# Each program and the fewest checks it must report passed.
PROGRAMS = {"balance": 8, "balance_gold": 13}
NPROCS = [1, 2, 3, 4]


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_program(program, nprocs):
    run_checks(program, nprocs, PROGRAMS[program], timeout=240)


def test_a_rank_that_raises_mid_training_ends_the_job_on_every_rank():
    pytest.importorskip("torch")
    output = run_mpi("balance_abort", 2, timeout=120, expected_status=ABORTED)
    assert "rank 1 failed in step 3" in output, output
    assert "finished all" not in output, output
