"""Run tests/mpi/horovod_training.py (Horovod's training API on ringtrain) on 1 to 4 ranks."""

from __future__ import annotations

import importlib.util

import pytest

from mpi_launch import run_checks

NPROCS = [1, 2, 3, 4]


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_horovod_training(nprocs):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    run_checks("horovod_training", nprocs, 23, timeout=240)
