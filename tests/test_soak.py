"""The soak (tests/mpi/soak.py): thousands of random collectives at 3 and 4 ranks, every
result checked, resident memory bounded. ``RINGTRAIN_SOAK_OPS=100000 pytest
tests/test_soak.py`` is the longer run for a release."""

from __future__ import annotations

import os

import pytest

from mpi_launch import run_mpi

pytestmark = pytest.mark.processes

OPS = int(os.environ.get("RINGTRAIN_SOAK_OPS", "2000"))


@pytest.mark.parametrize("nprocs", [3, 4], ids=["np3", "np4"])
def test_soak(nprocs):
    timeout = max(300, OPS // 10)
    environment = {"RINGTRAIN_SOAK_OPS": str(OPS),
                   "RINGTRAIN_TEST_CHECK_TIMEOUT": str(timeout - 20)}
    output = run_mpi("soak", nprocs, timeout=timeout, env=environment)
    assert f"soak.py np={nprocs}: all 1 checks passed" in output, output
