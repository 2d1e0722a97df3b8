"""torch.distributed's "ringtrain" backend: every collective through torch at 1 to 4 ranks
against references, start-up under mpiexec with no variable set, the users' variables
checked against MPI, and the one-line answer to a launch without MPI (torchrun)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from mpi_launch import (ROOT, STALL_CHECK_EVERY_SECOND, STALL_CHECKED, run_checks, run_in_bundle)

pytestmark = pytest.mark.processes

pytest.importorskip("torch")

NPROCS = [1, 2, 3, 4]
TORCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def without_torch_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in TORCH_VARIABLES}


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_torch_distributed_calls(nprocs):
    run_in_bundle("torch_backend", STALL_CHECKED, nprocs, 19, timeout=480,
                  env=STALL_CHECK_EVERY_SECOND)


def test_the_programs_people_run_end_as_on_gloo(monkeypatch):
    """The examples' DDP, FSDP2, checkpoint, Lightning and Accelerate scripts at 2 ranks,
    each on gloo and on ringtrain in the same processes (tests/mpi/torch_programs.py)."""
    for module in ("lightning", "accelerate"):
        pytest.importorskip(module)
    for variable in TORCH_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    run_checks("torch_programs", 2, 9, timeout=420)


def test_a_two_dimensional_device_mesh_ends_as_on_gloo(monkeypatch):
    for variable in TORCH_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    run_checks("torch_programs", 4, 1, args=["--only", "device_mesh"], timeout=300)


def test_a_launch_without_mpi_is_told_how_to_launch():
    """Two processes started as torchrun starts them (its variables set, no MPI), each
    its own MPI world of one: both are told to launch with mpiexec or ringtrain-run."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    program = str(ROOT / "tests" / "launcher_programs" / "torch_init.py")
    processes = []
    for rank in range(2):
        environment = without_torch_variables() | {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        processes.append(subprocess.Popen([sys.executable, program], cwd=ROOT,
                                          env=environment, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    try:
        results = [process.communicate(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (stdout, stderr) in zip(processes, results):
        assert process.returncode != 0, stdout + stderr
        assert "torch was told of 2 processes, MPI knows 1" in stderr, stderr
        assert "launch with `mpiexec -n 2 python ...` or `ringtrain-run -np 2 python ...`" \
            in stderr, stderr
