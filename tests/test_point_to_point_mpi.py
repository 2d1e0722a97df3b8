"""Run the point-to-point program under tests/mpi/ with 1, 2, 3 and 4 ranks (one rank
sends to itself), with the stall inspector checking every second."""

from __future__ import annotations

import pytest

from mpi_launch import STALL_CHECK_EVERY_SECOND, STALL_CHECKED, run_in_bundle

pytestmark = pytest.mark.processes

NPROCS = [1, 2, 3, 4]
CHECKS = 11


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_point_to_point(nprocs):
    run_in_bundle("point_to_point", STALL_CHECKED, nprocs, CHECKS, timeout=480,
                  env=STALL_CHECK_EVERY_SECOND)
