"""The communicators that point-to-point messages travel on, one pair per group.

User messages never meet a collective's: every group (ringtrain's world, and each
process set's communicator) gets two duplicates of its communicator when it is built,
collectively over its ranks, for point-to-point calls alone:

- ``messages`` carries each message's header (with its data below
  ``INLINE_MAX_BYTES``), tagged with the caller's tag, so MPI matches them by
  (source, tag) in the order they were sent;
- ``transfers`` carries the receiver's reply to a header and the data of large
  messages, tagged by the sender's sequence number for that destination
  (``2·seq`` replies, ``2·seq + 1`` data), so two messages in flight between the same
  ranks with the same tag can never take each other's reply or data.

Collectives keep the group's own communicator; so the whole tag range (0 to MPI's
``TAG_UB``) is the user's.
"""

from __future__ import annotations

import itertools
from typing import Any

from mpi4py import MPI

from ..base._group import Group


class Channels:
    """A group's point-to-point communicators and send counters.

    Attributes:
        messages: headers (and small messages' data), tagged by the user's tag.
        transfers: replies and large messages' data, tagged by sequence number.
        tag_limit: the largest tag a user may give (MPI's ``TAG_UB``).
        sequences: how many sequence numbers there are.
        world_ranks: the world rank of each group rank (names a receive's sender).
        sent: a count of the messages sent to each group rank; a message's sequence
            number is its place in that count modulo ``sequences`` (``next`` on a count
            is one step under the GIL: threads sending to the same rank at once never
            take the same number).
        compiled: the compiled steps over these communicators, once built
            (:func:`._p2p_compiled.compiled_messages`).
    """

    compiled: Any = None

    def __init__(self, comm: MPI.Comm, world_ranks: tuple[int, ...]):
        self.world_ranks = world_ranks
        self.messages = comm.Dup()
        self.transfers = comm.Dup()
        self.messages.Set_name("ringtrain point-to-point")
        self.transfers.Set_name("ringtrain point-to-point data")
        self.tag_limit = int(comm.Get_attr(MPI.TAG_UB))
        self.sequences = (self.tag_limit - 1) // 2
        self.sent = [itertools.count() for _ in range(comm.Get_size())]

    def next_sequence(self, destination: int) -> int:
        """The sequence number of the next message to ``destination`` (a group rank)."""
        return next(self.sent[destination]) % self.sequences

    def free(self) -> None:
        """Release both communicators (collective over the group)."""
        for comm in (self.messages, self.transfers):
            if comm != MPI.COMM_NULL:
                comm.Free()


def open_channels(group: Group) -> Channels:
    """Build ``group``'s point-to-point communicators (collective over its ranks); they
    are freed with the group."""
    channels = Channels(group.comm, group.world_ranks)
    group.state["point_to_point"] = channels
    group.children.append(channels)
    return channels


def channels_of(group: Group) -> Channels:
    """The point-to-point communicators built with ``group``."""
    return group.state["point_to_point"]  # type: ignore[return-value]
