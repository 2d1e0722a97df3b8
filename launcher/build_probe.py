"""What ``--check-build`` learns from MPI itself, in a process of its own.

``python -m ringtrain.launcher.build_probe`` prints JSON objects, one a line, as it learns
them: the MPI library's version string (which needs no ``MPI_Init``), ringtrain's
collectives and algorithms, then whether MPI is CUDA-aware, which both vendors answer
only after ``MPI_Init``: MPI is started here as a single process, so the launcher never
starts it. A line is printed as soon as it is known, so a crash in ``MPI_Init`` still
leaves the earlier answers.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import re

_MPI_LIBRARY = re.compile(r"^libmpi(_[A-Za-z0-9_]+)?\.so")
_COLLECTIVE_PREFIXES = ("allreduce", "grouped_allreduce", "broadcast", "allgather",
                        "reducescatter", "alltoall", "barrier")
MPIX_GPU_SUPPORT_CUDA = 0


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


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


def cuda_aware() -> str:
    """``"yes"``, ``"no"`` or ``"no (...)"``: MPICH's ``MPIX_GPU_query_support`` or Open
    MPI's ``MPIX_Query_cuda_support`` on the loaded library; MPI must be initialized."""
    for path in loaded_mpi_libraries():
        library = ctypes.CDLL(path)
        if hasattr(library, "MPIX_GPU_query_support"):
            flag = ctypes.c_int(0)
            library.MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag))
            return "yes" if flag.value else "no"
        if hasattr(library, "MPIX_Query_cuda_support"):
            return "yes" if library.MPIX_Query_cuda_support() else "no"
    return "no (the MPI library has no CUDA query function)"


def main() -> None:
    """Print what MPI and ringtrain's collectives say, one JSON object a line."""
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    _emit(library_version=MPI.Get_library_version().strip(),
          mpi_standard="{}.{}".format(*MPI.Get_version()))
    import ringtrain.collectives as collectives
    from ringtrain.collectives.config import ALGORITHMS

    names = [name for name in collectives.__all__
             if name.startswith(_COLLECTIVE_PREFIXES)
             and inspect.isfunction(getattr(collectives, name))]
    _emit(collectives=names, algorithms={key: list(value) for key, value in ALGORITHMS.items()})
    MPI.Init()
    try:
        _emit(cuda_aware=cuda_aware())
    finally:
        MPI.Finalize()


if __name__ == "__main__":
    main()
