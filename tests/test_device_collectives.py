"""Every collective on device tensors, at 1 to 4 ranks, in both modes: through pinned host
memory, and with device pointers handed to a CUDA-aware MPI.

Without a GPU the device arrays are numba's CUDA simulator's and objects exposing
``__cuda_array_interface__`` over host memory; the CUDA-aware mode is forced with
RINGTRAIN_CUDA_AWARE_MPI=1, which host memory survives. On a GPU the same program runs
on CuPy arrays, torch CUDA tensors and numba device arrays.
"""

from __future__ import annotations

import re

import pytest

from mpi_launch import require_gpu, run_mpi

NPROCS = [1, 2, 3, 4]
MODES = {"staged": "0", "cuda_aware": "1"}


def _assert_all_passed(output: str, nprocs: int) -> None:
    summary = re.search(rf"device_collectives\.py np={nprocs}: all (\d+) checks passed",
                        output)
    assert summary and int(summary.group(1)) >= 12, output


@pytest.mark.parametrize("nprocs", NPROCS, ids=[f"np{n}" for n in NPROCS])
@pytest.mark.parametrize("mode", MODES)
def test_device_arrays_on_the_cuda_simulator(mode, nprocs):
    # The simulator runs each GPU thread as a Python thread; their hand-overs through the
    # GIL now and then stall one kernel for tens of seconds (seen at 0.5 s and at 24 s for
    # the same check), hence the long per-check limit.
    output = run_mpi("device_collectives", nprocs, timeout=600,
                     env={"NUMBA_ENABLE_CUDASIM": "1", "RINGTRAIN_CUDA_AWARE_MPI": MODES[mode],
                          "RINGTRAIN_TEST_CHECK_TIMEOUT": "240"})
    _assert_all_passed(output, nprocs)


def test_device_tensors_on_a_gpu():
    """Two ranks sharing the GPU, through host memory (an MPI from PyPI is not CUDA-aware:
    device pointers would crash it); skips without a GPU unless RINGTRAIN_TEST_GPU=1."""
    require_gpu()
    output = run_mpi("device_collectives", 2, timeout=600,
                     env={"NUMBA_ENABLE_CUDASIM": "0", "RINGTRAIN_CUDA_AWARE_MPI": "0"})
    _assert_all_passed(output, 2)
