"""``init_process_group`` under MPI with nothing set: rank and size from MPI, and the
key-value store torch needs opened by ringtrain.

torch's default rendezvous (``env://``) reads MASTER_ADDR, MASTER_PORT, RANK and
WORLD_SIZE (or ``init_process_group``'s ``rank=`` and ``world_size=``) and fails when
one is missing. ringtrain wraps it. In a process started by an MPI launcher (mpiexec,
ringtrain-run), or wherever one of the four is missing, ringtrain starts on MPI's
processes and

- takes the rank and the size from MPI; a rank or size that was given must be MPI's,
  else every rank raises the same error (naming each rank's values);
- opens torch's TCP store on MASTER_ADDR:MASTER_PORT when both are set, else rank 0
  opens it on a free port and tells the others its address and port through MPI
  (127.0.0.1 for ranks on its node; from other nodes, the first of its addresses that
  answers).

A process that another launcher (e.g. torchrun) started with all four set takes torch's
own rendezvous, unchanged.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlparse

import torch.distributed as dist

from ..common.rank_identity import rank_identity

CONNECT_SECONDS = 2.0
"""How long a rank on another node tries each of rank 0's addresses."""

_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

Handler = Callable[..., Iterator[tuple[dist.Store, int, int]]]


def install() -> None:
    """Wrap torch's ``env://`` rendezvous (once per process)."""
    # the module: ``torch.distributed.rendezvous`` as an attribute is its function
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    current = handlers["env"]
    if getattr(current, "wrapped_by_ringtrain", False):
        return
    handlers["env"] = _wrapping(current)


def _wrapping(torch_env: Handler) -> Handler:
    def env_or_mpi(url: str, timeout: datetime.timedelta = dist.constants.default_pg_timeout,
                   **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
        query = dict(parse_qsl(urlparse(url).query))
        given_rank = query.get("rank") or os.environ.get("RANK")
        given_size = query.get("world_size") or os.environ.get("WORLD_SIZE")
        complete = given_rank and given_size and os.environ.get("MASTER_ADDR") \
            and os.environ.get("MASTER_PORT")
        if complete and rank_identity().rank is None:
            yield from torch_env(url, timeout, **kwargs)
            return
        yield mpi_rendezvous(timeout, given_rank, given_size)
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    env_or_mpi.wrapped_by_ringtrain = True  # type: ignore[attr-defined]
    return env_or_mpi


def mpi_rendezvous(timeout: datetime.timedelta, given_rank: str | None = None,
                   given_size: str | None = None) -> tuple[dist.Store, int, int]:
    """Start ringtrain and return torch's store, this rank and the size, from MPI.

    Raises:
        ValueError: on every rank, when a rank or size that was given differs from
            MPI's on some rank.
    """
    from .. import collectives as rt

    rt.init()
    rank, size = rt.rank(), rt.size()
    problem = _disagreement("RANK", given_rank, rank) or \
        _disagreement("WORLD_SIZE", given_size, size)
    problems = rt.allgather_object(problem, name="torch.distributed rendezvous")
    if any(problems):
        raise ValueError(
            "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p) +
            "; under mpiexec or ringtrain-run leave RANK and WORLD_SIZE unset, or set "
            "them to MPI's")
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if address and port:
        return _store(address, int(port), rank, size, timeout), rank, size
    server = _store("127.0.0.1", 0, rank, size, timeout) if rank == 0 else None
    offer = (server.port, socket.gethostname(), _addresses()) if server is not None else None
    port, host, addresses = rt.broadcast_object(offer, root_rank=0,
                                                name="torch.distributed store")
    if server is not None:
        return server, rank, size
    here = rt.local_size() == rt.size() or socket.gethostname() == host
    address = "127.0.0.1" if here else _reachable(addresses, port, rank)
    return _store(address, port, rank, size, timeout), rank, size


def _disagreement(variable: str, given: str | None, mpi_value: int) -> str | None:
    if given is None or not given.strip() or int(given) == mpi_value:
        return None
    return f"{variable}={given.strip()} (or init_process_group's argument) but MPI says {mpi_value}"


def _store(address: str, port: int, rank: int, size: int,
           timeout: datetime.timedelta) -> dist.TCPStore:
    return dist.TCPStore(address, port, size, rank == 0, timeout, wait_for_workers=False,
                         multi_tenant=True)


def _addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback."""
    import psutil

    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                found.append(entry.address)
    return found


def _reachable(addresses: list[str], port: int, rank: int) -> str:
    for address in addresses:
        try:
            with socket.create_connection((address, port), timeout=CONNECT_SECONDS):
                return address
        except OSError:
            continue
    raise RuntimeError(
        f"rank {rank}: cannot reach rank 0's torch.distributed store on port {port} at "
        f"any of {addresses}; set MASTER_ADDR (and MASTER_PORT) to an address of rank 0's "
        f"node that the others reach")
