"""Allreduce of device memory between the ranks of one node, on the GPUs, through CUDA IPC.

Each rank of the group keeps one device buffer of its own that the others map
(:mod:`ringtrain.kernels.ipc`): handles are exchanged and opened the first time the group
reduces device memory, kept, and exchanged again only when a larger call needs a larger
buffer. The buffer holds this rank's input (``count`` elements) followed by room for one
reduced chunk.

An allreduce of ``count`` elements over p ranks, rank r owning chunk r (the ring's
chunks, :func:`._ring.chunk_bounds`):

1. copy the input into the own buffer; synchronize; barrier;
2. reduce chunk r from every rank's buffer, read in place through the mappings, into
   the own buffer's chunk room, in the ring's order (chunk c: ``a[c+1]``, then
   ``combine(a[q], partial)`` for q = c+2, ..., c+p mod p), then divide and scale it;
   synchronize; barrier;
3. copy every rank's reduced chunk into the result; synchronize; barrier (no rank
   writes its buffer again while a peer reads it).

Everything is queued on the default stream, copies as single driver calls between
device addresses. What a shape of call (element count and dtype) reads and writes is
worked out once and kept with the buffers (:class:`_Steps`): the chunks as kernel
arrays and the reduction's kernels prepared for them, as numba takes longer to make a
device array or to check a launch's arguments than the kernels take below a few MiB.

Each element is reduced on one rank, in the order of the ring allreduce, with the same
kernels as the host's twins, so the result is bit-identical on every rank and to the
ring on host memory. No stream order crosses processes: a stream synchronize and an MPI
barrier order the steps (a barrier on one node costs a few microseconds).

Across nodes of equal size (:func:`hierarchical_allreduce`), each node runs steps 1
and 2 on its own ranks without finishing the chunk; the owners of chunk r, one per node,
then allreduce it through host memory (the staged path, on the chunk alone, finishing it),
and each node runs step 3. Only the node sums cross the nodes, and only 1/L of the array
crosses each rank's PCIe link (L ranks per node), where the staged hierarchical
allreduce copies all of it down and up.

Whether the ranks can map each other's memory is learnt once per group, by trying: every
rank allocates, exports, opens its peers' buffers, and the ranks gather each other's
outcome, so all of them know whether every one succeeded. If one did not, the group
reduces through host memory from then on, and the lowest rank logs one INFO line saying
why. The ranks try only when they share one node and each can share device memory at
all (:func:`unusable_reason`); for the hierarchical allreduce the nodes also tell each
other their outcome, so that all of them take the same path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI
import numpy as np

from ...kernels import BFLOAT16, device, encoding_of, ipc
from ...kernels.dtypes import BFLOAT16_ENCODING
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._tracing import phase
from ..logs import LOGGER
from ..world._topology import Hierarchy, NodeLayout
from ._ring import chunk_bounds

ALIGNMENT = 256
"""Byte alignment of the reduced chunk's room (the device's allocation alignment)."""
GRANULE = 2 << 20
"""Buffers grow in multiples of this many bytes."""
MAX_KEPT_STEPS = 64
"""Shapes of call whose views a group keeps (all are dropped when one more comes)."""


class NodeBuffers:
    """One group's shared device buffers: this rank's, and its peers' mapped.

    A :class:`._group.Group` child: freed with the group (collective).

    Attributes:
        group: the ranks.
        ordinal: the GPU the buffers are on.
        capacity: bytes of every rank's buffer (the same on all ranks).
        unavailable: why the ranks cannot share device memory, or None when they can.
        exchanges: how many times the buffers were allocated and mapped (the same count
            on every rank of the group).
    """

    def __init__(self, group: Group, ordinal: int):
        self.group = group
        self.ordinal = ordinal
        self.capacity = 0
        self.unavailable: str | None = None
        self.exchanges = 0
        self.own: ipc.SharedBuffer | None = None
        self.peers: dict[int, ipc.PeerBuffer] = {}
        self.addresses: list[int] = []
        self._steps: dict[tuple[int, np.dtype], _Steps] = {}

    def ensure(self, nbytes: int) -> bool:
        """Make every rank's buffer hold at least ``nbytes`` bytes (collective over the
        group, the same ``nbytes`` on every rank); False when the ranks cannot share."""
        if self.unavailable is None and nbytes > self.capacity:
            self._exchange(-(-nbytes // GRANULE) * GRANULE)
        return self.unavailable is None

    def array_of(self, rank: int) -> Any:
        """The buffer of group rank ``rank`` (this rank's own, or a mapped peer's)."""
        return self.own.array if rank == self.group.rank else self.peers[rank].array

    def steps(self, count: int, dtype: np.dtype) -> _Steps:
        """The views an allreduce of ``count`` elements of ``dtype`` works on, kept until
        the buffers are exchanged again."""
        key = (count, dtype)
        steps = self._steps.get(key)
        if steps is None:
            if len(self._steps) >= MAX_KEPT_STEPS:
                self._steps.clear()
            steps = self._steps[key] = _Steps(self, count, dtype)
        return steps

    def free(self) -> None:
        """Unmap the peers' buffers, then free the own one once every rank has unmapped
        it (collective over the group)."""
        if self.own is None and not self.peers:
            return
        with device.on_device(self.ordinal):
            self._release()

    def _release(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()
        self.addresses = []
        self._steps.clear()
        self.group.comm.Barrier()
        if self.own is not None:
            self.own.free()
            self.own = None
        self.capacity = 0

    def refuse(self, reason: str) -> None:
        """Stop sharing device memory, for ``reason`` (collective over the group)."""
        self.unavailable = reason
        if self.own is not None or self.peers:
            with device.on_device(self.ordinal):
                self._release()

    def _exchange(self, capacity: int) -> None:
        """Allocate buffers of ``capacity`` bytes on every rank and map the peers'."""
        self.exchanges += 1
        self._release()
        reason = ipc.unavailable_reason()
        handle = None
        if reason is None:
            try:
                self.own = ipc.shared_buffer(capacity)
                handle = self.own.handle
            except Exception as error:  # out of memory, a driver refusal
                reason = f"allocating a {capacity}-byte shared buffer failed: {error}"
        handles = self.group.comm.allgather(handle if reason is None else None)
        if reason is None:
            try:
                for rank, peer_handle in enumerate(handles):
                    if rank != self.group.rank and peer_handle is not None:
                        self.peers[rank] = ipc.open_peer(peer_handle)
            except ipc.IpcUnavailableError as error:
                reason = str(error)
        reasons = self.group.comm.allgather(reason)
        failed = [(r, why) for r, why in enumerate(reasons) if why is not None]
        if failed:
            rank, why = failed[0]
            self.unavailable = f"rank {self.group.world_ranks[rank]}: {why}"
            self._release()
            if self.group.rank == 0:
                LOGGER.info("device allreduce between the ranks %s goes through host memory: "
                            "CUDA IPC is not usable (%s)", list(self.group.world_ranks),
                            self.unavailable)
            return
        self.capacity = capacity
        self.addresses = [device.address_of(self.array_of(r)) for r in range(self.group.size)]


