"""The agreement's exchange in machine code: one call of a Numba-compiled function runs the
whole recursive-doubling schedule of :func:`._recursive_doubling.exchange` and between
the steps compares the signatures and combines the headers or the payloads without
returning to Python. The messages travel through the group's shared-memory mailboxes
(:mod:`._mailboxes`) where it has them, else through the MPI library's own
``MPI_Sendrecv``, ``MPI_Send`` and ``MPI_Recv`` (:mod:`._c_calls`).

The messages, tags and rule of combining are the Python exchange's, so ranks may use
either. The Python exchange spends a few microseconds of interpreter time around each
message; this one costs what moving the messages does. It releases the GIL while it
runs, as mpi4py's blocking calls do, so the stall inspector's thread runs while it waits.

This module holds the steps (:func:`exchange`), the check alone (:func:`agreed`) and a
whole small allreduce (:func:`reduce_planned`); what rides behind the headers through
the mailboxes is in :mod:`._compiled_riding`, the MPI collective made once the check
has passed in :mod:`._compiled_checked`, and the per-group set-up that binds them to
their arrays in :mod:`._compiled_exchange`.

Payloads combine here as :mod:`ringtrain.kernels.elementwise` combines them (numpy's
``np.add``, ``np.minimum``, ``np.maximum``, ``np.multiply`` on numpy's own dtypes and on
16-bit floats, each dtype compiled when it is first used; ``np.bitwise_or`` on bytes).
"""
from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np

from ...kernels.elementwise import combine_values, finish_values, scale_values
from ...kernels.reduction import value_code
from ._c_calls import call_c, copy_bytes, void_pointer
from ._mailboxes import mailbox_receive, mailbox_send
from ._recursive_doubling import TAG

HEADERS_IF_DIFFERENT = 0
"""Combine the headers (elementwise max of int64 words) when the signatures differ."""
HEADERS = 1
"""Combine the headers at every step."""
PAYLOADS = 2
"""Combine the payloads when the signatures are equal, else the headers."""
DATA = 3
"""Combine the payloads at every step: messages of data alone, without a header."""
DIFFERENT = -1
"""What :func:`reduce_planned` returns when some rank's signature differed (nothing was reduced)."""

_BITWISE_OR = -1

# Words of the per-group state array (int64); an MPI_Status follows them.
_SENDRECV, _SEND, _RECV, _YIELD, _FOLDED_INTO, _FOLDED_FROM, _SIGNATURE_BYTES, \
    _HEADER_WORDS, _RANK, _PARTNER_COUNT, _PARTNERS = range(11)


def payload_code(dtype: np.dtype, combine: Callable) -> int | None:
    """How the compiled exchange combines payloads of ``dtype`` by ``combine``, or None
    when it cannot (the Python exchange must)."""
    if combine is np.bitwise_or:
        return _BITWISE_OR
    return value_code(dtype, combine)


@numba.njit(cache=True, nogil=True)
def _combine(op: int, mine, received, theirs_first: bool) -> None:
    """``mine`` combined with ``received``, the lower ranks' values first: the same
    operands in the same order on both partners, so bit-identical results even where the
    operation's bits depend on the order (a 16-bit minimum or maximum of +0 and -0)."""
    if op == _BITWISE_OR:
        mine_bytes, received_bytes = mine.view(np.uint8), received.view(np.uint8)
        for i in range(mine_bytes.size):
            mine_bytes[i] |= received_bytes[i]
    elif theirs_first:
        combine_values(op, received, mine, mine)
    else:
        combine_values(op, mine, received, mine)


@numba.njit(cache=True, nogil=True)
def fold(state, message, receive, mode: int, op: int, mine, received,
         theirs_first: bool) -> None:
    """Fold the message received into ``message`` as ``mode`` says; payloads by ``op``,
    the partner's first where ``theirs_first`` (its ranks are the lower ones)."""
    if mode == DATA:
        _combine(op, mine, received, theirs_first)
        return
    same = same_signature(state, message, receive)
    if mode == PAYLOADS and same:
        _combine(op, mine, received, theirs_first)
    elif mode == HEADERS or not same:
        words = state[_HEADER_WORDS]
        header = message[:8 * words].view(np.int64)
        theirs = receive[:8 * words].view(np.int64)
        for i in range(words):
            if theirs[i] > header[i]:
                header[i] = theirs[i]


