"""Shared-memory mailboxes: the agreement's messages between the ranks of one node.

When every rank of a group runs on one node, the agreement's recursive-doubling exchange
(and the small collectives riding in it) passes its messages through memory the ranks
share instead of through MPI: a message costs a copy and a cache line's trip between
cores, a fraction of what ``MPI_Sendrecv`` costs.

One window (``MPI.Win.Allocate_shared`` on the group's communicator) holds two mailboxes
per rank, each a line of control words followed by room for the largest message. A
mailbox's data, length and tag are written by its owner alone, its ``consumed`` word by
the reader alone:

- the sender takes its mailboxes in turn, waits until the message it last left in the
  one it takes was consumed, writes data and length, then publishes the tag (release);
- the tag is ``destination << 40 | n``, the n-th message from this sender to that
  destination: the receiver knows both, finds the message in either of the sender's
  mailboxes (acquire), copies it out and marks it consumed (release).

A send thus waits only for the message sent two messages before to be read, which never
depends on the send: no order of sends and receives can deadlock. Waiting spins a while,
then yields the core between looks (ranks that share cores still make progress), with
the GIL released.

The ranks use mailboxes all or none (decided collectively when the group is built):
not where the group spans nodes, ``RINGTRAIN_AGREEMENT_SHARED_MEMORY=0`` on any rank,
or compiled calls are off (``RINGTRAIN_COMPILED_EXCHANGE=0``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numba
import numpy as np
from mpi4py import MPI
from numba import types
from numba.extending import intrinsic

from ...common.environment import AGREEMENT_SHARED_MEMORY
from ..base._group import Group
from ._c_calls import call_c, copy_bytes, mpi_functions

MESSAGE_BYTES = 128 * 1024 + 64
"""Room in each mailbox: the agreement's largest message (its header and a payload of up
to :data:`..agreement._call.PAYLOAD_CAPACITY`)."""
_TAG, _CONSUMED, _LENGTH = 0, 1, 2
_CONTROL_WORDS = 8
"""A cache line of control words heads each mailbox."""
_DESTINATION_SHIFT = 40
_SPINS = 64
"""Looks at a mailbox before each yield of the core."""

# Words of the counters array: this rank, the group's size, the mailbox to take next,
# then the messages sent to each rank and those received from each rank.
_RANK, _SIZE, _NEXT, _COUNTS = 0, 1, 2, 3


@intrinsic
def _load_acquire(typingctx: Any, array: Any, index: Any) -> Any:
    """``array[index]`` (int64) read with acquire ordering."""
    if not isinstance(array, types.Array) or array.dtype != types.int64:
        return None

    def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, values[0]).data
        return builder.load_atomic(builder.gep(data, [values[1]]), "acquire", 8)

    return types.int64(array, index), codegen


@intrinsic
def _store_release(typingctx: Any, array: Any, index: Any, value: Any) -> Any:
    """``array[index] = value`` (int64) written with release ordering."""
    if not isinstance(array, types.Array) or array.dtype != types.int64:
        return None

    def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, values[0]).data
        stored = context.cast(builder, values[2], signature.args[2], types.int64)
        builder.store_atomic(stored, builder.gep(data, [values[1]]), "release", 8)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@numba.njit(cache=True, nogil=True)
def mailbox_ranks(counters) -> tuple[int, int]:
    """This rank and the group's size, as ``counters`` hold them."""
    return counters[_RANK], counters[_SIZE]


