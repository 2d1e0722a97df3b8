"""Horovod's elastic API (``hvd.elastic``) on ringtrain-run: a Horovod-style elastic script
whose rank is killed mid-epoch resumes from its last commit with the parameters of an
uninterrupted run, and, restarted with fewer ranks, still trains on every sample of every
epoch exactly once. Each run has a hard timeout."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

from test_launcher_runs import PROGRAMS, launch, needs_mpi

pytest.importorskip("torch")

TRAIN = str(PROGRAMS / "horovod_elastic_train.py")
TIMEOUT = 90.0
EPOCHS = "3"
KILL = "--env=RINGTRAIN_TEST_KILL_AT_STEP=8"  # epoch 1 of 3 at two ranks (6 steps each)


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
