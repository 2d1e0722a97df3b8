"""Recursive-doubling allreduce: the latency-optimal schedule for small messages.

Schedule, p ranks, p2 the largest power of two <= p, rem = p - p2:

1. Fold (only when p is not a power of two): among the first 2*rem ranks, each even
   rank sends its message to the odd rank after it and sits out; the odd rank combines.
2. Doubling: the p2 remaining ranks, renumbered 0..p2-1, exchange with the partner
   whose new number differs in bit k, k = 0 .. lg(p2)-1, combining after each exchange.
   After step k every rank holds the combination of a block of 2^(k+1) ranks.
3. Unfold: each odd rank of the first 2*rem sends the result back to its even rank.

Cost: lg(p2)*(alpha + n*beta + n*gamma), plus 2*(alpha + n*beta) + n*gamma when p is not
a power of two. Partners combine the same two operands in the same order, the lower
ranks' first, and folded ranks receive a copy, so every rank ends with bit-identical
bytes, even where an operation's bits depend on its operands' order (a 16-bit minimum
or maximum of +0 and -0 returns its first operand).

The same exchange carries ringtrain's agreement header (see ``_agreement``): a small
allreduce sends header and data in one message per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...kernels.reduction import Combine
from ..base._group import Group

TAG = 11


def unfolded_rank(new_rank: int, rem: int) -> int:
    """The group rank of the rank numbered ``new_rank`` after the fold of ``rem`` pairs:
    the odd rank of pair ``new_rank`` when ``new_rank < rem``, else ``new_rank + rem``."""
    return new_rank * 2 + 1 if new_rank < rem else new_rank + rem


class Schedule:
    """One rank's part in the schedule above, worked out once per group.

    Attributes:
        folded_into: the odd rank this rank hands its message to and sits out (then
            ``partners`` is empty), or None.
        folded_from: the even rank whose message this rank combines first, or None.
        partners: the ranks this rank exchanges with, one per doubling step.
    """

    __slots__ = ("folded_into", "folded_from", "partners")

    def __init__(self, rank: int, size: int):
        p2 = 1 << (size.bit_length() - 1)
        rem = size - p2
        self.folded_into = rank + 1 if rank < 2 * rem and rank % 2 == 0 else None
        self.folded_from = rank - 1 if rank < 2 * rem and rank % 2 == 1 else None
        self.partners: tuple[int, ...] = ()
        if self.folded_into is not None:
            return
        new_rank = rank // 2 if rank < 2 * rem else rank - rem
        partners = []
        mask = 1
        while mask < p2:
            partner_new = new_rank ^ mask
            partners.append(unfolded_rank(partner_new, rem))
            mask <<= 1
        self.partners = tuple(partners)


def schedule_of(group: Group) -> Schedule:
    """This rank's :class:`Schedule` in ``group`` (kept with the group)."""
    schedule = group.state.get("recursive doubling")
    if schedule is None:
        schedule = group.state["recursive doubling"] = Schedule(group.rank, group.size)
    return schedule


def exchange(group: Group, message: np.ndarray, receive: np.ndarray,
             combine: Callable[[np.ndarray, bool], None], comm: Any = None) -> None:
    """Allreduce ``message`` (bytes) over the group by recursive doubling, in place.

    Args:
        group: the ranks.
        message: this rank's uint8 message; holds the combined message on return.
        receive: uint8 buffer at least as large as any rank's message (ranks whose
            messages differ in length must still not overflow it).
        combine: ``combine(received, theirs_first)`` folds a partner's message (a view
            of ``receive``, as long as ``message``) into ``message``, the partner's
            values first where ``theirs_first`` (they come from lower ranks); it may
            ignore the arguments and read ``receive`` through views of its own.
        comm: what the messages travel on: anything with mpi4py's ``Send``, ``Recv``
            and ``Sendrecv`` over the group's ranks (default: the group's
            communicator).
    """
    if group.size == 1:
        return
    comm = group.comm if comm is None else comm
    schedule = schedule_of(group)
    if schedule.folded_into is not None:
        comm.Send(message, schedule.folded_into, TAG)
        comm.Recv(receive, schedule.folded_into, TAG)
        message[:] = receive[:message.nbytes]
        return
    incoming = receive[:message.nbytes]
    if schedule.folded_from is not None:
        comm.Recv(receive, schedule.folded_from, TAG)
        combine(incoming, True)
    for partner in schedule.partners:
        comm.Sendrecv(message, partner, TAG, receive, partner, TAG)
        combine(incoming, partner < group.rank)
    if schedule.folded_from is not None:
        comm.Send(message, schedule.folded_from, TAG)


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

        def fold(received: np.ndarray, theirs_first: bool, piece=piece) -> None:
            theirs = received.view(piece.dtype)
            if theirs_first:
                combine(theirs, piece, out=piece)
            else:
                combine(piece, theirs, out=piece)

        exchange(group, piece_bytes, receive, fold)


__all__ = ["exchange", "allreduce", "schedule_of", "unfolded_rank"]
