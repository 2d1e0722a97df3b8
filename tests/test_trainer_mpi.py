"""Run the trainer's multi-rank programs under tests/mpi/ with 1, 2, 3 and 4 ranks."""

from __future__ import annotations

import re

import pytest

from mpi_launch import run_mpi

PROGRAMS = ["trainer_gold", "trainer_behaviour"]
NPROCS = [1, 2, 3, 4]


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
@pytest.mark.parametrize("program", PROGRAMS)
def test_program(program, nprocs):
    output = run_mpi(program, nprocs, timeout=240)
    summary = re.search(rf"{program}\.py np={nprocs}: all (\d+) checks passed", output)
    assert summary, f"no summary line in the output of {program}.py np={nprocs}:\n{output}"
    assert int(summary.group(1)) >= 17, output
