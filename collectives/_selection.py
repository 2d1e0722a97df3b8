"""The automatic choice of algorithm, by message size and world size.

allreduce: recursive doubling up to ``recursive_doubling_max_bytes`` (fewest messages:
lg p rounds; up to the agreement's payload capacity the data travels in the agreement's
own messages), the ring above it (least data per rank: 2(p-1)/p*n, reduced in cached
segments); device tensors of ranks on one node are reduced on the GPUs through CUDA IPC
(``ipc``) from ``ipc_min_bytes`` on. broadcast, allgather and reducescatter up to
``CARRIED_MAX_BYTES``: ``recursive_doubling``, the data in the agreement's messages. Above
it, broadcast: one direct send for two ranks, a binomial tree below
``broadcast_pipeline_min_bytes``, the pipelined chain from it on; allgather and
reducescatter: the ring. alltoall: the pairwise exchange. Thresholds are settings (see
``config``), and ``algorithm=`` on a call overrides the choice."""

from __future__ import annotations

from ._topology import NodeLayout
from .config import ALGORITHMS, Settings
from .errors import InvalidArgumentError, subject

CARRIED_MAX_BYTES = 4096
"""Broadcasts, allgathers (the whole gathered array) and reduce-scatters (the whole
array) up to this size travel in the agreement's own messages (``recursive_doubling``:
one exchange, in lg p steps, carries the check and the data)."""

_DEFAULTS = {"allgather": "ring", "reducescatter": "ring", "alltoall": "pairwise"}
_HOST_ALLREDUCE = tuple(a for a in ALGORITHMS["allreduce"] if a not in ("auto", "ipc"))


def requested(collective: str, algorithm: str | None, settings: Settings,
              name: str | None) -> str:
    """The algorithm asked for by the call, else by the settings (possibly ``auto``)."""
    choice = getattr(settings, f"{collective}_algorithm") if algorithm is None else algorithm
    if choice not in ALGORITHMS[collective]:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: unknown algorithm {choice!r}; "
            f"use one of {', '.join(ALGORITHMS[collective])}")
    return choice


def allreduce_algorithm(algorithm: str | None, nbytes: int, size: int, settings: Settings,
                        name: str | None, layout: NodeLayout | None = None) -> str:
    """Choose the allreduce algorithm of host arrays (``layout``: the group's nodes, if
    known). ``ipc`` as the setting means ``auto`` here; asked for by the call, it is
    refused: it reduces device tensors."""
    choice = requested("allreduce", algorithm, settings, name)
    if choice == "ipc":
        if algorithm == "ipc":
            raise InvalidArgumentError(
                f"{subject('allreduce', name)}: algorithm 'ipc' reduces tensors in GPU "
                f"memory; host arrays use {', '.join(_HOST_ALLREDUCE)}")
        choice = "auto"
    if choice != "auto":
        return choice
    if _hierarchical_pays(layout, nbytes, settings):
        return "hierarchical"
    return host_allreduce_algorithm(nbytes, settings)


ADASUM = "adasum"
"""The algorithm of every Adasum allreduce (see ``_adasum``): its own schedule."""


def adasum_algorithm(algorithm: str | None, collective: str, name: str | None,
                     on_device: bool) -> str:
    """The algorithm of an Adasum allreduce: ``adasum``, whatever the setting says.

    Raises:
        InvalidArgumentError: another algorithm asked for by the call, or device memory
            (Adasum combines host arrays; copy device tensors to the host first).
    """
    if algorithm not in (None, "auto", ADASUM):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: op Adasum runs its own algorithm (recursive "
            f"halving, then an allgather), not {algorithm!r}; leave algorithm unset")
    if on_device:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: op Adasum combines host arrays; this tensor is "
            f"in GPU memory: copy it to the host (tensor.cpu()) first")
    return ADASUM


def host_allreduce_algorithm(nbytes: int, settings: Settings) -> str:
    """``auto``'s choice between the algorithms that need no node layout."""
    return "recursive_doubling" if nbytes <= settings.recursive_doubling_max_bytes else "ring"


def device_allreduce_algorithm(algorithm: str | None, nbytes: int, size: int,
                               settings: Settings, name: str | None,
                               layout: NodeLayout) -> str:
    """Choose the allreduce algorithm of device memory that MPI does not reduce: ``ipc``
    when every rank is on one node and can share device memory (asked for, or ``auto``
    from ``ipc_min_bytes`` on), else as :func:`allreduce_algorithm` chooses for the host
    copies.

    Raises:
        InvalidArgumentError: ``ipc`` asked for by the call where it cannot run.
    """
    choice = requested("allreduce", algorithm, settings, name)
    if size > 1 and (choice == "ipc" or
                     choice == "auto" and nbytes >= settings.ipc_min_bytes):
        from ._ipc import unusable_reason  # loads numba.cuda: only for device tensors
        reason = unusable_reason(len(layout.nodes))
        if reason is None:
            return "ipc"
        if algorithm == "ipc":
            raise InvalidArgumentError(
                f"{subject('allreduce', name)}: algorithm 'ipc' cannot run here: {reason}")
    return allreduce_algorithm(None if choice == "ipc" else algorithm, nbytes, size,
                               settings, name, layout)


def broadcast_algorithm(algorithm: str | None, nbytes: int, size: int, settings: Settings,
                        name: str | None, layout: NodeLayout | None = None) -> str:
    """Choose the broadcast algorithm (``layout``: the group's nodes, if known)."""
    choice = requested("broadcast", algorithm, settings, name)
    if choice != "auto":
        return choice
    if _hierarchical_pays(layout, nbytes, settings):
        return "hierarchical"
    if nbytes <= CARRIED_MAX_BYTES:
        return "recursive_doubling"
    if size <= 2 or nbytes < settings.broadcast_pipeline_min_bytes:
        return "binomial"
    return "pipeline"


def allgather_algorithm(algorithm: str | None, nbytes: int, settings: Settings,
                        name: str | None) -> str:
    """Choose the allgather algorithm (``nbytes``: the gathered array of one row per
    rank, which every rank knows alike)."""
    choice = requested("allgather", algorithm, settings, name)
    if choice != "auto":
        return choice
    return "recursive_doubling" if nbytes <= CARRIED_MAX_BYTES else _DEFAULTS["allgather"]


def reducescatter_algorithm(algorithm: str | None, nbytes: int, settings: Settings,
                            name: str | None) -> str:
    """Choose the reducescatter algorithm (``nbytes``: the whole array)."""
    choice = requested("reducescatter", algorithm, settings, name)
    if choice != "auto":
        return choice
    return "recursive_doubling" if nbytes <= CARRIED_MAX_BYTES else _DEFAULTS["reducescatter"]


def simple_algorithm(collective: str, algorithm: str | None, settings: Settings,
                     name: str | None) -> str:
    """Choose the algorithm of allgather, reducescatter or alltoall."""
    choice = requested(collective, algorithm, settings, name)
    return _DEFAULTS[collective] if choice == "auto" else choice


def _hierarchical_pays(layout: NodeLayout | None, nbytes: int, settings: Settings) -> bool:
    return layout is not None and layout.pays_off and \
        nbytes >= settings.hierarchical_min_bytes
