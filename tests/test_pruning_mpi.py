"""Run the pruning program under tests/mpi/ with 1, 2, 3 and 4 ranks."""

from __future__ import annotations

import pytest

from mpi_launch import TRAINING, run_in_bundle

pytestmark = pytest.mark.processes

pytest.importorskip("torch")

NPROCS = [1, 2, 3, 4]
MIN_CHECKS = 13


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_pruning(nprocs):
    run_in_bundle("pruning", TRAINING, nprocs, MIN_CHECKS, timeout=240 * len(TRAINING))
