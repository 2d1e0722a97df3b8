"""Who a rank is (from the variables its MPI sets) and the per-rank defaults it gets.

The MPI launcher tells each process its place: MPICH's and Intel MPI's Hydra set
``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID`` and ``MPI_LOCALNRANKS``; Open MPI sets
``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK`` and
``OMPI_COMM_WORLD_LOCAL_SIZE``. Reading them needs no MPI call, so the supervisor and the
exception hook know the rank without initializing MPI.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Mapping

NVIDIA_GPUS_DIRECTORY = "/proc/driver/nvidia/gpus"
NVIDIA_SMI_TIMEOUT = 10.0

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


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def nvidia_gpus() -> list[str]:
    """The NVIDIA GPUs of this machine, by model name, found without loading CUDA.

    Reads ``/proc/driver/nvidia/gpus`` (one folder per GPU), else asks ``nvidia-smi -L``
    if it is on PATH; an empty list when neither finds one.
    """
    try:
        folders = sorted(os.listdir(NVIDIA_GPUS_DIRECTORY))
    except OSError:
        folders = []
    if folders:
        return [_gpu_model(os.path.join(NVIDIA_GPUS_DIRECTORY, folder)) for folder in folders]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        result = subprocess.run([smi, "-L"], stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, errors="replace", timeout=NVIDIA_SMI_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split(":", 1)[1].split("(UUID", 1)[0].strip()
            for line in result.stdout.splitlines() if line.startswith("GPU ") and ":" in line]


def _gpu_model(folder: str) -> str:
    try:
        with open(os.path.join(folder, "information"), encoding="utf-8",
                  errors="replace") as handle:
            for line in handle:
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "NVIDIA GPU"


def rank_defaults(environ: Mapping[str, str], identity: RankIdentity, cores: int,
                  gpu_count: int) -> dict[str, str]:
    """The variables a rank gets unless the user set them already.

    * ``OMP_NUM_THREADS``: the node's cores shared among its ranks,
      ``max(1, cores // local_size)``, so threaded libraries do not oversubscribe it;
    * ``CUDA_VISIBLE_DEVICES``: when the node has GPUs, one per rank, by local rank
      (round robin when there are more ranks than GPUs);
    * ``PYTHONUNBUFFERED=1``: a rank's output reaches the terminal as it is written,
      and is not lost in a buffer if the rank is killed.

    Args:
        environ: the rank's environment; a variable present there (even empty) is kept.
        identity: the rank's place on its node.
        cores: the cores of the node.
        gpu_count: the GPUs of the node.

    Returns:
        Only the variables to add.
    """
    defaults = {"OMP_NUM_THREADS": str(max(1, cores // max(1, identity.local_size))),
                "PYTHONUNBUFFERED": "1"}
    if gpu_count > 0:
        defaults["CUDA_VISIBLE_DEVICES"] = str(identity.local_rank % gpu_count)
    return {name: value for name, value in defaults.items() if name not in environ}
