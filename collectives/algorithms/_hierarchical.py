"""Hierarchical collectives: shared memory inside each node, one ring per chunk between nodes.

On a layout of N nodes of L ranks each (see ``_topology``), an array of n bytes:

allreduce ``hierarchical``, with the array cut into ``width`` chunks (local index i owns
chunk i on full nodes) and each chunk into stripes of a few hundred KiB to a few MiB:

1. copy in: every rank copies its input, all but its own share (which it reads from
   its input), into its slot of a node-wide shared-memory window
   (``MPI.Win.Allocate_shared`` on the node's communicator, kept per node group and
   grown on demand; L input slots and one result array); node barrier;
2. pipelined, stripe by stripe of the chunks it owns, each rank: sums the stripe over
   the node's L slots into the window's result array; (with compression) casts it to
   the wire format; starts the stripe's inter-node ring allreduce among the chunk's
   owners (one per node) with non-blocking sends and receives; and, with up to
   ``PIPELINE_DEPTH`` stripes in flight, advances the oldest one, decoding it into the
   result array and copying it out when it is done. So the node sums and casts of later
   stripes run while earlier stripes are on the wire, and only stripes are cast, each
   while in cache;
3. copy out: node barrier, then every rank copies the other shares of the result out.

Cost per rank: two copies of (L-1)/L * n bytes outside the pipeline, reading n bytes
for the node sums inside it (numpy, no messages inside the node but two barriers), and
2(N-1)/N * n/L bytes sent across nodes, so a node's link
carries 2(N-1)/N * n in each direction, where a flat ring over all N*L ranks in node
order carries 2(NL-1)/(NL) * n (N = 2, L = 2: n against 1.5n). Node memory: (L+1)*n
bytes of shared window. With compression only step 2's ring travels in the 16-bit
wire format (n/2 across each link at N = 2); the node sums stay in full precision (on a
single node nothing is cast at all). With error feedback the whole own share is cast
at once (its residual is kept per tensor and share), so only the transfers pipeline.
Where a node's ranks do not share memory (pretend nodes with ``node_size`` spanning
hosts) steps 1 and 3 fall back to a ring reduce-scatter and a ring allgather over
point-to-point messages; the inter-node schedule is the same. Uneven nodes: the array
is cut into ``width`` chunks (the largest node's size); a rank of a smaller node owns
several consecutive chunks and takes part in the inter-node ring of each, one after the
other.

allreduce ``node_leader``, for comparison: the node's sum is reduce-scattered and
gathered on its first rank (the leader), the leaders run one ring allreduce, and each
leader broadcasts the result on its node. Same bytes across nodes, but one rank per
node does all of the inter-node work.

reducescatter ``hierarchical``, on nodes of equal size L (local index i, the i-th rank
of every node, forming column i): the ranks' blocks are regrouped by column (column i's
blocks side by side, in node order: one copy of n bytes), a ring reduce-scatter inside
each node leaves local index i with its node's sum of column i's blocks, and a ring
reduce-scatter among column i's ranks (one per node) reduces those across the nodes,
each rank keeping its own block. A node's link carries (N-1)/N * n in each direction
(spread over its L ranks), where a flat ring over all N*L ranks in node order carries
(NL-1)/(NL) * n through one rank of each node (N = 2, L = 2: n/2 against 3n/4).
Scratch: n + n/L bytes, kept in the node group.

broadcast ``hierarchical``: the root passes the message to its node's leader, the
leaders broadcast it among themselves (pipelined chain or binomial tree), and each
leader broadcasts it on its node: every node receives n bytes once.

allgather ``hierarchical``: each leader gathers its node's rows, the leaders run a ring
allgather of the node blocks, and each leader broadcasts the whole result on its node:
a node's link carries (N-1)/N of the result in each direction, against (p-1)/p of it
for the flat ring.

Each element is reduced on one rank (the node sum on its owner, then the inter-node
ring) and copied to all others, so every rank ends with bit-identical bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate

from mpi4py import MPI
import numpy as np

from ...kernels import Compressor
from ...kernels.reduction import Combine
from ..base._group import Group
from ..base._tracing import phase
from ..world._topology import Hierarchy
from . import _broadcast_algorithms, _ring
from ._compiled_ring import allreduce_by_ring, reduce_scatter_by_ring

Finish = Callable[[np.ndarray], None]
Stripe = Callable[[int, int], None]
"""Work on the elements ``a:b`` of the array."""
InFlight = tuple[Iterator[list[MPI.Request]], list[MPI.Request], int, int]
"""A stripe on the wire: its remaining ring steps, the current step's requests, a, b."""

LEADER_TAG = 41
CROSS_TAG = 50  # to CROSS_TAG + 2 * PIPELINE_DEPTH - 1

