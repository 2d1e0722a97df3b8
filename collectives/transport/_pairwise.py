"""Pairwise-exchange alltoall and allgather.

Step s = 1 .. p-1: rank r sends its block for rank (r+s) and receives the block from
rank (r-s), so every rank sends and receives exactly once per step and no link is
shared within a step. Cost: (p-1)*alpha + (p-1)/p*n*beta for n bytes sent per rank.
Blocks go straight from the input to the output; no temporary memory. An allgather is
the same exchange with this rank's rows as its block for every rank.

Where the group's ranks share the node's mailboxes (:mod:`._mailboxes`) the blocks pass
through them, in messages of at most a mailbox each, the sends and receives of a step
taking turns (so a block of any size moves while its receiver drains the mailboxes), in
one compiled call; elsewhere through ``MPI_Sendrecv``.
"""

from __future__ import annotations

import numba
import numpy as np

from ..base._group import Group
from ._c_calls import copy_bytes
from ._mailboxes import (mailbox_arrival, mailbox_claim, mailbox_consume, mailbox_data,
                         mailbox_length, mailbox_publish, mailbox_ranks, mailbox_room, mailboxes_of)

TAG = 41


def alltoall(group: Group, send: np.ndarray, send_offsets: list[int], receive: np.ndarray,
             receive_offsets: list[int]) -> None:
    """Send ``send[send_offsets[j]:send_offsets[j+1]]`` to rank j, for every j.

    Args:
        group: the ranks.
        send, receive: 1-D uint8 buffers.
        send_offsets, receive_offsets: p+1 byte offsets of the blocks per rank.
    """
    _pairwise(group, send, send_offsets, False, receive, receive_offsets)


def allgather(group: Group, send: np.ndarray, receive: np.ndarray,
              receive_offsets: list[int]) -> None:
    """Send all of ``send`` to every rank; receive rank j's into
    ``receive[receive_offsets[j]:receive_offsets[j+1]]``, this rank's own included.

    Args:
        group: the ranks.
        send, receive: 1-D uint8 buffers.
        receive_offsets: p+1 byte offsets of the ranks' rows.
    """
    _pairwise(group, send, receive_offsets, True, receive, receive_offsets)


def _pairwise(group: Group, send: np.ndarray, send_offsets: list[int], whole: bool,
              receive: np.ndarray, receive_offsets: list[int]) -> None:
    """The exchange of :func:`through_mailboxes`, through ``MPI_Sendrecv`` where the
    group has no mailboxes."""
    mailboxes = mailboxes_of(group)
    if mailboxes is not None:
        through_mailboxes(mailboxes.boxes, mailboxes.counters, mailboxes.yield_address,
                          send, np.array(send_offsets, np.int64), whole, receive,
                          np.array(receive_offsets, np.int64))
        return
    comm, rank, size = group.comm, group.rank, group.size
    for step in range(size):
        to, source = (rank + step) % size, (rank - step) % size
        block = send if whole else send[send_offsets[to]:send_offsets[to + 1]]
        target = receive[receive_offsets[source]:receive_offsets[source + 1]]
        if step == 0:
            target[...] = block
        else:
            comm.Sendrecv(block, to, TAG, target, source, TAG)


@numba.njit(cache=True, nogil=True)
def through_mailboxes(boxes, counters, yield_address: int, send, send_offsets,
                      whole: bool, receive, receive_offsets) -> None:
    """The pairwise exchange through a group's mailboxes (``boxes``, ``counters`` and
    ``yield_address`` as :class:`._mailboxes.Mailboxes` has them), the offsets as int64
    arrays: to rank j ``send``'s block j (between ``send_offsets[j]`` and
    ``send_offsets[j+1]``; all of ``send`` where ``whole``, an allgather), from rank j
    into ``receive`` between ``receive_offsets[j]`` and ``receive_offsets[j+1]``.
    Blocks go a mailbox at a time, the sends and receives of a step taking turns; every
    pair of ranks exchanges at least one message (empty for an empty block), so both
    count the same messages."""
    rank, size = mailbox_ranks(counters)
    room = mailbox_room(boxes, counters)
    for step in range(size):
        to, source = (rank + step) % size, (rank - step) % size
        sent, send_end = (0, send.size) if whole else (send_offsets[to], send_offsets[to + 1])
        received, receive_end = receive_offsets[source], receive_offsets[source + 1]
        if step == 0:
            copy_bytes(receive.ctypes.data + received, send.ctypes.data + sent,
                       send_end - sent)
            continue
        sending = receiving = True
        while sending or receiving:
            if sending:
                length = min(room, send_end - sent)
                base = mailbox_claim(boxes, counters, length, yield_address)
                copy_bytes(mailbox_data(boxes, base), send.ctypes.data + sent, length)
                mailbox_publish(boxes, counters, base, to, length)
                sent += length
                sending = sent < send_end
            if receiving:
                base = mailbox_arrival(boxes, counters, source, yield_address)
                length = mailbox_length(boxes, base)
                copy_bytes(receive.ctypes.data + received, mailbox_data(boxes, base),
                           min(length, receive_end - received))
                mailbox_consume(boxes, counters, source, base)
                received += length
                receiving = length > 0 and received < receive_end
