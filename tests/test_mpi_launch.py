"""The launcher and the check runner report failures and hangs, and leave nothing behind."""

from __future__ import annotations

import time
import uuid

import pytest

import mpi_launch
from mpi_launch import PROGRAMS, assert_none_running, find_mpiexec, run_mpi

SELFTEST = str(PROGRAMS / "harness_selftest.py")

pytestmark = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")


def _failure(nprocs: int, mode: str, **kwargs) -> str:
    """Run the self-test in ``mode``; expect the test failure it causes; return its text.

    A unique token on the command line tells this run's processes from any other's.
    """
    token = f"token-{uuid.uuid4().hex}"
    with pytest.raises(pytest.fail.Exception) as caught:
        run_mpi("harness_selftest", nprocs, mode, token, **kwargs)
    assert_none_running(SELFTEST, token, wait=10)
    return str(caught.value)


@pytest.mark.processes
def test_a_passing_program_returns_its_output():
    output = run_mpi("harness_selftest", 2, "none", timeout=60)
    assert "rank 0: PASS first_check_passes" in output
    assert "all 1 checks passed" in output


@pytest.mark.processes
def test_a_failed_check_is_reported_and_the_next_check_still_runs():
    message = _failure(3, "fail", timeout=60)
    assert "harness_selftest.py with np=3 FAILED with exit status 1" in message
    assert "rank 2: FAIL fails_on_the_last_rank" in message
    assert "deliberate failure on the last rank" in message  # the traceback is shown
    assert "rank 0: FAIL fails_on_the_last_rank (failed on ranks 2)" in message
    assert "rank 0: PASS runs_after_the_failure" in message


@pytest.mark.processes
def test_a_rank_failing_while_others_wait_aborts_the_job():
    message = _failure(2, "stuck", timeout=60, env={"RINGTRAIN_TEST_FAIL_WAIT": "1"})
    assert "rank 1: FAIL last_rank_fails_before_the_collective" in message
    assert "ABORT after check last_rank_fails_before_the_collective" in message


@pytest.mark.processes
def test_a_check_that_never_finishes_is_reported_with_stacks():
    message = _failure(2, "block", timeout=60, env={"RINGTRAIN_TEST_CHECK_TIMEOUT": "3"})
    assert "HANG check waits_for_rank_0 did not finish within 3 s" in message
    assert "in waits_for_rank_0" in message  # the stack of a waiting rank was dumped


@pytest.mark.processes
def test_the_launcher_timeout_kills_every_process_and_shows_the_output():
    start = time.monotonic()
    message = _failure(3, "sleep", timeout=10)
    assert time.monotonic() - start < 40
    assert "harness_selftest.py with np=3 HUNG: killed after 10 s" in message
    assert "SELFTEST rank 0 sleeping" in message  # the output so far
    assert "in rank_0_sleeps" in message  # the stack of the sleeping rank, dumped on request


def test_a_missing_mpiexec_skips(monkeypatch):
    monkeypatch.setattr(mpi_launch, "find_mpiexec", lambda: None)
    with pytest.raises(pytest.skip.Exception, match="mpiexec not found"):
        run_mpi("harness_selftest", 1)
