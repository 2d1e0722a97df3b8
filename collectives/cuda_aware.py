"""Whether device pointers may be handed to the MPI library (a CUDA-aware MPI).

A device pointer given to an MPI that is not CUDA-aware crashes the process with no
Python error, so the collectives ask the MPI library that mpi4py loaded, through ctypes:
MPICH's ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``, else Open MPI's
``MPIX_Query_cuda_support()``. Both answer for the running library, so MPI must be
initialized. ``RINGTRAIN_CUDA_AWARE_MPI=1`` or ``0`` overrides the answer (for an MPI
that has no query function, or to force the staged path).
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..common.environment import CUDA_AWARE_MPI, SWITCH_VALUES

__all__ = ["CUDA_AWARE_VARIABLE", "MPIX_GPU_SUPPORT_CUDA", "SWITCH_VALUES", "CudaAwareness",
           "cuda_awareness", "loaded_mpi_libraries", "query_mpi_library"]

CUDA_AWARE_VARIABLE = CUDA_AWARE_MPI.name
MPIX_GPU_SUPPORT_CUDA = 0
"""MPICH's ``MPIX_GPU_SUPPORT_CUDA`` (mpi.h)."""

_MPI_LIBRARY = re.compile(r"^libmpi(_[A-Za-z0-9_]+)?\.so")


@dataclass(frozen=True)
class CudaAwareness:
    """Whether MPI takes device pointers, and how that was decided.

    Attributes:
        aware: True when device buffers may go to MPI directly.
        how: where the answer came from, for the log and ``ringtrain-run --check-build``.
    """

    aware: bool
    how: str

    def __str__(self) -> str:
        return f"{'yes' if self.aware else 'no'} ({self.how})"


def loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI libraries mapped into this process (after mpi4py.MPI is imported)."""
    found = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) == 6 else ""
            if _MPI_LIBRARY.match(os.path.basename(path)) and path not in found:
                found.append(path)
    return found


def query_mpi_library(paths: list[str] | None = None) -> CudaAwareness:
    """Ask the loaded MPI library (MPI must be initialized)."""
    for path in loaded_mpi_libraries() if paths is None else paths:
        library = ctypes.CDLL(path)
        if hasattr(library, "MPIX_GPU_query_support"):
            flag = ctypes.c_int(0)
            query = library.MPIX_GPU_query_support
            query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            query.restype = ctypes.c_int
            if query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
                return CudaAwareness(bool(flag.value), "MPIX_GPU_query_support")
        if hasattr(library, "MPIX_Query_cuda_support"):
            query = library.MPIX_Query_cuda_support
            query.restype = ctypes.c_int
            return CudaAwareness(bool(query()), "MPIX_Query_cuda_support")
    return CudaAwareness(False, "the MPI library has no CUDA query function")


def cuda_awareness(environ: Mapping[str, str] | None = None,
                   paths: list[str] | None = None) -> CudaAwareness:
    """``RINGTRAIN_CUDA_AWARE_MPI`` if set to 0 or 1, else the MPI library's answer.

    Raises:
        ValueError: the variable holds something other than 0/1 (yes/no, true/false).
    """
    aware = CUDA_AWARE_MPI.read(environ)
    if aware is not None:
        value = (CUDA_AWARE_MPI.text(environ) or "").strip()
        return CudaAwareness(aware, f"{CUDA_AWARE_VARIABLE}={value}")
    return query_mpi_library(paths)
