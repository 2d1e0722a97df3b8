"""Run every multi-rank program under tests/mpi/ with 1, 2, 3 and 4 ranks.

Each program runs many checks (see tests/mpi/_harness.py); a failure shows which checks
failed on which ranks, with tracebacks, and a hang shows the stacks of the ranks.
"""

from __future__ import annotations

import ast

import pytest

from mpi_launch import (COLLECTIVES, TRAINING, PROGRAMS as PROGRAM_DIR, run_checks, run_in_bundle,
                        run_mpi)

pytestmark = pytest.mark.processes

NPROCS = [1, 2, 3, 4]
TIMEOUT = 180


def _settings_environment() -> dict[str, str]:
    """The ENVIRONMENT that tests/mpi/settings_env.py expects (read, not imported)."""
    tree = ast.parse((PROGRAM_DIR / "settings_env.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ENVIRONMENT":
            return ast.literal_eval(node.value)
    raise AssertionError("settings_env.py defines no ENVIRONMENT")


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
@pytest.mark.parametrize("program", COLLECTIVES)
def test_program(program, nprocs):
    run_in_bundle(program, COLLECTIVES, nprocs, timeout=TIMEOUT * len(COLLECTIVES))


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_settings_from_the_environment(nprocs):
    run_checks("settings_env", nprocs, timeout=TIMEOUT, env=_settings_environment())


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_torch_cpu_tensors(nprocs):
    run_in_bundle("torch_tensors", TRAINING, nprocs, timeout=240 * len(TRAINING))


@pytest.mark.parametrize("program,only", [("mismatch", None), ("allreduce", "exchange"),
                                          ("gather_scatter", None)])
def test_the_agreement_over_mpi_messages(program, only):
    """As between nodes: the agreement's messages through MPI instead of the node's
    shared memory (its mismatches, and small collectives riding in it: reductions,
    gathers and alltoalls whose row counts or splits agree or differ)."""
    run_checks(program, 3, timeout=TIMEOUT, args=() if only is None else ("--only", only),
               env={"RINGTRAIN_AGREEMENT_SHARED_MEMORY": "0"})


def test_a_program_leaving_without_shutdown_ends_ringtrains_threads_first():
    """Left running while the interpreter finalizes, the collectives thread could drop a
    torch tensor then and abort the process (exit code 6 after a successful run)."""
    output = run_mpi("exit_threads", 2, timeout=TIMEOUT)
    assert output.count("ringtrain threads alive at exit: []") == 2, output
