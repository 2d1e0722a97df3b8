"""Hierarchical collectives: shared memory inside each node, one ring per chunk between nodes.

On a layout of N nodes of L ranks each (see ``_topology``), an array of n bytes:

allreduce ``hierarchical``, three steps:

1. intra-node reduce-scatter (ring over the node's L ranks): local index i ends with
   chunk i of the array reduced over its node;
2. inter-node allreduce (ring over the N owners of chunk i, one per node): chunk i
   reduced over all ranks; the ``L`` rings run at once, each on n/L bytes;
3. intra-node allgather (ring): every rank gets every chunk.

Every rank sends 2(N-1)/N * n/L bytes across nodes, so a node's link carries
2(N-1)/N * n in each direction, where a flat ring over all N*L ranks in node order
carries 2(NL-1)/(NL) * n (N = 2, L = 2: n against 1.5n). With compression, step 2
travels in the 16-bit wire format (n/2 across each link at N = 2); steps 1 and 3 stay
in full precision (on a single node nothing is cast at all). Uneven nodes: the array is
cut into ``width`` chunks (the largest node's size); a rank of a smaller node owns
several consecutive chunks and takes part in the inter-node ring of each, one after the
other.

allreduce ``node_leader``, for comparison: the node's sum is reduce-scattered and
gathered on its first rank (the leader), the leaders run one ring allreduce, and each
leader broadcasts the result on its node. Same bytes across nodes, but one rank per
node does all of the inter-node work.

broadcast ``hierarchical``: the root passes the message to its node's leader, the
leaders broadcast it among themselves (pipelined chain or binomial tree), and each
leader broadcasts it on its node: every node receives n bytes once.

allgather ``hierarchical``: each leader gathers its node's rows, the leaders run a ring
allgather of the node blocks, and each leader broadcasts the whole result on its node:
a node's link carries (N-1)/N of the result in each direction, against (p-1)/p of it
for the flat ring.

Each element is reduced on one rank (step 2's ring) and copied to all others, so every
rank ends with bit-identical bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpi4py import MPI
import numpy as np

from ..kernels import Compressor
from ..kernels.reduction import Combine
from . import _broadcast_algorithms, _ring
from ._group import Group
from ._topology import Hierarchy
from ._tracing import phase

Finish = Callable[[np.ndarray], None]

LEADER_TAG = 41


@dataclass(frozen=True)
class Wire:
    """How the inter-node step of a compressed allreduce travels.

    Attributes:
        compressor: encodes float32 into the wire format and back.
        buffer: wire-format scratch of at least this rank's share of the array.
        combine: reduces two wire-format arrays.
        encode_scale: applied before the cast (the compressor's scale).
        decode_scale: applied after it (postscale / (scale * divisor)).
        key: the tensor name (error feedback keeps a residual per name).
    """

    compressor: Compressor
    buffer: np.ndarray
    combine: Combine
    encode_scale: float
    decode_scale: float
    key: str | None


def allreduce(hierarchy: Hierarchy, source: np.ndarray, result: np.ndarray, combine: Combine,
              finish: Finish | None, segment_bytes: int, wire: Wire | None = None) -> None:
    """Hierarchical allreduce of 1-D ``source`` into ``result`` (which may be ``source``).

    Args:
        hierarchy: the layout's communicators.
        combine: reduces two ranks' values in ``source``'s dtype.
        finish: applied once to each reduced element (divide, postscale), or None.
        wire: with compression, how the inter-node step travels (``finish`` is then
            None: the decode applies the scales).
    """
    local = hierarchy.local
    bounds = hierarchy.local_bounds(source.size)
    start, end = bounds[hierarchy.local_index], bounds[hierarchy.local_index + 1]
    own = result[start:end]
    with phase("intra-node reduce-scatter", bytes=source.nbytes):
        if local.size == 1:
            if result is not source:
                result[:] = source
        else:
            _ring.reduce_scatter(local, source, own, bounds, combine, None, segment_bytes)
    chunks = hierarchy.chunk_bounds(source.size)
    with phase("inter-node allreduce", bytes=own.nbytes,
               format=wire.compressor.name if wire else str(source.dtype)):
        data, step_combine = own, combine
        if wire is not None and len(hierarchy.layout.nodes) > 1:
            data, step_combine = wire.buffer[:own.size], wire.combine
            wire.compressor.encode(own, data, wire.encode_scale, key=wire.key)
        for chunk, cross in zip(hierarchy.chunks, hierarchy.cross):
            piece = data[chunks[chunk] - start:chunks[chunk + 1] - start]
            _cross_allreduce(cross, piece, step_combine, finish, segment_bytes)
        _unwire(wire, data, own)
    if local.size > 1:
        with phase("intra-node allgather", bytes=result.nbytes):
            _ring.allgather(local, result, bounds)


def leader_allreduce(hierarchy: Hierarchy, source: np.ndarray, result: np.ndarray,
                     combine: Combine, finish: Finish | None, segment_bytes: int,
                     wire: Wire | None = None) -> None:
    """Node-leader allreduce of 1-D ``source`` into ``result``; arguments as
    :func:`allreduce` (``wire.buffer`` must hold the whole array)."""
    local = hierarchy.local
    with phase("intra-node reduce", bytes=source.nbytes):
        if local.size == 1:
            if result is not source:
                result[:] = source
        else:
            bounds = _ring.chunk_bounds(source.size, local.size)
            own = result[bounds[local.rank]:bounds[local.rank + 1]]
            _ring.reduce_scatter(local, source, own, bounds, combine, None, segment_bytes)
            _gather_to_leader(local, result.view(np.uint8),
                              [b * result.itemsize for b in bounds])
    leaders = hierarchy.leaders
    if leaders is not None:
        with phase("inter-node allreduce", bytes=result.nbytes,
                   format=wire.compressor.name if wire else str(source.dtype)):
            data, step_combine = result, combine
            if wire is not None and leaders.size > 1:
                data, step_combine = wire.buffer[:result.size], wire.combine
                wire.compressor.encode(result, data, wire.encode_scale, key=wire.key)
            _cross_allreduce(leaders, data, step_combine, finish, segment_bytes)
            _unwire(wire, data, result)
    if local.size > 1:
        with phase("intra-node broadcast", bytes=result.nbytes):
            _broadcast_algorithms.pipeline(local, result.view(np.uint8), 0, segment_bytes)


def broadcast(hierarchy: Hierarchy, data: np.ndarray, root: int, inner: str,
              segment_bytes: int) -> None:
    """Broadcast 1-D uint8 ``data`` from group rank ``root``: to its node's leader, among
    the leaders, then on every node; ``inner`` (``pipeline`` or ``binomial``) names the
    schedule of the last two steps."""
    layout, local = hierarchy.layout, hierarchy.local
    root_node = layout.node_of[root]
    root_local = layout.nodes[root_node].index(root)
    if hierarchy.node == root_node and root_local != 0:
        with phase("to node leader", bytes=data.nbytes):
            if hierarchy.local_index == root_local:
                local.comm.Send(data, 0, LEADER_TAG)
            elif hierarchy.local_index == 0:
                local.comm.Recv(data, root_local, LEADER_TAG)
    leaders = hierarchy.leaders
    if leaders is not None and leaders.size > 1:
        with phase("inter-node broadcast", bytes=data.nbytes):
            _schedule(inner, leaders, data, root_node, segment_bytes)
    if local.size > 1:
        with phase("intra-node broadcast", bytes=data.nbytes):
            _schedule(inner, local, data, 0, segment_bytes)


def allgather(group: Group, hierarchy: Hierarchy, data: np.ndarray, bounds: list[int],
              segment_bytes: int) -> None:
    """Fill 1-D uint8 ``data`` (rank r's bytes at ``bounds[r]:bounds[r+1]``, this rank's
    already in place) with every rank's bytes: gathered on the node leaders, exchanged
    between them, broadcast on each node."""
    layout, local = hierarchy.layout, hierarchy.local
    order = [rank for members in layout.nodes for rank in members]
    sizes = [bounds[r + 1] - bounds[r] for r in range(group.size)]
    packed_bounds = [0]
    for rank in order:
        packed_bounds.append(packed_bounds[-1] + sizes[rank])
    position = {rank: i for i, rank in enumerate(order)}
    in_order = order == list(range(group.size))
    packed = data if in_order else np.empty(data.nbytes, np.uint8)
    if not in_order:
        mine = position[group.rank]
        packed[packed_bounds[mine]:packed_bounds[mine + 1]] = \
            data[bounds[group.rank]:bounds[group.rank + 1]]
    node_starts = [packed_bounds[position[members[0]]] for members in layout.nodes]
    node_bounds = node_starts + [packed_bounds[-1]]
    first = position[layout.nodes[hierarchy.node][0]]
    if local.size > 1:
        node_bytes = sum(sizes[r] for r in layout.nodes[hierarchy.node])
        with phase("intra-node gather", bytes=node_bytes):
            block = packed[packed_bounds[first]:packed_bounds[first + local.size]]
            offsets = [b - packed_bounds[first]
                       for b in packed_bounds[first:first + local.size + 1]]
            _gather_to_leader(local, block, offsets)
    leaders = hierarchy.leaders
    if leaders is not None and leaders.size > 1:
        with phase("inter-node allgather", bytes=data.nbytes):
            _ring.allgather(leaders, packed, node_bounds)
    if local.size > 1:
        with phase("intra-node broadcast", bytes=data.nbytes):
            _broadcast_algorithms.pipeline(local, packed, 0, segment_bytes)
    if not in_order:
        for rank in range(group.size):
            at = position[rank]
            data[bounds[rank]:bounds[rank + 1]] = packed[packed_bounds[at]:packed_bounds[at + 1]]


def _unwire(wire: Wire | None, data: np.ndarray, out: np.ndarray) -> None:
    """Decode the inter-node result into ``out``; on one node, where nothing was
    encoded, apply the scales alone."""
    if wire is None:
        return
    if data is out:
        np.multiply(out, wire.encode_scale * wire.decode_scale, out=out)
    else:
        wire.compressor.decode(data, out, wire.decode_scale)


def _cross_allreduce(cross: Group, piece: np.ndarray, combine: Combine,
                     finish: Finish | None, segment_bytes: int) -> None:
    if cross.size > 1 and piece.size > 0:
        _ring.allreduce(cross, piece, piece, combine, finish, segment_bytes)
    elif finish is not None:
        finish(piece)


def _gather_to_leader(local: Group, data: np.ndarray, offsets: list[int]) -> None:
    """Local rank r's bytes ``data[offsets[r]:offsets[r+1]]`` onto local rank 0."""
    if local.rank == 0:
        counts = [offsets[r + 1] - offsets[r] for r in range(local.size)]
        local.comm.Gatherv(MPI.IN_PLACE, [data, counts, offsets[:-1], MPI.BYTE], root=0)
    else:
        local.comm.Gatherv([data[offsets[local.rank]:offsets[local.rank + 1]], MPI.BYTE],
                           None, root=0)


def _schedule(inner: str, group: Group, data: np.ndarray, root: int,
              segment_bytes: int) -> None:
    if inner == "pipeline":
        _broadcast_algorithms.pipeline(group, data, root, segment_bytes)
    else:
        _broadcast_algorithms.binomial(group, data, root)
