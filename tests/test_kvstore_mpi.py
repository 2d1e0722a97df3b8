"""Run the KVStore's multi-rank programs under tests/mpi/ (1 to 4 ranks)."""

from __future__ import annotations

import re

import pytest

from mpi_launch import run_mpi

# Each program, the world sizes it runs at, and the fewest checks it must report passed.
PROGRAMS = {"kvstore_sync": ([1, 2, 3, 4], 14), "kvstore_async": ([1, 2, 3, 4], 8)}


@pytest.mark.parametrize("program,nprocs",
                         [(p, n) for p, (sizes, _) in PROGRAMS.items() for n in sizes],
                         ids=lambda v: v if isinstance(v, str) else f"np{v}")
def test_program(program, nprocs):
    output = run_mpi(program, nprocs, timeout=240)
    summary = re.search(rf"{program}\.py np={nprocs}: all (\d+) checks passed", output)
    assert summary, f"no summary line in the output of {program}.py np={nprocs}:\n{output}"
    assert int(summary.group(1)) >= PROGRAMS[program][1], output
