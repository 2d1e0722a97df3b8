"""Ring reduce-scatter and ring allgather; together, the ring allreduce.

The array is cut into p chunks, chunk c spanning ``bounds[c]:bounds[c+1]``; chunk sizes
differ by at most one element, the first chunks taking the remainder (the
``numpy.array_split`` convention). Ranks form a ring r -> r+1 (mod p).

Reduce-scatter, p-1 steps; at step s rank r sends chunk (r-s-1) and receives chunk
(r-s-2), which it adds to its own values of that chunk and sends on at the next step.
Example p = 4, chunk sent by each rank:

    step   rank0  rank1  rank2  rank3
     0       3      0      1      2
     1       2      3      0      1
     2       1      2      3      0        -> rank r now holds chunk r fully reduced

Allgather, p-1 steps; at step s rank r sends chunk (r-s) and receives chunk (r-s-1).

Each chunk moves in segments of at most ``segment_bytes``, and the reduce-scatter runs
segment by segment (all p-1 steps of segment k, then segment k+1): a received segment
is reduced into a scratch segment and sent on at the next step while still in cache,
so temporary memory is two segments and the speed holds when arrays outgrow the cache.
Only the finished chunk is written to the output, then the allgather fills the rest:
out of place, no separate copy pass is made.

Cost of the allreduce: 2(p-1)*alpha + 2(p-1)/p*n*beta + (p-1)/p*n*gamma, plus alpha per
extra segment. Every rank sends and receives 2(p-1)/p*n bytes, the minimum possible.
Each element is reduced on exactly one rank and copied to the others, so the result
is bit-identical everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...kernels.reduction import Combine
from ..base._group import Group
from ..base._tracing import phase

REDUCE_SCATTER_TAG = 21
ALLGATHER_TAG = 22


def chunk_bounds(count: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal chunks of ``count``, the first chunks one larger."""
    base, extra = divmod(count, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def reduce_scatter(group: Group, source: np.ndarray, own: np.ndarray, bounds: list[int],
                   combine: Combine, finish: Callable[[np.ndarray], None] | None,
                   segment_bytes: int) -> None:
    """Write into ``own`` the reduction over all ranks of this rank's chunk of ``source``.

    Runs segment by segment: for segment k, all p-1 steps, then segment k+1. A partial
    sum is sent on at the next step straight from the scratch segment it was reduced
    into, so scratch is two segments, and only ``own`` is written.

    Args:
        group: the ranks.
        source: this rank's 1-D input (not modified unless ``own`` is a view of it).
        own: destination for chunk r (r = this rank): ``bounds[r+1] - bounds[r]`` elements.
        bounds: p+1 chunk offsets, in elements.
        combine: combines two ranks' values.
        finish: applied in place to each finished segment of ``own`` while it is in
            cache (the averaging division, a scale), or None.
        segment_bytes: largest message.
    """
    comm, rank, size = group.comm, group.rank, group.size
    right, left = (rank + 1) % size, (rank - 1) % size
    longest = max(bounds[c + 1] - bounds[c] for c in range(size))
    per_segment = max(1, min(longest, segment_bytes // source.itemsize))
    scratch = group.scratch.get("ring.segments", 2 * per_segment * source.itemsize)
    scratch = scratch[:2 * per_segment * source.itemsize].view(source.dtype)
    received, partial = scratch[:per_segment], scratch[per_segment:]
    for piece in range(-(-longest // per_segment)):
        outgoing = source
        for step in range(size - 1):
            sent_chunk = (rank - step - 1) % size
            recv_chunk = (rank - step - 2) % size
            a = bounds[sent_chunk] + piece * per_segment
            a_end = min(a + per_segment, bounds[sent_chunk + 1])
            b = bounds[recv_chunk] + piece * per_segment
            b_end = min(b + per_segment, bounds[recv_chunk + 1])
            send = source[a:a_end] if step == 0 else outgoing[:a_end - a]
            incoming = received[:b_end - b]
            if a < a_end and b < b_end:
                comm.Sendrecv(send, right, REDUCE_SCATTER_TAG, incoming, left,
                              REDUCE_SCATTER_TAG)
            elif a < a_end:
                comm.Send(send, right, REDUCE_SCATTER_TAG)
            elif b < b_end:
                comm.Recv(incoming, left, REDUCE_SCATTER_TAG)
            if b >= b_end:
                continue
            if step < size - 2:
                outgoing = partial[:b_end - b]
            else:  # the last step receives this rank's own chunk
                outgoing = own[b - bounds[rank]:b_end - bounds[rank]]
            combine(source[b:b_end], incoming, out=outgoing)
            if step == size - 2 and finish is not None:
                finish(outgoing)


def allgather(group: Group, buffer: np.ndarray, bounds: list[int]) -> None:
    """Fill every chunk of ``buffer`` from the rank that owns it (chunk r on rank r).

    Args:
        group: the ranks.
        buffer: 1-D array; on entry this rank's chunk is filled.
        bounds: p+1 chunk offsets, in elements; chunks may have any sizes.
    """
    comm, rank, size = group.comm, group.rank, group.size
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        sent_chunk = (rank - step) % size
        recv_chunk = (rank - step - 1) % size
        comm.Sendrecv(buffer[bounds[sent_chunk]:bounds[sent_chunk + 1]], right, ALLGATHER_TAG,
                      buffer[bounds[recv_chunk]:bounds[recv_chunk + 1]], left, ALLGATHER_TAG)


def allreduce(group: Group, source: np.ndarray, result: np.ndarray, combine: Combine,
              finish: Callable[[np.ndarray], None] | None, segment_bytes: int) -> None:
    """Ring allreduce of 1-D ``source`` into ``result`` (which may be ``source``)."""
    bounds = chunk_bounds(source.size, group.size)
    own = result[bounds[group.rank]:bounds[group.rank + 1]]
    with phase("reduce-scatter", bytes=source.nbytes):
        reduce_scatter(group, source, own, bounds, combine, finish, segment_bytes)
    with phase("allgather", bytes=result.nbytes):
        allgather(group, result, bounds)
