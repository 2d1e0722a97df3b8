"""Horovod's elastic API (``hvd.elastic``) on ringtrain-run: a Horovod-style elastic script
whose rank is killed mid-epoch resumes from its last commit with the parameters of an
uninterrupted run, and, restarted with fewer ranks, still trains on every sample of every
epoch exactly once. While it runs, a host that appears grows the job at a commit and one
that goes shrinks it, without a failure; a host whose rank failed is left out of the
restart. Each run has a hard timeout."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from test_launcher_runs import PROGRAMS, launch, needs_mpi

pytestmark = pytest.mark.processes

pytest.importorskip("torch")

TRAIN = str(PROGRAMS / "horovod_elastic_train.py")
TIMEOUT = 90.0
EPOCHS = "3"
KILL = "--env=RINGTRAIN_TEST_KILL_AT_STEP=8"  # epoch 1 of 3 at two ranks (6 steps each)
SHORT = "2"  # epochs of the runs that change hosts


def seen(stdout: str) -> list[int]:
    line = next(line for line in stdout.splitlines() if line.startswith("[0] seen "))
    return [int(count) for count in re.findall(r"\d+", line.split("seen", 1)[1])]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> np.ndarray:
    output = tmp_path_factory.mktemp("horovod_uninterrupted") / "params.npy"
    run = launch("-np", "2", sys.executable, TRAIN, str(output), EPOCHS, timeout=TIMEOUT)
    assert run.returncode == 0, run
    assert seen(run.stdout) == [3] * 48, run
    assert "reset with" not in run.stdout, run
    return np.load(output)


@needs_mpi
def test_a_killed_rank_resumes_from_the_last_commit_as_if_uninterrupted(tmp_path,
                                                                       uninterrupted):
    output = tmp_path / "params.npy"
    run = launch("-np", "2", "--max-restarts", "1", KILL, sys.executable, TRAIN, str(output),
                 EPOCHS, timeout=TIMEOUT)
    assert run.returncode == 0, run
    assert "[0] start 1 at epoch 1 step 8 with 2 ranks" in run.stdout, run
    assert "[0] reset with 2 ranks" in run.stdout, run
    assert seen(run.stdout) == [3] * 48, run
    assert np.array_equal(np.load(output), uninterrupted), run


@needs_mpi
def test_restarted_with_fewer_ranks_every_sample_is_trained_on_once_per_epoch(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text('#!/bin/sh\nif [ "$RINGTRAIN_RESTART_COUNT" = 0 ]; then '
                      "echo localhost:2; else echo localhost:1; fi\n")
    script.chmod(0o755)
    run = launch("--min-np", "1", "--max-restarts", "1", "--host-discovery-script",
                 str(script), KILL, sys.executable, TRAIN, str(tmp_path / "params.npy"),
                 EPOCHS, timeout=TIMEOUT)
    assert run.returncode == 0, run
    assert "[0] start 1 at epoch 1 step 8 with 1 ranks" in run.stdout, run
    assert "[0] reset with 1 ranks" in run.stdout, run
    assert seen(run.stdout) == [3] * 48, run


def _changing_hosts(tmp_path, before: str, after: str) -> tuple[str, str]:
    """A discovery script offering ``before`` until the trigger file exists, then
    ``after``; the script's path and the trigger's."""
    trigger = tmp_path / "hosts-changed"
    script = tmp_path / "discover.sh"
    script.write_text(f'#!/bin/sh\nif [ -e {trigger} ]; then printf "{after}\\n"; '
                      f'else printf "{before}\\n"; fi\n')
    script.chmod(0o755)
    return str(script), str(trigger)


def _resize(tmp_path, before: str, after: str, at_step: int, *options: str):
    script, trigger = _changing_hosts(tmp_path, before, after)
    return launch(*options, "--min-np", "1", "--max-np", "3", "--discovery-interval", "0.1",
                  "--host-discovery-script", script,
                  f"--env=RINGTRAIN_TEST_HOSTS_AT_STEP={at_step}",
                  f"--env=RINGTRAIN_TEST_HOSTS_FILE={trigger}", sys.executable, TRAIN,
                  str(tmp_path / "params.npy"), SHORT, timeout=TIMEOUT)


@needs_mpi
def test_a_host_that_appears_grows_the_job_at_a_commit(tmp_path):
    """No --max-restarts: a resize is not a failure."""
    run = _resize(tmp_path, "localhost:2", "localhost:3", at_step=8)
    assert run.returncode == 0, run
    assert "ringtrain-run: the hosts changed (localhost:2 -> localhost:3): resuming from the " \
           "last commit with 3 ranks" in run.stderr, run
    assert "[0] start 1 at epoch 1 step 9 with 3 ranks" in run.stdout, run
    assert "[2] reset with 3 ranks" in run.stdout, run
    assert seen(run.stdout) == [2] * 48, run


@needs_mpi
def test_a_host_that_goes_shrinks_the_job_at_check_host_updates(tmp_path):
    run = _resize(tmp_path, "localhost:2\\nlocalhost:1", "localhost:2", 5,
                  "--env=RINGTRAIN_TEST_CHECK_HOSTS=1")
    assert run.returncode == 0, run
    assert "the hosts changed (localhost:2,localhost:1 -> localhost:2)" in run.stderr, run
    assert "[0] start 1 at epoch 1 step 5 with 2 ranks" in run.stdout, run
    assert "[1] reset with 2 ranks" in run.stdout, run
    assert seen(run.stdout) == [2] * 48, run


@needs_mpi
def test_the_host_of_a_failed_rank_is_left_out_of_the_restart(tmp_path):
    script, _ = _changing_hosts(tmp_path, "localhost:1\\n127.0.0.1:1", "")
    run = launch("--min-np", "1", "--max-restarts", "1", "--host-discovery-script", script,
                 KILL, sys.executable, TRAIN, str(tmp_path / "params.npy"), SHORT,
                 timeout=TIMEOUT)
    assert run.returncode == 0, run
    assert "restarting with 1 rank (restart 1 of 1); host 127.0.0.1 left out for 10 s" \
        in run.stderr, run
    assert "[0] start 1 at epoch 1 step 8 with 1 ranks" in run.stdout, run
    assert seen(run.stdout) == [2] * 48, run