PIPELINE_DEPTH = 3
"""Stripes of the inter-node step in flight at once."""
STRIPES_PER_CHUNK = 8
"""Stripes per chunk, within ``segment_bytes`` and ``STRIPE_MAX_BYTES``."""
STRIPE_MAX_BYTES = 2 << 20
"""Largest stripe (on the wire): a stripe is summed, cast and sent while in cache."""
WINDOW_ALIGN = 64


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
        segment_bytes: the smallest stripe (see :func:`_stripes`).
        wire: with compression, how the inter-node step travels (``finish`` is then
            None: the decode applies the scales).
    """
    local = hierarchy.local
    bounds = hierarchy.local_bounds(source.size)
    start, end = bounds[hierarchy.local_index], bounds[hierarchy.local_index + 1]
    window = _node_window(local, source.nbytes) if local.size > 1 else None
    if window is None:
        target, node_sum, deliver = result, None, None
        with phase("intra-node reduce-scatter", bytes=source.nbytes):
            if local.size == 1:
                if result is not source:
                    result[:] = source
            else:
                reduce_scatter_by_ring(local, source, result[start:end], bounds, combine,
                                       None, segment_bytes)
    else:
        slots, target = window.arrays(source.dtype, source.size)
        with phase("intra-node copy in", bytes=source.nbytes):
            mine = slots[hierarchy.local_index]  # all but this rank's share: it reads
            mine[:start] = source[:start]        # its own from ``source``
            mine[end:] = source[end:]
            window.barrier()
        inputs = [source if i == hierarchy.local_index else slot
                  for i, slot in enumerate(slots)]

        def node_sum(a: int, b: int) -> None:
            _sum_slots(inputs, a, b, target, combine)

        def deliver(a: int, b: int) -> None:
            result[a:b] = target[a:b]

    with phase("inter-node allreduce", bytes=(end - start) * source.itemsize,
               format=wire.compressor.name if wire else str(source.dtype)):
        _cross_pipeline(hierarchy, target, start, end, node_sum, deliver, combine, finish,
                        segment_bytes, wire)
    if window is not None:
        with phase("intra-node copy out",
                   bytes=result.nbytes - (end - start) * result.itemsize):
            window.barrier()
            result[:start] = target[:start]
            result[end:] = target[end:]
    elif local.size > 1:
        with phase("intra-node allgather", bytes=result.nbytes):
            _ring.allgather(local, result, bounds)


def _cross_pipeline(hierarchy: Hierarchy, target: np.ndarray, start: int, end: int,
                    node_sum: Stripe | None, deliver: Stripe | None, combine: Combine,
                    finish: Finish | None, segment_bytes: int, wire: Wire | None) -> None:
    """Step 2 of the hierarchical allreduce on this rank's share ``target[start:end]``.

    Stripe by stripe: ``node_sum(a, b)`` (None: already summed) fills ``target[a:b]``
    with the node's sum, the stripe is encoded (with ``wire``), reduced across nodes by
    a non-blocking ring, decoded into ``target[a:b]`` and handed to ``deliver(a, b)``
    (None: nothing more to do) while still in cache.
    """
    cross_nodes = len(hierarchy.layout.nodes) > 1
    encoded = wire is not None and cross_nodes
    whole = encoded and wire.compressor.error_feedback  # one residual for the whole share
    itemsize = wire.buffer.itemsize if encoded else target.itemsize
    chunks = hierarchy.chunk_bounds(target.size)
    stripes = [(cross, k, a, b) for chunk, cross in zip(hierarchy.chunks, hierarchy.cross)
               for k, (a, b) in enumerate(_stripes(chunks[chunk], chunks[chunk + 1],
                                                   itemsize, segment_bytes))]
    data, step_combine, step_finish = target, combine, finish
    if encoded:
        data, step_combine, step_finish = wire.buffer[:end - start], wire.combine, None
        if whole:
            if node_sum is not None:
                node_sum(start, end)
            wire.compressor.encode(target[start:end], data, wire.encode_scale, key=wire.key)
            node_sum = None
    offset = start if encoded else 0
    longest = max((b - a for _, _, a, b in stripes), default=0)
    per_step = -(-longest // max(1, len(hierarchy.layout.nodes)))
    scratch = hierarchy.local.scratch.get("hierarchical.stripes",
                                          PIPELINE_DEPTH * per_step * itemsize)
    received = scratch[:PIPELINE_DEPTH * per_step * itemsize].view(data.dtype) \
        .reshape(PIPELINE_DEPTH, per_step)

    def begin(slot: int, cross: Group, k: int, a: int, b: int
              ) -> Iterator[list[MPI.Request]]:
        if node_sum is not None:
            node_sum(a, b)
        if encoded and not whole:
            wire.compressor.encode(target[a:b], data[a - offset:b - offset],
                                   wire.encode_scale)
        return _ring_steps(cross, data[a - offset:b - offset], step_combine, step_finish,
                           received[slot], CROSS_TAG + 2 * (k % PIPELINE_DEPTH))

    def done(a: int, b: int) -> None:
        if encoded:
            wire.compressor.decode(data[a - offset:b - offset], target[a:b],
                                   wire.decode_scale)
        elif wire is not None:  # one node: nothing was cast, apply the scales alone
            np.multiply(target[a:b], wire.encode_scale * wire.decode_scale, out=target[a:b])
        if deliver is not None:
            deliver(a, b)

    in_flight: deque[InFlight] = deque()
    for index, (cross, k, a, b) in enumerate(stripes):
        if len(in_flight) == PIPELINE_DEPTH:
            _complete_oldest(in_flight, done)
        steps = begin(index % PIPELINE_DEPTH, cross, k, a, b)
        in_flight.append((steps, next(steps, []), a, b))
    while in_flight:
        _complete_oldest(in_flight, done)


def _complete_oldest(in_flight: deque[InFlight], done: Stripe) -> None:
    """Run the oldest stripe in flight to its end (the younger ones progress meanwhile)."""
    steps, requests, a, b = in_flight.popleft()
    while requests:
        MPI.Request.Waitall(requests)
        requests = next(steps, [])
    done(a, b)


def _ring_steps(cross: Group, data: np.ndarray, combine: Combine, finish: Finish | None,
                received: np.ndarray, tag: int) -> Iterator[list[MPI.Request]]:
    """Ring allreduce of ``data`` in place over ``cross``, as non-blocking steps: yields
    each step's requests, to be completed before the next step is asked for."""
    comm, rank, size = cross.comm, cross.rank, cross.size
    if size == 1 or data.size == 0:
        if finish is not None:
            finish(data)
        return
    bounds = _ring.chunk_bounds(data.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    part = [data[bounds[c]:bounds[c + 1]] for c in range(size)]
    for step in range(size - 1):  # reduce-scatter: part[rank] ends reduced over all
        sent, got = part[(rank - step - 1) % size], part[(rank - step - 2) % size]
        incoming = received[:got.size]
        yield [comm.Irecv(incoming, left, tag), comm.Isend(sent, right, tag)]
        combine(got, incoming, out=got)
    if finish is not None:
        finish(part[rank])
    for step in range(size - 1):  # allgather
        sent, got = part[(rank - step) % size], part[(rank - step - 1) % size]
        yield [comm.Irecv(got, left, tag + 1), comm.Isend(sent, right, tag + 1)]


def _stripes(a: int, b: int, itemsize: int, segment_bytes: int) -> list[tuple[int, int]]:
    """Cut ``a:b`` into near-equal stripes of about a ``STRIPES_PER_CHUNK``-th of it,
    kept between ``segment_bytes`` and ``STRIPE_MAX_BYTES`` (the same on every node: it
    depends on the chunk alone)."""
    count = b - a
    stripe_bytes = min(max(count * itemsize // STRIPES_PER_CHUNK, segment_bytes),
                       STRIPE_MAX_BYTES)
    parts = max(1, -(-count * itemsize // stripe_bytes))
    cuts = _ring.chunk_bounds(count, parts)
    return [(a + cuts[i], a + cuts[i + 1]) for i in range(parts)]


def _sum_slots(slots: list[np.ndarray], a: int, b: int, out: np.ndarray,
               combine: Combine) -> None:
    """``out[a:b]`` = the node's ranks' values, combined in local-index order."""
    target = out[a:b]
    combine(slots[0][a:b], slots[1][a:b], out=target)
    for slot in slots[2:]:
        combine(target, slot[a:b], out=target)


class NodeWindow:
    """A node's shared memory for the hierarchical allreduce: one input slot per local
    rank and one result array, each of ``capacity`` bytes, in one window allocated on
    the node's communicator. Kept in the node group and freed with it."""

    def __init__(self, local: Group, capacity: int):
        self.comm, self.ranks, self.capacity = local.comm, local.size, capacity
        total = (local.size + 1) * capacity
        self.win = MPI.Win.Allocate_shared(total if local.rank == 0 else 0, 1,
                                           comm=local.comm)
        memory, _ = self.win.Shared_query(0)
        self.memory = np.frombuffer(memory, np.uint8, total)
        self.win.Lock_all(MPI.MODE_NOCHECK)

    def arrays(self, dtype: np.dtype, count: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The ranks' input slots and the result array, as ``count`` elements of ``dtype``."""
        nbytes = count * dtype.itemsize
        views = [self.memory[i * self.capacity:i * self.capacity + nbytes].view(dtype)
                 for i in range(self.ranks + 1)]
        return views[:-1], views[-1]

    def barrier(self) -> None:
        """Make every rank's writes to the window visible to all, and wait for them."""
        self.win.Sync()
        self.comm.Barrier()
        self.win.Sync()

    def free(self) -> None:
        """Release the window (collective over the node)."""
        self.win.Unlock_all()
        self.win.Free()


def _node_window(local: Group, nbytes: int) -> NodeWindow | None:
    """The node's shared window, grown to ``nbytes`` per slot; None where the node's
    ranks do not share memory (collective over the node on first use and on growth)."""
    shared = local.state.get("hierarchical.shared")
    if shared is None:
        node = local.comm.Split_type(MPI.COMM_TYPE_SHARED)
        shared = local.state["hierarchical.shared"] = node.Get_size() == local.size
        node.Free()
    if not shared:
        return None
    window = local.state.get("hierarchical.window")
    if window is None or window.capacity < nbytes:
        if window is not None:
            local.children.remove(window)
            window.free()
        window = NodeWindow(local, -(-nbytes // WINDOW_ALIGN) * WINDOW_ALIGN)
        local.state["hierarchical.window"] = window
        local.children.append(window)  # freed with the node group, before its communicator
    return window


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
            reduce_scatter_by_ring(local, source, own, bounds, combine, None, segment_bytes)
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


def reduce_scatter(hierarchy: Hierarchy, source: np.ndarray, own: np.ndarray,
                   bounds: list[int], combine: Combine, finish: Finish | None,
                   segment_bytes: int, wire: Wire | None = None) -> None:
    """Write into ``own`` the reduction over all ranks of this rank's block of 1-D
    ``source`` (group rank r's block: ``bounds[r]:bounds[r+1]``), inside each node,
    then between the nodes, column by column (see the module's note; nodes of equal
    size only).

    Args:
        hierarchy: the layout's communicators (a uniform layout).
        combine: reduces two ranks' values (of ``source``'s dtype).
        finish: applied once to each reduced element of ``own``, or None.
        segment_bytes: largest message of the rings.
        wire: with compression, how the step between the nodes travels (``finish`` is
            then None: the decode applies the scales; ``wire.buffer`` holds at least
            ``source.size`` elements); the sums inside the nodes stay in ``source``'s
            dtype, and on one node nothing is cast.
    """
    layout, local = hierarchy.layout, hierarchy.local
    columns = [[members[i] for members in layout.nodes] for i in range(local.size)]
    sizes = [bounds[r + 1] - bounds[r] for r in range(len(bounds) - 1)]
    column_bounds = [0, *accumulate(sum(sizes[r] for r in column) for column in columns)]
    mine = columns[hierarchy.local_index]
    order = [rank for column in columns for rank in column]
    packed = source
    if order != sorted(order):
        packed = local.scratch.get("hierarchical.columns", source.nbytes)[:source.nbytes] \
            .view(source.dtype)
        with phase("regroup by column", bytes=source.nbytes):
            at = 0
            for rank in order:
                packed[at:at + sizes[rank]] = source[bounds[rank]:bounds[rank + 1]]
                at += sizes[rank]
    start, end = column_bounds[hierarchy.local_index], column_bounds[hierarchy.local_index + 1]
    node_sum = packed[start:end]
    if local.size > 1:
        node_sum = local.scratch.get("hierarchical.column sum", node_sum.nbytes)[
            :node_sum.nbytes].view(source.dtype)
        with phase("intra-node reduce-scatter", bytes=source.nbytes):
            reduce_scatter_by_ring(local, packed, node_sum, column_bounds, combine, None,
                                   segment_bytes)
    cross = hierarchy.cross[0]
    cross_bounds = [0, *accumulate(sizes[rank] for rank in mine)]
    with phase("inter-node reduce-scatter", bytes=node_sum.nbytes,
               format=wire.compressor.name if wire else str(source.dtype)):
        if cross.size == 1:
            own[:] = node_sum
            if finish is not None:
                finish(own)
            _unwire(wire, own, own)
        elif wire is None:
            reduce_scatter_by_ring(cross, node_sum, own, cross_bounds, combine, finish,
                                   segment_bytes)
        else:
            encoded = wire.buffer[:node_sum.size]
            wire.compressor.encode(node_sum, encoded, wire.encode_scale, key=wire.key)
            reduced = encoded[cross_bounds[cross.rank]:cross_bounds[cross.rank + 1]]
            reduce_scatter_by_ring(cross, encoded, reduced, cross_bounds, wire.combine, None,
                                   segment_bytes)
            _unwire(wire, reduced, own)


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
        allreduce_by_ring(cross, piece, piece, combine, finish, segment_bytes)
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
