"""Run tests/mpi/horovod_ops.py (Horovod's collectives through ringtrain.horovod) with 1, 2,
3 and 4 ranks."""

from __future__ import annotations

import pytest

from mpi_launch import TRAINING, run_in_bundle

pytestmark = pytest.mark.processes

NPROCS = [1, 2, 3, 4]
TIMEOUT = 180


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_horovod_ops(nprocs):
    run_in_bundle("horovod_ops", TRAINING, nprocs, timeout=240 * len(TRAINING))
