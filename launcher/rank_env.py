"""The per-rank defaults a rank gets, from who it is (:mod:`ringtrain.common.rank_identity`)
and what its node has."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Mapping

from ..common.rank_identity import RankIdentity

NVIDIA_GPUS_DIRECTORY = "/proc/driver/nvidia/gpus"
NVIDIA_SMI_TIMEOUT = 10.0


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
      and is not lost in a buffer if the rank is killed;
    * torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``, from
      the MPI's own, so that scripts written for torchrun run unchanged (the job's
      ``MASTER_ADDR`` and ``MASTER_PORT`` come from :func:`torch_rendezvous`).

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
    if identity.rank is not None and identity.size is not None:
        defaults.update(RANK=str(identity.rank), LOCAL_RANK=str(identity.local_rank),
                        WORLD_SIZE=str(identity.size),
                        LOCAL_WORLD_SIZE=str(identity.local_size))
    return {name: value for name, value in defaults.items() if name not in environ}


TORCHRUN_DEFAULT_PORT = 29500
"""torchrun's default MASTER_PORT: what a job whose rank 0 runs on another host gets."""


def torch_rendezvous(first_host: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """torchrun's ``MASTER_ADDR`` and ``MASTER_PORT`` for a job, unless set already.

    Args:
        first_host: the host of rank 0, or None when the job runs on this machine.
        environ: the job's variables (the launcher's own and ``--env``).

    Returns:
        Only the variables to add: rank 0's host (``127.0.0.1`` here) and a port free on
        this machine when rank 0 runs here, else torchrun's default port.
    """
    local = first_host is None or first_host in ("localhost", "127.0.0.1",
                                                 socket.gethostname())
    found = {"MASTER_ADDR": "127.0.0.1" if local else str(first_host)}
    if "MASTER_PORT" not in environ:
        found["MASTER_PORT"] = str(_free_port() if local else TORCHRUN_DEFAULT_PORT)
    return {name: value for name, value in found.items() if name not in environ}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
