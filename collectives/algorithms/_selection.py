"""The automatic choice of algorithm, by message size and group size.

``auto`` follows the tuning table in force (see :mod:`.tuning`): the tuned one that
``init`` loaded, for the sizes and group sizes it covers, else the built-in one. The
built-in table keeps ringtrain's own algorithms up to 4 KiB (allreduce: recursive
doubling up to ``recursive_doubling_max_bytes``; broadcast, allgather, reducescatter
and alltoall: ``recursive_doubling``, their data in the agreement's own messages; on
one node broadcast up to 128 KiB or 16 KiB, allgather up to 64 KiB and reducescatter up
to 32 KiB, see :mod:`.tuning`) and takes MPI's own above, but for the larger allreduces
and reducescatters, which take the ring (the allreduce on one node only: MPI's own
between nodes), and the allgathers and alltoalls of mid sizes on one node, which take
the pairwise exchange through its shared memory. Device tensors of ranks on one node are
reduced on the GPUs through CUDA IPC (``ipc``) from ``ipc_min_bytes`` on.
``algorithm=`` on a call, then the ``*_algorithm`` settings, override the choice.

When the ranks span several nodes and some node holds more than one of them, allreduce,
broadcast, allgather and reducescatter of at least ``hierarchical_min_bytes`` that no
tuned range covers use the ``hierarchical`` algorithm (see ``_hierarchical``): it sends
each byte across nodes once per node rather than once per rank (reducescatter on nodes
of equal size; on others it takes the ring).
"""

from __future__ import annotations

from ..config import ALGORITHMS, Settings
from ..errors import InvalidArgumentError, subject
from ..tuning import SMALL_MESSAGE_BYTES, choose, default_choice, tuned_choice
from ..world._topology import HIERARCHICAL, NodeLayout

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
                        name: str | None, layout: NodeLayout | None = None,
                        mpi_reduces: bool = True) -> str:
    """Choose the allreduce algorithm of host arrays (``layout``: the group's nodes, if
    known). ``ipc`` as the setting means ``auto`` here; asked for by the call, it is
    refused: it reduces device tensors. Without ``mpi_reduces`` (16-bit floats, which
    MPI reduces only by calling back into Python for every piece), ``auto`` takes the
    ring where the built-in table says MPI's own (a tuned table is followed)."""
    choice = requested("allreduce", algorithm, settings, name)
    if choice == "ipc":
        if algorithm == "ipc":
            raise InvalidArgumentError(
                f"{subject('allreduce', name)}: algorithm 'ipc' reduces tensors in GPU "
                f"memory; host arrays use {', '.join(_HOST_ALLREDUCE)}")
        choice = "auto"
    if choice != "auto":
        return choice
    chosen = _table_choice("allreduce", nbytes, size, settings, layout)
    if chosen == "native" and not mpi_reduces and \
            tuned_choice("allreduce", nbytes, size) is None:
        return "ring"
    return chosen


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


def host_allreduce_algorithm(nbytes: int, size: int, settings: Settings) -> str:
    """``auto``'s allreduce where the node layout is not known: as the tables say,
    ``hierarchical`` excepted."""
    found = choose("allreduce", nbytes, size, settings)
    if found in HIERARCHICAL:
        return default_choice("allreduce", nbytes, size, settings)
    return found


def device_allreduce_algorithm(algorithm: str | None, nbytes: int, size: int,
                               settings: Settings, name: str | None,
                               layout: NodeLayout, mpi_reduces: bool = True) -> str:
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
                               settings, name, layout, mpi_reduces)


def reduces_inside_nodes_on_gpus(algorithm: str, layout: NodeLayout) -> bool:
    """Whether a device allreduce taking ``algorithm`` (MPI not reducing device memory)
    runs on the GPUs through CUDA IPC inside the nodes: ``ipc``, or ``hierarchical`` on
    nodes of equal size that can share device memory (:mod:`._ipc`)."""
    if algorithm == "ipc":
        return True
    if algorithm != "hierarchical":
        return False
    from ._ipc import serves_hierarchical  # loads numba.cuda: only for device tensors
    return serves_hierarchical(layout)


