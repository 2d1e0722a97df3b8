"""Deciding whether MPI takes device pointers: the override, and the MPI library's answer."""

import subprocess
import sys

import pytest

from ringtrain.collectives.cuda_aware import CUDA_AWARE_VARIABLE, CudaAwareness, cuda_awareness


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