@numba.njit(cache=True, nogil=True)
def _send(state, comm, byte, boxes, counters, peer: int, message, length: int) -> int:
    if boxes.size:
        mailbox_send(boxes, counters, peer, message, length, state[_YIELD])
        return 0
    return call_c(state[_SEND], (message.ctypes.data, np.int32(length), byte,
                                 np.int32(peer), np.int32(TAG), comm))


@numba.njit(cache=True, nogil=True)
def _receive(state, comm, byte, boxes, counters, peer: int, receive) -> int:
    if boxes.size:
        mailbox_receive(boxes, counters, peer, receive, state[_YIELD])
        return 0
    status = state[_PARTNERS + state[_PARTNER_COUNT]:].ctypes.data
    return call_c(state[_RECV], (receive.ctypes.data, np.int32(receive.size), byte,
                                 np.int32(peer), np.int32(TAG), comm, status))


@numba.njit(cache=True, nogil=True)
def _send_receive(state, comm, byte, boxes, counters, peer: int, message, length: int,
                  receive) -> int:
    if boxes.size:
        mailbox_send(boxes, counters, peer, message, length, state[_YIELD])
        mailbox_receive(boxes, counters, peer, receive, state[_YIELD])
        return 0
    status = state[_PARTNERS + state[_PARTNER_COUNT]:].ctypes.data
    tag, partner = np.int32(TAG), np.int32(peer)
    return call_c(state[_SENDRECV], (message.ctypes.data, np.int32(length), byte, partner,
                                     tag, receive.ctypes.data, np.int32(receive.size), byte,
                                     partner, tag, comm, status))


@numba.njit(cache=True, nogil=True)
def exchange(state, comm, byte, boxes, counters, message, length: int, receive, mode: int,
             op: int, mine, received) -> int:
    folded_into, folded_from = state[_FOLDED_INTO], state[_FOLDED_FROM]
    if folded_into >= 0:
        error = _send(state, comm, byte, boxes, counters, folded_into, message, length)
        if error == 0:
            error = _receive(state, comm, byte, boxes, counters, folded_into, receive)
        if error == 0:
            copy_bytes(message.ctypes.data, receive.ctypes.data, length)
        return error
    if folded_from >= 0:
        error = _receive(state, comm, byte, boxes, counters, folded_from, receive)
        if error != 0:
            return error
        fold(state, message, receive, mode, op, mine, received, True)
    for step in range(state[_PARTNER_COUNT]):
        partner = state[_PARTNERS + step]
        error = _send_receive(state, comm, byte, boxes, counters, partner, message, length,
                              receive)
        if error != 0:
            return error
        fold(state, message, receive, mode, op, mine, received, partner < state[_RANK])
    if folded_from >= 0:
        return _send(state, comm, byte, boxes, counters, folded_from, message, length)
    return 0


@numba.njit(cache=True, nogil=True)
def _reduce(state, comm, byte, boxes, counters, message, length: int, receive, op: int,
            fresh_header, factors, source, result) -> int:
    """A whole small allreduce: the header and ``source * factors[0]`` into the message,
    the exchange, the signatures checked, then ``data / factors[1] * factors[2]`` into
    ``result`` (each operation rounded to the dtype, as numpy's are)."""
    header_bytes, count = fresh_header.size, source.size
    copy_bytes(message.ctypes.data, fresh_header.ctypes.data, header_bytes)
    # Views made from addresses are contiguous to the compiler: its loops run on vectors.
    data = numba.carray(void_pointer(message.ctypes.data + header_bytes), count, source.dtype)
    received = numba.carray(void_pointer(receive.ctypes.data + header_bytes), count,
                            source.dtype)
    if factors[0] == 1:
        for i in range(count):
            data[i] = source[i]
    else:
        scale_values(op, source, factors[0], data)
    # Constants go to compiled callees as np.int64: passed as they are, each value would
    # compile the callee once more, for that value alone.
    error = exchange(state, comm, byte, boxes, counters, message, length, receive,
                     np.int64(PAYLOADS), op, data, received)
    if error != 0:
        return error
    if not same_signature(state, message, fresh_header):
        return DIFFERENT
    finish_values(op, data, factors, result)
    return 0


