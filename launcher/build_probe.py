"""What ``--check-build`` learns from MPI itself, in a process of its own.

``python -m ringtrain.launcher.build_probe`` prints JSON objects, one a line, as it learns
them: the MPI library's version string (which needs no ``MPI_Init``), ringtrain's
collectives and algorithms, then whether MPI is CUDA-aware, which both vendors answer
only after ``MPI_Init``: MPI is started here as a single process, so the launcher never
starts it. A line is printed as soon as it is known, so a crash in ``MPI_Init`` still
leaves the earlier answers.
"""

from __future__ import annotations

import inspect
import json

_COLLECTIVE_PREFIXES = ("allreduce", "grouped_allreduce", "broadcast", "allgather",
                        "reducescatter", "alltoall", "barrier")


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


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
    from ringtrain.collectives.cuda_aware import cuda_awareness

    MPI.Init()
    try:
        try:
            answer = str(cuda_awareness())
        except ValueError as error:
            answer = f"unknown ({error})"
        _emit(cuda_aware=answer)
    finally:
        MPI.Finalize()


if __name__ == "__main__":
    main()
