"""Run tests/mpi/horovod_ops.py (Horovod's collectives through ringtrain.horovod) with 1, 2,
3 and 4 ranks."""

from __future__ import annotations

import re

import pytest

from mpi_launch import run_mpi

NPROCS = [1, 2, 3, 4]
TIMEOUT = 180


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_horovod_ops(nprocs):
    pytest.importorskip("torch")
    output = run_mpi("horovod_ops", nprocs, timeout=TIMEOUT)
    summary = re.search(rf"horovod_ops\.py np={nprocs}: all (\d+) checks passed", output)
    assert summary, f"no summary line in the output of horovod_ops.py np={nprocs}:\n{output}"
    assert int(summary.group(1)) > 0
