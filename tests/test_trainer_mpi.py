"""Run the trainer's multi-rank programs under tests/mpi/ with 1, 2, 3 and 4 ranks."""

from __future__ import annotations

import re

import pytest

from mpi_launch import TRAINING, require_gpu, run_in_bundle, run_mpi

pytestmark = pytest.mark.processes

# Each program and the fewest checks it must report passed.
PROGRAMS = {"trainer_gold": 17, "trainer_behaviour": 17, "trainer_mixed_precision": 28,
            "sharded_optimizer": 26}
NPROCS = [1, 2, 3, 4]


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
@pytest.mark.parametrize("program", list(PROGRAMS))
def test_program(program, nprocs):
    run_in_bundle(program, TRAINING, nprocs, PROGRAMS[program], timeout=240 * len(TRAINING))


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
def test_device_gradients_on_the_cuda_simulator(nprocs):
    output = run_mpi("trainer_device", nprocs, timeout=240, env={"NUMBA_ENABLE_CUDASIM": "1"})
    assert re.search(rf"trainer_device\.py np={nprocs}: all 5 checks passed", output), output


@pytest.mark.parametrize("nprocs", [2, 3], ids=["np2", "np3"])
def test_device_gradients_handed_to_a_cuda_aware_mpi(nprocs):
    """Host memory posing as device memory survives being handed to MPI."""
    output = run_mpi("trainer_device", nprocs, timeout=240,
                     env={"NUMBA_ENABLE_CUDASIM": "1", "RINGTRAIN_CUDA_AWARE_MPI": "1"})
    assert re.search(rf"trainer_device\.py np={nprocs}: all 5 checks passed", output), output


@pytest.mark.parametrize("nprocs", [2, 4], ids=["np2", "np4"])
def test_device_gradients_on_a_gpu(nprocs):
    """Ranks sharing the GPU; skips without one unless RINGTRAIN_TEST_GPU=1 demands it."""
    require_gpu()
    environment = {"NUMBA_ENABLE_CUDASIM": "0"}
    output = run_mpi("trainer_device", nprocs, timeout=300, env=environment)
    summary = re.search(rf"trainer_device\.py np={nprocs}: all (\d+) checks passed", output)
    assert summary and int(summary.group(1)) >= 5, output
