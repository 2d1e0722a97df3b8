"""Ring reduce-scatter and ring allgather; together, the ring allreduce.

The array is cut into p chunks, chunk c spanning ``bounds[c]:bounds[c+1]``; chunk sizes
differ by at most one element, the first chunks taking the remainder (the
``numpy.array_split`` convention). Ranks form a ring r -> r+1 (mod p).

Reduce-scatter, p-1 steps; at step s rank r sends chunk (r-s-1) and receives chunk
(r-s-2), which it reduces into its own copy. Example p = 4, chunk sent by each rank:

    step   rank0  rank1  rank2  rank3
     0       3      0      1      2
     1       2      3      0      1
     2       1      2      3      0        -> rank r now holds chunk r fully reduced

Allgather, p-1 steps; at step s rank r sends chunk (r-s) and receives chunk (r-s-1).

Each chunk moves in segments of at most ``segment_bytes``: a segment is received into
one scratch buffer and reduced straight into its destination while still in cache, so
temporary memory is one segment and the speed holds when arrays outgrow the cache.
Out of place, step 0 sends from the input and every reduction reads the input and
writes the output, so no separate copy pass is made.

Cost of the allreduce: 2(p-1)*alpha + 2(p-1)/p*n*beta + (p-1)/p*n*gamma, plus alpha per
extra segment. Every rank sends and receives 2(p-1)/p*n bytes, the minimum possible.
Each element is reduced on exactly one rank and copied to the others, so the result
is bit-identical everywhere.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._group import Group

REDUCE_SCATTER_TAG = 21
ALLGATHER_TAG = 22


def chunk_bounds(count: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal chunks of ``count``, the first chunks one larger."""
    base, extra = divmod(count, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def reduce_scatter(group: Group, source: np.ndarray, result: np.ndarray, bounds: list[int],
                   ufunc: np.ufunc, finish: Callable[[np.ndarray], None] | None,
                   segment_bytes: int) -> None:
    """Leave in ``result[bounds[r]:bounds[r+1]]`` the reduction of chunk r over all ranks.

    Args:
        group: the ranks.
        source: this rank's 1-D input; may be ``result`` itself.
        result: 1-D output of the same length and dtype; other chunks hold partial sums.
        bounds: p+1 chunk offsets, in elements.
        ufunc: combines two ranks' values.
        finish: applied in place to each finished segment of this rank's chunk while it
            is in cache (the averaging division, a scale), or None.
        segment_bytes: largest message.
    """
    comm, rank, size = group.comm, group.rank, group.size
    right, left = (rank + 1) % size, (rank - 1) % size
    per_segment = max(1, segment_bytes // source.itemsize)
    longest = max(bounds[c + 1] - bounds[c] for c in range(size))
    received = group.scratch.get("ring.segment", min(longest, per_segment) * source.itemsize)
    received = received[:min(longest, per_segment) * source.itemsize].view(source.dtype)
    for step in range(size - 1):
        sent_chunk = (rank - step - 1) % size
        recv_chunk = (rank - step - 2) % size
        send_from = source if step == 0 else result
        last = step == size - 2
        send_start, send_end = bounds[sent_chunk], bounds[sent_chunk + 1]
        recv_start, recv_end = bounds[recv_chunk], bounds[recv_chunk + 1]
        send_pieces = -(-(send_end - send_start) // per_segment)
        recv_pieces = -(-(recv_end - recv_start) // per_segment)
        for piece in range(max(send_pieces, recv_pieces)):
            a = send_start + piece * per_segment
            b = recv_start + piece * per_segment
            b_end = min(b + per_segment, recv_end)
            incoming = received[:b_end - b]
            if piece < send_pieces and piece < recv_pieces:
                comm.Sendrecv(send_from[a:min(a + per_segment, send_end)], right,
                              REDUCE_SCATTER_TAG, incoming, left, REDUCE_SCATTER_TAG)
            elif piece < send_pieces:
                comm.Send(send_from[a:min(a + per_segment, send_end)], right, REDUCE_SCATTER_TAG)
                continue
            else:
                comm.Recv(incoming, left, REDUCE_SCATTER_TAG)
            target = result[b:b_end]
            ufunc(source[b:b_end], incoming, out=target)
            if last and finish is not None:
                finish(target)


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


def allreduce(group: Group, source: np.ndarray, result: np.ndarray, ufunc: np.ufunc,
              finish: Callable[[np.ndarray], None] | None, segment_bytes: int) -> None:
    """Ring allreduce of 1-D ``source`` into ``result`` (which may be ``source``)."""
    bounds = chunk_bounds(source.size, group.size)
    reduce_scatter(group, source, result, bounds, ufunc, finish, segment_bytes)
    allgather(group, result, bounds)
