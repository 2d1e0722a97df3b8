"""Run the pruning program under tests/mpi/ with 1, 2, 3 and 4 ranks."""

from __future__ import annotations

import re

import pytest

from mpi_launch import run_mpi

pytest.importorskip("torch")

NPROCS = [1, 2, 3, 4]
MIN_CHECKS = 13


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_pruning(nprocs):
    output = run_mpi("pruning", nprocs, timeout=240)
    summary = re.search(rf"pruning\.py np={nprocs}: all (\d+) checks passed", output)
    assert summary, f"no summary line in the output of pruning.py np={nprocs}:\n{output}"
    assert int(summary.group(1)) >= MIN_CHECKS, output
