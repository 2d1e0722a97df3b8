"""Who a rank is, from the variables its MPI launcher sets.

The MPI launcher tells each process its place: MPICH's and Intel MPI's Hydra set
``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID`` and ``MPI_LOCALNRANKS``; Open MPI sets
``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK`` and
``OMPI_COMM_WORLD_LOCAL_SIZE``. Reading them needs no MPI call, so the supervisor and the
exception hook know the rank without initializing MPI.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
_LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


@dataclasses.dataclass(frozen=True)
class RankIdentity:
    """A process's place in the job, as its MPI launcher announced it.

    Attributes:
        rank: rank among all processes, None when no MPI variable says it.
        size: number of processes, None when unknown.
        local_rank: rank among the processes on this node (0 when unknown).
        local_size: number of processes on this node (1 when unknown).
    """

    rank: int | None
    size: int | None
    local_rank: int = 0
    local_size: int = 1

    @property
    def label(self) -> str:
        """The rank as output lines show it: ``"1"``, or ``"?"`` when unknown."""
        return "?" if self.rank is None else str(self.rank)


def _first_integer(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def rank_identity(environ: Mapping[str, str] | None = None) -> RankIdentity:
    """This process's rank, size, local rank and local size from the MPI's variables."""
    environ = os.environ if environ is None else environ
    local_rank = _first_integer(environ, _LOCAL_RANK_VARIABLES)
    local_size = _first_integer(environ, _LOCAL_SIZE_VARIABLES)
    return RankIdentity(rank=_first_integer(environ, _RANK_VARIABLES),
                        size=_first_integer(environ, _SIZE_VARIABLES),
                        local_rank=local_rank if local_rank is not None else 0,
                        local_size=max(1, local_size) if local_size is not None else 1)
