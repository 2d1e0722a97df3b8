"""Recursive-doubling allreduce: the latency-optimal schedule for small messages.

Schedule, p ranks, p2 the largest power of two <= p, rem = p - p2:

1. Fold (only when p is not a power of two): among the first 2*rem ranks, each even
   rank sends its message to the odd rank after it and sits out; the odd rank combines.
2. Doubling: the p2 remaining ranks, renumbered 0..p2-1, exchange with the partner
   whose new number differs in bit k, k = 0 .. lg(p2)-1, combining after each exchange.
   After step k every rank holds the combination of a block of 2^(k+1) ranks.
3. Unfold: each odd rank of the first 2*rem sends the result back to its even rank.

Cost: lg(p2)*(alpha + n*beta + n*gamma), plus 2*(alpha + n*beta) + n*gamma when p is not
a power of two. Partners combine the same two operands with a commutative operation,
and folded ranks receive a copy, so every rank ends with bit-identical bytes.

The same exchange carries ringtrain's agreement header (see ``_agreement``): a small
allreduce sends header and data in one message per step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..kernels.reduction import Combine
from ._group import Group

TAG = 11


def unfolded_rank(new_rank: int, rem: int) -> int:
    """The group rank of the rank numbered ``new_rank`` after the fold of ``rem`` pairs:
    the odd rank of pair ``new_rank`` when ``new_rank < rem``, else ``new_rank + rem``."""
    return new_rank * 2 + 1 if new_rank < rem else new_rank + rem


def exchange(group: Group, message: np.ndarray, receive: np.ndarray,
             combine: Callable[[np.ndarray], None]) -> None:
    """Allreduce ``message`` (bytes) over the group by recursive doubling, in place.

    Args:
        group: the ranks.
        message: this rank's uint8 message; holds the combined message on return.
        receive: uint8 buffer at least as large as any rank's message (ranks whose
            messages differ in length must still not overflow it).
        combine: ``combine(received)`` folds a partner's message (a view of
            ``receive``, as long as ``message``) into ``message``; it may ignore the
            argument and read ``receive`` through views of its own.
    """
    comm, rank, size = group.comm, group.rank, group.size
    if size == 1:
        return
    n = message.nbytes
    incoming = receive[:n]
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    if rank < 2 * rem and rank % 2 == 0:
        comm.Send(message, rank + 1, TAG)
        comm.Recv(receive, rank + 1, TAG)
        message[:] = incoming
        return
    if rank < 2 * rem:
        comm.Recv(receive, rank - 1, TAG)
        combine(incoming)
        new_rank = rank // 2
    else:
        new_rank = rank - rem
    mask = 1
    while mask < p2:
        partner = unfolded_rank(new_rank ^ mask, rem)
        comm.Sendrecv(message, partner, TAG, receive, partner, TAG)
        combine(incoming)
        mask <<= 1
    if rank < 2 * rem:
        comm.Send(message, rank - 1, TAG)


def allreduce(group: Group, buffer: np.ndarray, combine: Combine, segment_bytes: int) -> None:
    """Allreduce a 1-D array in place, one segment of at most ``segment_bytes`` at a time.

    Temporary memory is one segment, whatever the array's size.
    """
    if group.size == 1 or buffer.size == 0:
        return
    per_segment = max(1, segment_bytes // buffer.itemsize)
    receive = group.scratch.get("rd.segment", min(buffer.size, per_segment) * buffer.itemsize)
    for start in range(0, buffer.size, per_segment):
        piece = buffer[start:start + per_segment]
        piece_bytes = piece.view(np.uint8)

        def fold(received: np.ndarray, piece=piece) -> None:
            combine(piece, received.view(piece.dtype), out=piece)

        exchange(group, piece_bytes, receive, fold)


__all__ = ["exchange", "allreduce", "unfolded_rank"]
