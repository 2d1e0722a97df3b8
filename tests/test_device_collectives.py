"""Every collective on device tensors in both modes: through pinned host memory (at 1 to
4 ranks), and with device pointers handed to a CUDA-aware MPI (at 2 and 3).

Without a GPU the device arrays are numba's CUDA simulator's and objects exposing
``__cuda_array_interface__`` over host memory; the CUDA-aware mode is forced with
RINGTRAIN_CUDA_AWARE_MPI=1, which host memory survives. On a GPU the same program runs
on CuPy arrays, torch CUDA tensors and numba device arrays.
"""

from __future__ import annotations

import pytest

from mpi_launch import require_gpu, run_checks

pytestmark = pytest.mark.processes

MODES = {"staged": "0", "cuda_aware": "1"}
# Staged at every size; handing device memory to MPI at an even and an odd size (the
# simulator's minutes are the suite's largest single cost).
RUNS = [("staged", n) for n in (1, 2, 3, 4)] + [("cuda_aware", n) for n in (2, 3)]
CHECKS = 12


@pytest.mark.parametrize("mode, nprocs", RUNS, ids=[f"{m}-np{n}" for m, n in RUNS])
def test_device_arrays_on_the_cuda_simulator(mode, nprocs):
    # The simulator runs each GPU thread as a Python thread; their hand-overs through the
    # GIL now and then stall one kernel for tens of seconds (seen at 0.5 s and at 24 s for
    # the same check), hence the long per-check limit.
    run_checks("device_collectives", nprocs, CHECKS, timeout=600,
               env={"NUMBA_ENABLE_CUDASIM": "1", "RINGTRAIN_CUDA_AWARE_MPI": MODES[mode],
                    "RINGTRAIN_TEST_CHECK_TIMEOUT": "240"})


@pytest.mark.parametrize("nprocs", [2, 4], ids=["np2", "np4"])
def test_device_tensors_on_a_gpu(nprocs):
    """Ranks sharing the GPU, through CUDA IPC and host memory (an MPI from PyPI is not
    CUDA-aware: device pointers would crash it); skips without a GPU unless
    RINGTRAIN_TEST_GPU=1."""
    require_gpu()
    run_checks("device_collectives", nprocs, CHECKS, timeout=600,
               env={"NUMBA_ENABLE_CUDASIM": "0", "RINGTRAIN_CUDA_AWARE_MPI": "0"})
