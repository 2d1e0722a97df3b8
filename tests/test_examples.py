"""The examples run under mpiexec, so they never rot."""

from __future__ import annotations

import pytest

from mpi_launch import ROOT, run_mpi

EXAMPLES = sorted(path.stem for path in (ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_runs(example, nprocs):
    output = run_mpi("example", nprocs, example, timeout=120)
    assert f"{nprocs} ranks:" in output, output


def test_there_are_examples():
    assert EXAMPLES