@numba.njit(cache=True, nogil=True)
def reduce_segments(state, comm, byte, buffer, receive, per_segment: int, op: int) -> int:
    """The recursive-doubling allreduce of 1-D ``buffer`` in place, ``per_segment``
    elements at a time, each segment's message its data alone (mode :data:`DATA`),
    through MPI, combined by payload code ``op``: the schedule and the messages of
    :func:`._recursive_doubling.allreduce`; 0 or the MPI call's error. ``receive``
    (uint8) holds a segment."""
    no_boxes = np.empty(0, np.int64)
    for start in range(0, buffer.size, per_segment):
        piece = buffer[start:start + per_segment]
        message = piece.view(np.uint8)
        length = message.size
        error = exchange(state, comm, byte, no_boxes, no_boxes, message, length, receive,
                         np.int64(DATA), op, piece, receive[:length].view(buffer.dtype))
        if error != 0:
            return error
    return 0


# Words of a reduction's plan (int64): where the arrays of its group and its messages
# are, with their sizes, then the message's length and how payloads combine.
_AT_STATE, _STATE_WORDS, _AT_BOXES, _BOX_WORDS, _AT_COUNTERS, _COUNTER_WORDS, _AT_MESSAGE, \
    _MESSAGE_BYTES, _AT_RECEIVE, _RECEIVE_BYTES, _LENGTH, _CODE = range(12)


@numba.njit(cache=True, nogil=True)
def reduce_planned(plan, handles, fresh_header, factors, source, result) -> int:
    """:func:`_reduce` on the arrays at the addresses in ``plan``: six arguments for the
    dispatcher to check at every call instead of thirteen."""
    state, boxes, counters, message, receive = plan_arrays(plan)
    return _reduce(state, handles[0], handles[1], boxes, counters, message, plan[_LENGTH],
                   receive, plan[_CODE], fresh_header, factors, source, result)


@numba.njit(cache=True, nogil=True, inline="always")
def plan_arrays(plan):
    """The arrays a plan (:meth:`._compiled_exchange.CompiledExchange.checked`) gives
    the addresses of: the group's state, mailboxes and counters, the message and the
    receive buffer."""
    return (numba.carray(void_pointer(plan[_AT_STATE]), plan[_STATE_WORDS], np.int64),
            numba.carray(void_pointer(plan[_AT_BOXES]), plan[_BOX_WORDS], np.int64),
            numba.carray(void_pointer(plan[_AT_COUNTERS]), plan[_COUNTER_WORDS], np.int64),
            numba.carray(void_pointer(plan[_AT_MESSAGE]), plan[_MESSAGE_BYTES], np.uint8),
            numba.carray(void_pointer(plan[_AT_RECEIVE]), plan[_RECEIVE_BYTES], np.uint8))


@numba.njit(cache=True, nogil=True, inline="always")
def same_signature(state, message, receive) -> bool:
    """Whether the signature received is the one in ``message``."""
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != receive[i]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def agreed(plan, handles, fresh_header, mode: int) -> int:
    """The agreement's check in compiled code: ``fresh_header`` (uint8) written into the
    message of ``plan`` (a reduction's plan, see :func:`plan_arrays`),
    whatever follows it there already written, and the message's length exchanged,
    combined by ``mode`` (what follows the header by bitwise or); 0 where every rank's
    signature was ours, else :data:`DIFFERENT` or the MPI call's error."""
    state, boxes, counters, message, arrived = plan_arrays(plan)
    header_bytes, length = fresh_header.size, plan[_LENGTH]
    copy_bytes(message.ctypes.data, fresh_header.ctypes.data, header_bytes)
    error = exchange(state, handles[0], handles[1], boxes, counters, message, length, arrived,
                     mode, np.int64(_BITWISE_OR), message[header_bytes:length],
                     arrived[header_bytes:length])
    if error != 0:
        return error
    if not same_signature(state, message, fresh_header):
        return DIFFERENT
    return 0