def broadcast_algorithm(algorithm: str | None, nbytes: int, size: int, settings: Settings,
                        name: str | None, layout: NodeLayout | None = None) -> str:
    """Choose the broadcast algorithm (``layout``: the group's nodes, if known)."""
    choice = requested("broadcast", algorithm, settings, name)
    if choice != "auto":
        return choice
    return _table_choice("broadcast", nbytes, size, settings, layout)


def reducescatter_algorithm(algorithm: str | None, nbytes: int, size: int,
                            settings: Settings, name: str | None,
                            layout: NodeLayout | None = None) -> str:
    """Choose the reducescatter algorithm (``nbytes``: the whole input; ``layout``: the
    group's nodes, if known)."""
    choice = requested("reducescatter", algorithm, settings, name)
    if choice == "auto":
        choice = auto_choice("reducescatter", nbytes, size, settings, layout)
    if choice == "hierarchical" and (layout is None or not layout.uniform):
        # Its columns need nodes of equal size; the ring moves the same data flat.
        return "ring"
    return choice


def auto_choice(collective: str, nbytes: int, size: int, settings: Settings,
                layout: NodeLayout | None = None) -> str:
    """``auto``'s algorithm of allgather, reducescatter or alltoall for ``nbytes`` in
    nccl-tests' convention (see :mod:`.tuning`). allgather and alltoall, whose sizes
    differ between ranks, call it once the ranks have exchanged their sizes (their
    signatures carry ``auto``): the ranks' tuning tables were found equal at init, so
    they resolve it alike. Across nodes, allgather and reducescatter take
    ``hierarchical`` as allreduce does; alltoall, which has none, never."""
    return _table_choice(collective, nbytes, size, settings, layout,
                         collective != "alltoall")


def _table_choice(collective: str, nbytes: int, size: int, settings: Settings,
                  layout: NodeLayout | None, hierarchical_above: bool = True) -> str:
    tuned = tuned_choice(collective, nbytes, size)
    if tuned is not None and (tuned not in HIERARCHICAL or _spans_nodes(layout)):
        return tuned
    if hierarchical_above and _spans_nodes(layout) and \
            nbytes >= settings.hierarchical_min_bytes:
        return "hierarchical"
    chosen = default_choice(collective, nbytes, size, settings)
    if chosen == "ring" and collective == "allreduce" and layout is not None and \
            len(layout.nodes) > 1:
        # The built-in table's ring was measured on one node; between nodes MPI's own
        # allreduce was as fast (one rank a node) or faster (several: fewer steps on the
        # links). Its reduce-scatter was not: as fast with one rank a node, slower with
        # several (recursive halving sends more across the links than the ring;
        # docs/lab/2026-11-26-the-ring-in-compiled-code.md).
        return "native"
    through_mailboxes = (chosen == "recursive_doubling" and collective != "allreduce" and
                         nbytes > SMALL_MESSAGE_BYTES) or chosen == "pairwise"
    if through_mailboxes and layout is not None and \
            (len(layout.nodes) > 1 or not layout.shared_messages):
        # Broadcasts, allgathers and reduce-scatters ride above the small sizes where
        # they were measured, through the mailboxes of one node, each message carrying
        # only what its sender holds; through MPI every message carries all of it. The
        # built-in table's pairwise allgather and alltoall were measured through the
        # mailboxes too (docs/lab/2026-11-28-riding-in-the-agreement.md,
        # docs/lab/2026-11-28-allgather-and-alltoall-through-the-mailboxes.md).
        return "native"
    return chosen


def _spans_nodes(layout: NodeLayout | None) -> bool:
    return layout is not None and layout.pays_off
