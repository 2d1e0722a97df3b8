"""Run tests/mpi/horovod_training.py (Horovod's training API on ringtrain) on 1 to 4 ranks."""

from __future__ import annotations

import pytest

from mpi_launch import TRAINING, run_in_bundle

pytestmark = pytest.mark.processes

NPROCS = [1, 2, 3, 4]


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_horovod_training(nprocs):
    run_in_bundle("horovod_training", TRAINING, nprocs, 23, timeout=240 * len(TRAINING))
