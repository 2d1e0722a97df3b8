"""Run tests/mpi/horovod_training.py (Horovod's training API on ringtrain) on 1 to 4 ranks."""

from __future__ import annotations

import importlib.util
import re

import pytest

from mpi_launch import run_mpi

NPROCS = [1, 2, 3, 4]


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_horovod_training(nprocs):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    output = run_mpi("horovod_training", nprocs, timeout=240)
    summary = re.search(rf"horovod_training\.py np={nprocs}: all (\d+) checks passed", output)
    assert summary, f"no summary line in the output of horovod_training.py np={nprocs}:\n{output}"
    assert int(summary.group(1)) >= 23, output