def node_buffers(group: Group, ordinal: int) -> NodeBuffers:
    """The shared buffers of ``group`` on GPU ``ordinal``, made on first use."""
    key = ("ipc", ordinal)
    buffers = group.state.get(key)
    if buffers is None:
        buffers = group.state[key] = NodeBuffers(group, ordinal)
        group.children.append(buffers)
    return buffers


def _room_offset(count: int, itemsize: int) -> int:
    """Byte offset of the reduced chunk's room after ``count`` input elements."""
    return -(-count * itemsize // ALIGNMENT) * ALIGNMENT


def buffer_bytes(count: int, itemsize: int, size: int) -> int:
    """Bytes each rank's buffer needs to allreduce ``count`` elements over ``size`` ranks."""
    bounds = chunk_bounds(count, size)
    return _room_offset(count, itemsize) + bounds[1] * itemsize


def chain_order(chunk: int, size: int) -> list[int]:
    """The ranks whose values chunk ``chunk`` combines, in the ring's order: the first
    is where the partial result starts, each later one is combined into it."""
    return [(chunk + 1 + step) % size for step in range(size)]


class _Steps:
    """An allreduce of one shape on this rank, set up once per buffer exchange: the
    chunks' byte bounds, the room's offset, and the kernels that reduce this rank's
    chunk, prepared per reduction (making numba's device arrays and launching through
    its checks would cost more than the kernels themselves at most sizes)."""

    def __init__(self, buffers: NodeBuffers, count: int, dtype: np.dtype):
        group = buffers.group
        itemsize = dtype.itemsize
        self.nbytes = count * itemsize
        self.bounds = [bound * itemsize for bound in chunk_bounds(count, group.size)]
        self.room = _room_offset(count, itemsize)
        start, end = self.bounds[group.rank], self.bounds[group.rank + 1]
        self.chain = chain_order(group.rank, group.size)
        self.chunks = {rank: device.view_as(buffers.array_of(rank)[start:end], dtype)
                       for rank in self.chain}
        self.reduced = device.view_as(
            buffers.array_of(group.rank)[self.room:self.room + end - start], dtype)
        self.encoding = encoding_of(dtype)
        self._launches: dict[tuple, list[Callable[[], None]]] = {}

    def launches(self, op: ReduceOp, finish: Any,
                 finishing: Finishing) -> list[Callable[[], None]]:
        """The kernels reducing this rank's chunk in the ring's order into the room,
        then dividing and scaling it (``finishing`` prepares those)."""
        key = (op, finish)
        launches = self._launches.get(key)
        if launches is None:
            launches = []
            if self.reduced.size:
                first, second, *others = self.chain
                launches.append(device.prepared_reduction(op.value, self.chunks[second],
                                                          self.chunks[first], self.reduced,
                                                          self.encoding))
                launches += [device.prepared_reduction(op.value, self.chunks[other],
                                                       self.reduced, self.reduced,
                                                       self.encoding)
                             for other in others]
                launches += finishing(self.reduced, finish)
            self._launches[key] = launches
        return launches


Finishing = Callable[[Any, Any], list[Callable[[], None]]]
"""Prepares the kernels that divide and scale reduced device values in place, given the
values and the plan's finisher (:class:`._data_phase.Finisher`, hashable; or None)."""
Across = Callable[[Group, Any], None]
"""Allreduces a node's reduced chunk, in place on the device, among its owners on every
node (the group given), and finishes it."""


def allreduce(buffers: NodeBuffers, source: Any, result: Any, op: ReduceOp,
              finish: Any, finishing: Finishing, encoding: str | None) -> bool:
    """Allreduce device ``source`` into device ``result`` (may be it) over the group's
    mapped buffers; False (nothing done) when the ranks cannot share device memory.

    ``finishing(values, finish)`` prepares the kernels that divide and scale a reduced
    chunk in place on the default stream; ``encoding`` names the 16-bit format of uint16
    elements (bfloat16 wire buffers).
    """
    count, dtype = _shape(source, encoding)
    if not buffers.ensure(buffer_bytes(count, dtype.itemsize, buffers.group.size)):
        return False
    if count:
        steps = buffers.steps(count, dtype)
        _copy_in(buffers, steps, source)
        _reduce_chunk(steps, op, finish, finishing)
        buffers.group.comm.Barrier()
        _copy_out(buffers, steps, result)
    return True


def hierarchical_allreduce(group: Group, hierarchy: Hierarchy, ordinal: int, source: Any,
                           result: Any, op: ReduceOp, finishing: Finishing, across: Across,
                           encoding: str | None) -> bool:
    """Allreduce device ``source`` into ``result`` over ``group``, whose nodes all hold
    the same number of ranks: reduce each chunk inside the node through CUDA IPC (its
    local index's chunk on every rank), allreduce it among its owners on the other
    nodes with ``across``, then copy every chunk of the node out. False (nothing done)
    when some node's ranks cannot share device memory; all ranks of ``group`` learn it
    together, and keep it."""
    buffers = node_buffers(hierarchy.local, ordinal)
    count, dtype = _shape(source, encoding)
    exchanges = buffers.exchanges
    usable = buffers.ensure(buffer_bytes(count, dtype.itemsize, hierarchy.local.size))
    if buffers.exchanges != exchanges:  # on every node alike: the sizes are the same
        everywhere = group.comm.allreduce(usable, op=MPI.LAND)
        if usable and not everywhere:
            buffers.refuse("the ranks of another node cannot share device memory")
        if not everywhere and group.rank == 0:
            LOGGER.info("hierarchical device allreduce between the ranks %s goes through "
                        "host memory inside the nodes too: CUDA IPC is not usable on "
                        "every node", list(group.world_ranks))
        usable = everywhere
    if not usable:
        return False
    if count:
        steps = buffers.steps(count, dtype)
        _copy_in(buffers, steps, source)
        _reduce_chunk(steps, op, None, finishing)
        across(hierarchy.cross[0], steps.reduced)
        hierarchy.local.comm.Barrier()
        _copy_out(buffers, steps, result)
    return True


def _shape(source: Any, encoding: str | None) -> tuple[int, np.dtype]:
    """The element count and dtype of device ``source`` (uint16 bits of ``encoding``)."""
    dtype = BFLOAT16 if encoding == BFLOAT16_ENCODING else device.dtype_of(source)
    return device.nbytes_of(source) // dtype.itemsize, dtype


def _copy_in(buffers: NodeBuffers, steps: _Steps, source: Any) -> None:
    """Copy ``source`` into this rank's buffer; return once every rank's is there."""
    group = buffers.group
    with phase("copy in", bytes=steps.nbytes, device=True):
        device.copy_bytes(buffers.addresses[group.rank], device.address_of(source),
                          steps.nbytes)
        device.synchronize_default()
        group.comm.Barrier()


def _reduce_chunk(steps: _Steps, op: ReduceOp, finish: Any,
                  finishing: Finishing) -> None:
    """Reduce (and finish, unless ``finish`` is None) this rank's chunk into its room;
    return once it is there."""
    with phase("reduce-scatter", bytes=steps.nbytes, device=True):
        for launch in steps.launches(op, finish, finishing):
            launch()
        device.synchronize_default()


def _copy_out(buffers: NodeBuffers, steps: _Steps, result: Any) -> None:
    """Copy every rank's reduced chunk into ``result``; return once no rank reads this
    rank's buffer any more."""
    group = buffers.group
    with phase("allgather", bytes=steps.nbytes, device=True):
        target = device.address_of(result)
        for chunk in range(group.size):
            start, end = steps.bounds[chunk], steps.bounds[chunk + 1]
            device.copy_bytes(target + start, buffers.addresses[chunk] + steps.room,
                              end - start)
        device.synchronize_default()
        group.comm.Barrier()


def serves_hierarchical(layout: NodeLayout) -> bool:
    """Whether the hierarchical allreduce of device memory on ``layout`` can reduce inside
    the nodes through CUDA IPC, as far as this process can tell alone: every node holds
    the same number of ranks, more than one, and this process can share device memory."""
    return layout.uniform and layout.width > 1 and ipc.unavailable_reason() is None


def unusable_reason(nodes: int) -> str | None:
    """Why the IPC allreduce cannot serve a group spanning ``nodes`` nodes, as far as
    this process can tell alone, or None."""
    if nodes != 1:
        return f"the ranks span {nodes} nodes"
    return ipc.unavailable_reason()