@numba.njit(cache=True, nogil=True)
def mailbox_room(boxes, counters) -> int:
    """The bytes a mailbox holds: the longest message."""
    return (boxes.size // (2 * counters[_SIZE]) - _CONTROL_WORDS) * 8


@numba.njit(cache=True, nogil=True)
def mailbox_claim(boxes, counters, length: int, yield_address: int) -> int:
    """Take this rank's next mailbox for a message of ``length`` bytes, once the message
    last left in it was consumed; return the mailbox's first word (see
    :func:`mailbox_data`, :func:`mailbox_publish`)."""
    if length > mailbox_room(boxes, counters):
        raise ValueError("a message larger than the mailboxes")
    slot_words = boxes.size // (2 * counters[_SIZE])
    mailbox = counters[_NEXT]
    counters[_NEXT] = 1 - mailbox
    base = (counters[_RANK] * 2 + mailbox) * slot_words
    previous = boxes[base + _TAG]
    spins = 0
    while _load_acquire(boxes, base + _CONSUMED) != previous:
        spins += 1
        if spins >= _SPINS:
            call_c(yield_address, ())
    return base


@numba.njit(cache=True, nogil=True)
def mailbox_data(boxes, base: int) -> int:
    """The address of the data of the mailbox starting at word ``base``."""
    return boxes.ctypes.data + 8 * (base + _CONTROL_WORDS)


@numba.njit(cache=True, nogil=True)
def mailbox_publish(boxes, counters, base: int, destination: int, length: int) -> None:
    """Hand the ``length`` bytes written into the claimed mailbox at ``base`` to group
    rank ``destination``."""
    sent = counters[_COUNTS + destination] + 1
    counters[_COUNTS + destination] = sent
    boxes[base + _LENGTH] = length
    _store_release(boxes, base + _TAG, (destination << _DESTINATION_SHIFT) | sent)


@numba.njit(cache=True, nogil=True)
def mailbox_send(boxes, counters, destination: int, message, length: int,
                 yield_address: int) -> None:
    """Leave ``message[:length]`` (uint8) for group rank ``destination``."""
    base = mailbox_claim(boxes, counters, length, yield_address)
    copy_bytes(mailbox_data(boxes, base), message.ctypes.data, length)
    mailbox_publish(boxes, counters, base, destination, length)


@numba.njit(cache=True, nogil=True)
def mailbox_arrival(boxes, counters, source: int, yield_address: int) -> int:
    """Wait for the next message from group rank ``source``; return the first word of
    the mailbox holding it (its length: :func:`mailbox_length`), to be read and then
    handed back by :func:`mailbox_consume`."""
    size = counters[_SIZE]
    slot_words = boxes.size // (2 * size)
    expected = (counters[_RANK] << _DESTINATION_SHIFT) | \
        (counters[_COUNTS + size + source] + 1)
    base = source * 2 * slot_words
    spins = 0
    while True:
        if _load_acquire(boxes, base + _TAG) == expected:
            return base
        if _load_acquire(boxes, base + slot_words + _TAG) == expected:
            return base + slot_words
        spins += 1
        if spins >= _SPINS:
            call_c(yield_address, ())


@numba.njit(cache=True, nogil=True)
def mailbox_length(boxes, base: int) -> int:
    """The length of the message in the mailbox at ``base``."""
    return boxes[base + _LENGTH]


@numba.njit(cache=True, nogil=True)
def mailbox_consume(boxes, counters, source: int, base: int) -> None:
    """Hand the mailbox at ``base``, whose message from ``source`` was read, back to
    its sender."""
    counters[_COUNTS + counters[_SIZE] + source] += 1
    _store_release(boxes, base + _CONSUMED, boxes[base + _TAG])


@numba.njit(cache=True, nogil=True)
def mailbox_receive(boxes, counters, source: int, receive, yield_address: int) -> int:
    """Take the next message from group rank ``source`` into ``receive`` (uint8; the
    part that fits); return its length."""
    base = mailbox_arrival(boxes, counters, source, yield_address)
    length = mailbox_length(boxes, base)
    copy_bytes(receive.ctypes.data, mailbox_data(boxes, base), min(length, receive.size))
    mailbox_consume(boxes, counters, source, base)
    return length


_SLOT_WORDS = _CONTROL_WORDS + -(-MESSAGE_BYTES // 64) * 8


def box_words(size: int) -> int:
    """The int64 words of the mailboxes of a group of ``size`` ranks."""
    return 2 * size * _SLOT_WORDS


def new_counters(rank: int, size: int) -> np.ndarray:
    """The counters of group rank ``rank`` of ``size``, before any message."""
    counters = np.zeros(_COUNTS + 2 * size, np.int64)
    counters[_RANK], counters[_SIZE] = rank, size
    return counters


NO_BOXES = np.empty(0, np.int64)
"""The boxes and counters of a group without mailboxes (compiled code's arguments)."""


class Mailboxes:
    """A group's mailboxes, with the ``Send``, ``Recv`` and ``Sendrecv`` of an mpi4py
    communicator (byte buffers; tags are not needed: messages between two ranks are
    taken in the order they were sent).

    Attributes:
        boxes: the window's memory, int64 words.
        counters: this rank's message counts (see the module's layout).
        yield_address: ``sched_yield``'s address.
    """

    def __init__(self, group: Group):
        words = box_words(group.size)
        self._win = MPI.Win.Allocate_shared(8 * words if group.rank == 0 else 0, 8,
                                            comm=group.comm)
        memory, _ = self._win.Shared_query(0)
        self.boxes = np.frombuffer(memory, np.int64, words)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        mine = box_words(1)
        self.boxes[group.rank * mine:(group.rank + 1) * mine] = 0
        self.counters = new_counters(group.rank, group.size)
        self.yield_address = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
        group.comm.Barrier()

    def Send(self, message: np.ndarray, destination: int, tag: int = 0) -> None:
        """Leave ``message`` (uint8) for ``destination``."""
        mailbox_send(self.boxes, self.counters, destination, message, message.nbytes,
                     self.yield_address)

    def Recv(self, receive: np.ndarray, source: int, tag: int = 0) -> int:
        """Take the next message from ``source`` into ``receive`` (uint8, the part that
        fits); return its length."""
        return mailbox_receive(self.boxes, self.counters, source, receive,
                               self.yield_address)

    def Sendrecv(self, message: np.ndarray, destination: int, sendtag: int,
                 receive: np.ndarray, source: int, recvtag: int) -> None:
        """:meth:`Send`, then :meth:`Recv` (a send never waits for its receiver)."""
        self.Send(message, destination)
        self.Recv(receive, source)

    def free(self) -> None:
        """Release the window (collective over the group)."""
        self._win.Unlock_all()
        self._win.Free()


def open_mailboxes(group: Group) -> Mailboxes | None:
    """Build ``group``'s mailboxes where all its ranks may use them (collective over its
    ranks); they are freed with the group."""
    if group.size == 1:
        return None
    node = group.comm.Split_type(MPI.COMM_TYPE_SHARED)
    usable = node.Get_size() == group.size and AGREEMENT_SHARED_MEMORY.read() and \
        mpi_functions() is not None
    node.Free()
    if not group.comm.allreduce(usable, op=MPI.LAND):
        return None
    mailboxes = group.state["mailboxes"] = Mailboxes(group)
    group.children.append(mailboxes)
    return mailboxes


def mailboxes_of(group: Group) -> Mailboxes | None:
    """The mailboxes built with ``group``, or None."""
    return group.state.get("mailboxes")  # type: ignore[return-value]
