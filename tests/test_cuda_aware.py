"""Deciding whether MPI takes device pointers: the override, and the MPI library's answer."""

import ctypes
import re
import subprocess
import sys

import pytest

from mpi_launch import run_mpi
from ringtrain.collectives.cuda_aware import CUDA_AWARE_VARIABLE, CudaAwareness, cuda_awareness
from ringtrain.collectives.gpu_choice import GPU_CHOICE_VARIABLE, LIBCUDA


@pytest.mark.parametrize("value, aware", [("1", True), ("yes", True), ("TRUE", True),
                                          ("0", False), ("no", False), (" false ", False)])
def test_the_variable_overrides_the_library(value, aware):
    answer = cuda_awareness({CUDA_AWARE_VARIABLE: value}, paths=[])
    assert answer == CudaAwareness(aware, f"{CUDA_AWARE_VARIABLE}={value.strip()}")
    assert str(answer).startswith("yes (" if aware else "no (")


def test_a_malformed_variable_is_refused_with_its_value():
    with pytest.raises(ValueError, match=f"{CUDA_AWARE_VARIABLE}='maybe'"):
        cuda_awareness({CUDA_AWARE_VARIABLE: "maybe"}, paths=[])


def test_a_library_without_a_query_function_is_taken_as_not_cuda_aware():
    answer = cuda_awareness({}, paths=[])
    assert not answer.aware and "no CUDA query function" in answer.how


@pytest.mark.processes
def test_the_loaded_mpi_library_answers():
    # In a process of its own: the query needs MPI initialized, and this one must not be.
    program = ("from mpi4py import MPI\n"
               "from ringtrain.collectives.cuda_aware import cuda_awareness\n"
               "print(MPI.Get_library_version().split()[0], cuda_awareness({}))\n")
    run = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=60, check=True)
    vendor, answer = run.stdout.split(maxsplit=1)
    assert answer.strip().endswith(("(MPIX_GPU_query_support)", "(MPIX_Query_cuda_support)")), \
        run.stdout
    if vendor == "MPICH":
        assert answer.startswith("no "), answer  # the PyPI MPICH wheel is built without CUDA


@pytest.mark.processes
@pytest.mark.parametrize("override, expected", [
    (None, "no (MPIX_"), ("1", "yes (RINGTRAIN_CUDA_AWARE_MPI=1)"),
    ("maybe", "no (MPIX_")])
def test_init_decides_once_and_logs_it(override, expected):
    env = {"RINGTRAIN_LOG_LEVEL": "INFO"}
    if override is not None:
        env[CUDA_AWARE_VARIABLE] = override
        env[GPU_CHOICE_VARIABLE] = override
    output = run_mpi("cuda_aware_init", 2, env=env, timeout=60)
    for rank in (0, 1):  # the ranks' lines may interleave: count, do not split
        assert output.count(f"r{rank} | INFO | CUDA-aware MPI: ") == 1, output
        assert output.count(f"r{rank} | INFO | CUDA-aware MPI: {expected}") == 1, output
        assert f"rank {rank} decided {expected}" in output, output
        # The GPU is chosen at the same time, and logged once too.
        assert output.count(f"r{rank} | INFO | GPU: ") == 1, output
        gpu = re.search(rf"r{rank} \| INFO \| GPU: (.*)", output).group(1)
        assert f"rank {rank} uses GPU {gpu}" in output, output
        if not _has_cuda_driver():
            assert gpu == "none (no CUDA driver)", output
    if override == "maybe":
        assert "RINGTRAIN_CUDA_AWARE_MPI='maybe'" in output, output
        assert "RINGTRAIN_GPU_BY_LOCAL_RANK='maybe'" in output, output


def _has_cuda_driver():
    try:
        ctypes.CDLL(LIBCUDA)
    except OSError:
        return False
    return True
