"""Run the pipeline trainer's program under tests/mpi/ with 1, 2, 3 and 4 ranks: every
stages × replicas split of the ranks (2 × 2 at four), against one process."""

from __future__ import annotations

import pytest

from mpi_launch import TRAINING, run_in_bundle

pytestmark = pytest.mark.processes

pytest.importorskip("torch")

NPROCS = [1, 2, 3, 4]
CHECKS = 5


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_pipeline(nprocs):
    run_in_bundle("pipeline", TRAINING, nprocs, CHECKS, timeout=240 * len(TRAINING))
