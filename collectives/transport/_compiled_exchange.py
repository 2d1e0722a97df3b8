"""The agreement's exchange in machine code: one call of a Numba-compiled function runs the
whole recursive-doubling schedule of :func:`._recursive_doubling.exchange` and between
the steps compares the signatures and combines the headers or the payloads without
returning to Python. The messages travel through the group's shared-memory mailboxes
(:mod:`._mailboxes`) where it has them, else through the MPI library's own
``MPI_Sendrecv``, ``MPI_Send`` and ``MPI_Recv`` (:mod:`._native_calls`).

The messages, tags and rule of combining are the Python exchange's, so ranks may use
either; ``RINGTRAIN_COMPILED_EXCHANGE=0`` turns this one off. The Python exchange spends
a few microseconds of interpreter time around each message; this one costs what moving
the messages does. It releases the GIL while it runs, as mpi4py's blocking calls do,
so the stall inspector's thread runs while it waits.

A small allreduce is one compiled call (:meth:`CompiledExchange.reduction`): it fills
the message from the caller's array, exchanges, checks the signatures and writes the
finished result. So is a larger allreduce, broadcast, reduce-scatter, allgather or
alltoall that the MPI library's own collective moves
(:meth:`CompiledExchange.checked_collective`): the headers (with a gather's row counts,
an alltoall's splits) are exchanged and checked, then the collective is called. A small
broadcast or gather riding through the mailboxes is one call too
(:meth:`CompiledExchange.broadcast_held`, :meth:`CompiledExchange.gather_held`): each
message carries only the data its sender holds by then, copied straight between the
mailbox and the caller's arrays.

Payloads combine here by the operations numpy's ufuncs perform (``np.add``,
``np.minimum``, ``np.maximum``, ``np.multiply`` on the dtypes below, each dtype compiled
when it is first used; ``np.bitwise_or`` on bytes): the same values, except that a
minimum or maximum of +0 and -0 is -0 or +0 whatever the operands' order (numpy returns
its second operand on a tie), so that the ranks' results are bit-identical. Other
combinations (16-bit floats) take the Python exchange.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numba
import numpy as np
from mpi4py import MPI

from ..base._group import Group
from ._mailboxes import (NO_BOXES, mailbox_arrival, mailbox_claim, mailbox_consume, mailbox_data,
                         mailbox_length, mailbox_publish, mailbox_ranks, mailbox_receive,
                         mailbox_send, mailboxes_of)
from ._native_calls import MpiFunctions, call_c, copy_bytes, mpi_functions, void_pointer
from ._pairwise import through_mailboxes
from ._recursive_doubling import TAG, schedule_of

HEADERS_IF_DIFFERENT = 0
"""Combine the headers (elementwise max of int64 words) when the signatures differ."""
HEADERS = 1
"""Combine the headers at every step."""
PAYLOADS = 2
"""Combine the payloads when the signatures are equal, else the headers."""
DIFFERENT = -1
"""What :func:`_reduce` returns when some rank's signature differed (nothing was reduced)."""

_OPS: dict[Callable, int] = {np.add: 0, np.minimum: 1, np.maximum: 2, np.multiply: 3}
_BITWISE_OR = -1
_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.uint8, np.int16,
                                          np.int32, np.int64))
_NO_PAYLOAD = np.empty(0, np.uint8)
_NO_WORDS = np.empty(0, np.int64)

# Words of the per-group state array (int64); an MPI_Status follows them.
_SENDRECV, _SEND, _RECV, _YIELD, _FOLDED_INTO, _FOLDED_FROM, _SIGNATURE_BYTES, \
    _HEADER_WORDS, _PARTNER_COUNT, _PARTNERS = range(10)


def payload_code(dtype: np.dtype, combine: Callable) -> int | None:
    """How the compiled exchange combines payloads of ``dtype`` by ``combine``, or None
    when it cannot (the Python exchange must)."""
    if combine is np.bitwise_or:
        return _BITWISE_OR
    return _OPS.get(combine) if dtype in _DTYPES else None


@numba.njit(cache=True, nogil=True, inline="always")
def pick(op: int, a, b):
    """``a`` and ``b`` combined by payload code ``op`` (0 add, 1 minimum, 2 maximum,
    3 multiply; see the module's note on minimum and maximum)."""
    if op == 0:
        return a + b
    if op == 3:
        return a * b
    if a != a:
        return a
    if b != b:
        return b
    if a == b:
        if a == 0:  # +0 and -0: -0 for the minimum, +0 for the maximum, in either order
            return -((-a) + (-b)) if op == 1 else a + b
        return a
    if op == 1:
        return a if a < b else b
    return a if a > b else b


@numba.njit(cache=True, nogil=True)
def _combine(op: int, mine, received) -> None:
    if op == _BITWISE_OR:
        mine_bytes, received_bytes = mine.view(np.uint8), received.view(np.uint8)
        for i in range(mine_bytes.size):
            mine_bytes[i] |= received_bytes[i]
        return
    for i in range(mine.size):
        mine[i] = pick(op, mine[i], received[i])


@numba.njit(cache=True, nogil=True)
def _fold(state, message, receive, mode: int, op: int, mine, received) -> None:
    same = True
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != receive[i]:
            same = False
            break
    if mode == PAYLOADS and same:
        _combine(op, mine, received)
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
def _exchange(state, comm, byte, boxes, counters, message, length: int, receive, mode: int,
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
        _fold(state, message, receive, mode, op, mine, received)
    for step in range(state[_PARTNER_COUNT]):
        error = _send_receive(state, comm, byte, boxes, counters, state[_PARTNERS + step],
                              message, length, receive)
        if error != 0:
            return error
        _fold(state, message, receive, mode, op, mine, received)
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
        for i in range(count):
            data[i] = source[i] * factors[0]
    error = _exchange(state, comm, byte, boxes, counters, message, length, receive,
                      PAYLOADS, op, data, received)
    if error != 0:
        return error
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != fresh_header[i]:
            return DIFFERENT
    if factors[1] == 1 and factors[2] == 1:
        for i in range(count):
            result[i] = data[i]
    else:
        for i in range(count):
            result[i] = data[i] / factors[1] * factors[2]
    return 0


# Words of a reduction's plan (int64): where the arrays of its group and its messages
# are, with their sizes, then the message's length and how payloads combine.
_AT_STATE, _STATE_WORDS, _AT_BOXES, _BOX_WORDS, _AT_COUNTERS, _COUNTER_WORDS, _AT_MESSAGE, \
    _MESSAGE_BYTES, _AT_RECEIVE, _RECEIVE_BYTES, _LENGTH, _CODE = range(12)


@numba.njit(cache=True, nogil=True)
def _reduce_planned(plan, handles, fresh_header, factors, source, result) -> int:
    """:func:`_reduce` on the arrays at the addresses in ``plan``: six arguments for the
    dispatcher to check at every call instead of thirteen."""
    return _reduce(
        numba.carray(void_pointer(plan[_AT_STATE]), plan[_STATE_WORDS], np.int64),
        handles[0], handles[1],
        numba.carray(void_pointer(plan[_AT_BOXES]), plan[_BOX_WORDS], np.int64),
        numba.carray(void_pointer(plan[_AT_COUNTERS]), plan[_COUNTER_WORDS], np.int64),
        numba.carray(void_pointer(plan[_AT_MESSAGE]), plan[_MESSAGE_BYTES], np.uint8),
        plan[_LENGTH],
        numba.carray(void_pointer(plan[_AT_RECEIVE]), plan[_RECEIVE_BYTES], np.uint8),
        plan[_CODE], fresh_header, factors, source, result)


@numba.njit(cache=True, nogil=True)
def _give_held(state, boxes, counters, peer: int, message, header_bytes: int, data,
               holds: bool, root_rank: int) -> None:
    """Send this rank's header to ``peer``, followed by ``data`` where this rank holds
    the root's data and ``peer`` is not the root; each copied once, straight into the
    mailbox."""
    holds = holds and peer != root_rank
    length = header_bytes + (data.size if holds else 0)
    base = mailbox_claim(boxes, counters, length, state[_YIELD])
    at = mailbox_data(boxes, base)
    copy_bytes(at, message.ctypes.data, header_bytes)
    if holds:
        copy_bytes(at + header_bytes, data.ctypes.data, data.size)
    mailbox_publish(boxes, counters, base, peer, length)


@numba.njit(cache=True, nogil=True)
def _take_held(state, boxes, counters, peer: int, message, receive, header_bytes: int, data,
               holds: bool, adopt: bool) -> bool:
    """Take ``peer``'s message: its header folded into ours as the exchange folds headers
    (``adopt``: replacing ours), its data copied from the mailbox into ``data`` where it
    carries the root's data, this rank holds none yet and the signatures are equal;
    whether this rank holds the data now."""
    base = mailbox_arrival(boxes, counters, peer, state[_YIELD])
    at = mailbox_data(boxes, base)
    copy_bytes(receive.ctypes.data, at, header_bytes)
    same = True
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != receive[i]:
            same = False
            break
    if same and not holds and mailbox_length(boxes, base) == header_bytes + data.size:
        copy_bytes(data.ctypes.data, at + header_bytes, data.size)
        holds = True
    mailbox_consume(boxes, counters, peer, base)
    if adopt:
        copy_bytes(message.ctypes.data, receive.ctypes.data, header_bytes)
    else:
        _fold(state, message, receive, HEADERS_IF_DIFFERENT, 0, message[:0], receive[:0])
    return holds


@numba.njit(cache=True, nogil=True)
def _broadcast_held(plan, handles, holding, fresh_header, source, result) -> int:
    """A whole small broadcast through the mailboxes, in the agreement's schedule and
    with its headers: the root's ``source`` (bytes) into every rank's ``result`` (may be
    ``source``); ``holding`` (int64) is scratch for whether this rank holds the bytes,
    then the root's group rank and whether this rank is the root. Only ranks
    that hold the data by then send it (never to the root), and a rank takes it only
    from a partner whose signature is its own, straight into ``result``: 0, or
    :data:`DIFFERENT` when some rank's signature differed (``result`` then unspecified
    but for the root's)."""
    state = numba.carray(void_pointer(plan[_AT_STATE]), plan[_STATE_WORDS], np.int64)
    boxes = numba.carray(void_pointer(plan[_AT_BOXES]), plan[_BOX_WORDS], np.int64)
    counters = numba.carray(void_pointer(plan[_AT_COUNTERS]), plan[_COUNTER_WORDS], np.int64)
    message = numba.carray(void_pointer(plan[_AT_MESSAGE]), plan[_MESSAGE_BYTES], np.uint8)
    receive = numba.carray(void_pointer(plan[_AT_RECEIVE]), plan[_RECEIVE_BYTES], np.uint8)
    header_bytes = fresh_header.size
    copy_bytes(message.ctypes.data, fresh_header.ctypes.data, header_bytes)
    holding[0] = holding[2]
    if holding[2] and source.ctypes.data != result.ctypes.data:
        copy_bytes(result.ctypes.data, source.ctypes.data, result.size)
    _walk_riding(state, boxes, counters, message, receive, header_bytes, _RIDE_BROADCAST,
                 holding, holding, result)
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != fresh_header[i]:
            return DIFFERENT
    return 0


_RIDE_BROADCAST, _RIDE_GATHER = range(2)
"""What rides behind the headers in :func:`_walk_riding`."""


@numba.njit(cache=True, nogil=True)
def _walk_riding(state, boxes, counters, message, receive, head_bytes: int, kind: int,
                 cells, known, result) -> None:
    """The exchange's schedule (:func:`_exchange`) with data riding behind the first
    ``head_bytes`` of ``message``: a broadcast's (``kind`` :data:`_RIDE_BROADCAST`;
    ``known``: whether this rank holds the root's bytes, then the root's rank) or a
    gather's (:data:`_RIDE_GATHER`; ``cells`` and ``known`` as :func:`_gather_held`
    takes them)."""
    folded_into, folded_from = state[_FOLDED_INTO], state[_FOLDED_FROM]
    if folded_into >= 0:
        _give_riding(state, boxes, counters, folded_into, message, head_bytes, kind, cells,
                     known, result)
        _take_riding(state, boxes, counters, folded_into, message, receive, head_bytes, kind,
                     cells, known, result, True)
        return
    if folded_from >= 0:
        _take_riding(state, boxes, counters, folded_from, message, receive, head_bytes, kind,
                     cells, known, result, False)
    for step in range(state[_PARTNER_COUNT]):
        peer = state[_PARTNERS + step]
        _give_riding(state, boxes, counters, peer, message, head_bytes, kind, cells, known,
                     result)
        _take_riding(state, boxes, counters, peer, message, receive, head_bytes, kind, cells,
                     known, result, False)
    if folded_from >= 0:
        _give_riding(state, boxes, counters, folded_from, message, head_bytes, kind, cells,
                     known, result)


@numba.njit(cache=True, nogil=True)
def _give_riding(state, boxes, counters, peer: int, message, head_bytes: int, kind: int,
                 cells, known, result) -> None:
    if kind == _RIDE_BROADCAST:
        _give_held(state, boxes, counters, peer, message, head_bytes, result, known[0] == 1,
                   known[1])
    else:
        _give_cells(state, boxes, counters, peer, message, head_bytes, cells, known, result)


@numba.njit(cache=True, nogil=True)
def _take_riding(state, boxes, counters, peer: int, message, receive, head_bytes: int,
                 kind: int, cells, known, result, adopt: bool) -> None:
    if kind == _RIDE_BROADCAST:
        holds = _take_held(state, boxes, counters, peer, message, receive, head_bytes,
                           result, known[0] == 1, adopt)
        known[0] = 1 if holds else 0
    else:
        _take_cells(state, boxes, counters, peer, message, receive, head_bytes, cells, known,
                    result, adopt)


# Words of a gather's cells (int64): this rank, the bytes of a rank's data, and of every
# rank's words (where the data starts in a gather's result and its messages' payload).
CELL_RANK, CELL_DATA, ALL_WORDS = range(3)


@numba.njit(cache=True, nogil=True)
def cells_length(cells, known) -> int:
    """The bytes :func:`pack_cells` writes for the ranks ``known`` (uint8, 1: known)."""
    count = 0
    for r in range(known.size):
        count += known[r]
    return 16 + count * (8 + cells[CELL_DATA])


@numba.njit(cache=True, nogil=True)
def pack_cells(at: int, cells, known, result) -> None:
    """Write at address ``at`` the data of every rank ``known`` from ``result`` (laid out
    as a gather's result: every rank's words, then every rank's data): the bytes of a
    rank's data, how many ranks, their ranks, then their data."""
    data, all_words = cells[CELL_DATA], cells[ALL_WORDS]
    head = numba.carray(void_pointer(at), 2 + known.size, np.int64)
    count = 0
    for r in range(known.size):
        if known[r]:
            head[2 + count] = r
            count += 1
    head[0], head[1] = data, count
    offset = at + 8 * (2 + count)
    for i in range(count):
        copy_bytes(offset, result.ctypes.data + all_words + head[2 + i] * data, data)
        offset += data


@numba.njit(cache=True, nogil=True)
def unpack_cells(at: int, length: int, cells, known, result) -> None:
    """Take into ``result`` the data at address ``at`` (``length`` bytes, as
    :func:`pack_cells` writes it) of the ranks not ``known`` yet, and know them; where
    the sender's ranks give more or fewer bytes than this one, nothing (the ranks' words
    differ then, and the data is not used)."""
    data, all_words = cells[CELL_DATA], cells[ALL_WORDS]
    head = numba.carray(void_pointer(at), 2, np.int64)
    cell, count = head[0], head[1]
    if cell != data or count < 0 or count > known.size or 16 + count * (8 + cell) > length:
        return
    ranks = numba.carray(void_pointer(at + 16), count, np.int64)
    offset = at + 8 * (2 + count)
    for i in range(count):
        r = ranks[i]
        if 0 <= r < known.size and not known[r]:
            copy_bytes(result.ctypes.data + all_words + r * data, offset, data)
            known[r] = 1
        offset += data


@numba.njit(cache=True, nogil=True)
def _give_cells(state, boxes, counters, peer: int, message, head_bytes: int, cells, known,
                result) -> None:
    """Send the header and every rank's words (``head_bytes`` of ``message``), then the
    data this rank knows, if the gather carries data."""
    length = head_bytes + (cells_length(cells, known) if cells[CELL_DATA] else 0)
    base = mailbox_claim(boxes, counters, length, state[_YIELD])
    at = mailbox_data(boxes, base)
    copy_bytes(at, message.ctypes.data, head_bytes)
    if cells[CELL_DATA]:
        pack_cells(at + head_bytes, cells, known, result)
    mailbox_publish(boxes, counters, base, peer, length)


@numba.njit(cache=True, nogil=True)
def _take_cells(state, boxes, counters, peer: int, message, receive, head_bytes: int, cells,
                known, result, adopt: bool) -> None:
    """Take ``peer``'s message: its header and words folded into ours as the exchange
    folds payloads combined by bitwise or (``adopt``: replacing ours), its data taken
    where its signature is ours."""
    base = mailbox_arrival(boxes, counters, peer, state[_YIELD])
    at, length = mailbox_data(boxes, base), mailbox_length(boxes, base)
    copy_bytes(receive.ctypes.data, at, min(length, head_bytes))
    same = True
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != receive[i]:
            same = False
            break
    if same and cells[CELL_DATA] and length > head_bytes:
        unpack_cells(at + head_bytes, length - head_bytes, cells, known, result)
    mailbox_consume(boxes, counters, peer, base)
    if adopt:
        copy_bytes(message.ctypes.data, receive.ctypes.data, head_bytes)
    else:
        header_bytes = 8 * state[_HEADER_WORDS]
        _fold(state, message, receive, PAYLOADS, _BITWISE_OR,
              message[header_bytes:head_bytes], receive[header_bytes:head_bytes])


@numba.njit(cache=True, nogil=True)
def _gather_held(plan, handles, cells, known, fresh_header, source, result) -> int:
    """A whole small gather through the mailboxes, in the agreement's schedule and with
    its headers: ``source`` and ``result`` laid out as a gather's result (every rank's
    words, then every rank's data), ``source`` holding this rank's words at their place
    and zeros in the other ranks' words, ``result`` already holding this rank's data at
    its place. The words travel as
    :meth:`CompiledExchange.checked_collective` sends them (every rank's, combined by
    bitwise or at every step); behind them each message carries the data its sender
    knows by then (``known``: scratch, one byte per rank), which a rank takes from a
    partner whose signature is its own. 0 where every rank's words are this rank's,
    :data:`UNEVEN` where some differ (every rank's data has arrived all the same), or
    :data:`DIFFERENT` when some rank's signature differed (``result`` then
    unspecified)."""
    state = numba.carray(void_pointer(plan[_AT_STATE]), plan[_STATE_WORDS], np.int64)
    boxes = numba.carray(void_pointer(plan[_AT_BOXES]), plan[_BOX_WORDS], np.int64)
    counters = numba.carray(void_pointer(plan[_AT_COUNTERS]), plan[_COUNTER_WORDS], np.int64)
    message = numba.carray(void_pointer(plan[_AT_MESSAGE]), plan[_MESSAGE_BYTES], np.uint8)
    receive = numba.carray(void_pointer(plan[_AT_RECEIVE]), plan[_RECEIVE_BYTES], np.uint8)
    header_bytes, all_words = fresh_header.size, cells[ALL_WORDS]
    head_bytes = header_bytes + all_words
    copy_bytes(message.ctypes.data, fresh_header.ctypes.data, header_bytes)
    copy_bytes(message.ctypes.data + header_bytes, source.ctypes.data, all_words)
    rank = cells[CELL_RANK]
    for r in range(known.size):
        known[r] = 0
    known[rank] = 1
    _walk_riding(state, boxes, counters, message, receive, head_bytes, _RIDE_GATHER, cells,
                 known, result)
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != fresh_header[i]:
            return DIFFERENT
    copy_bytes(result.ctypes.data, message.ctypes.data + header_bytes, all_words)
    words = numba.carray(void_pointer(message.ctypes.data + header_bytes), all_words // 8,
                         np.int64)
    return words_agree(words, rank, all_words // 8 // known.size)


@numba.njit(cache=True, nogil=True)
def words_agree(words, rank: int, width: int) -> int:
    """0 where every rank's ``width`` words (rank after rank in ``words``) are group rank
    ``rank``'s, else :data:`UNEVEN`."""
    mine = rank * width
    for i in range(words.size):
        if words[i] != words[mine + i % width]:
            return UNEVEN
    return 0


ALLREDUCE, BROADCAST, REDUCE_SCATTER, ALLGATHER, ALLTOALL, MAILBOX_ALLGATHER, \
    MAILBOX_ALLTOALL = range(7)
"""The collectives that :meth:`CompiledExchange.checked_collective` makes: the MPI
library's own, and the pairwise allgather and alltoall through the group's mailboxes
(:mod:`._pairwise`)."""
UNEVEN = -2
"""What :func:`_checked_collective` returns when every rank's signature was the same but
the words of a gather or an alltoall differed (nothing moved; every rank's words are in
the message's payload)."""
# Words of a checked collective's description (int64); a gather's or an alltoall's
# words follow.
_FUNCTION, _KIND, _COUNT, _ROOT, _IN_PLACE, _RANK, _WIDTH, _WORDS = range(8)


@numba.njit(cache=True, nogil=True)
def agreed(plan, handles, fresh_header, mode: int) -> int:
    """The agreement's check in compiled code: ``fresh_header`` (uint8) written into the
    message of ``plan`` (a reduction's plan, see :meth:`CompiledExchange.checked`),
    whatever follows it there already written, and the message's length exchanged,
    combined by ``mode`` (what follows the header by bitwise or); 0 where every rank's
    signature was ours, else :data:`DIFFERENT` or the MPI call's error."""
    state = numba.carray(void_pointer(plan[_AT_STATE]), plan[_STATE_WORDS], np.int64)
    message = numba.carray(void_pointer(plan[_AT_MESSAGE]), plan[_MESSAGE_BYTES], np.uint8)
    arrived = numba.carray(void_pointer(plan[_AT_RECEIVE]), plan[_RECEIVE_BYTES], np.uint8)
    header_bytes, length = fresh_header.size, plan[_LENGTH]
    copy_bytes(message.ctypes.data, fresh_header.ctypes.data, header_bytes)
    error = _exchange(
        state, handles[0], handles[1],
        numba.carray(void_pointer(plan[_AT_BOXES]), plan[_BOX_WORDS], np.int64),
        numba.carray(void_pointer(plan[_AT_COUNTERS]), plan[_COUNTER_WORDS], np.int64),
        message, length, arrived, mode, _BITWISE_OR, message[header_bytes:length],
        arrived[header_bytes:length])
    if error != 0:
        return error
    for i in range(state[_SIGNATURE_BYTES]):
        if message[i] != fresh_header[i]:
            return DIFFERENT
    return 0


@numba.njit(cache=True, nogil=True)
def _checked_collective(plan, handles, collective, fresh_header, send, receive) -> int:
    """The check of the signatures, then, where every rank's was ours, the MPI library's
    own collective that ``collective`` describes from ``send`` (``MPI_IN_PLACE`` when it
    is ``receive``) into ``receive``, with the datatype and op of ``handles`` (or, for
    :data:`MAILBOX_ALLGATHER` and :data:`MAILBOX_ALLTOALL`, the pairwise exchange of
    blocks of ``count`` bytes through the group's mailboxes): :data:`DIFFERENT`,
    :data:`UNEVEN`, 0, or the MPI call's error.

    The headers travel alone, except for a gather and an alltoall: every rank's words
    then ride behind the header (at its rank's place, or'ed into zeros, as
    :class:`._agreement.CarriedGather` sends them), and the collective is made only
    where every rank's words are this rank's."""
    header_bytes, length = fresh_header.size, plan[_LENGTH]
    kind, width = collective[_KIND], collective[_WIDTH]
    words_count = (length - header_bytes) // 8
    words = numba.carray(void_pointer(plan[_AT_MESSAGE] + header_bytes), words_count,
                         np.int64)
    mine = collective[_WORDS:_WORDS + width]
    for i in range(words_count):
        words[i] = 0
    for i in range(width):
        words[collective[_RANK] * width + i] = mine[i]
    error = agreed(plan, handles, fresh_header,
                   PAYLOADS if words_count else HEADERS_IF_DIFFERENT)
    if error != 0:
        return error
    if words_count and words_agree(words, collective[_RANK], width) != 0:
        return UNEVEN
    if kind == MAILBOX_ALLGATHER or kind == MAILBOX_ALLTOALL:
        state = numba.carray(void_pointer(plan[_AT_STATE]), plan[_STATE_WORDS], np.int64)
        boxes = numba.carray(void_pointer(plan[_AT_BOXES]), plan[_BOX_WORDS], np.int64)
        counters = numba.carray(void_pointer(plan[_AT_COUNTERS]), plan[_COUNTER_WORDS],
                                np.int64)
        offsets = np.arange(mailbox_ranks(counters)[1] + 1) * collective[_COUNT]
        through_mailboxes(boxes, counters, state[_YIELD], send, offsets,
                          kind == MAILBOX_ALLGATHER, receive, offsets)
        return 0
    function, count = collective[_FUNCTION], np.int32(collective[_COUNT])
    comm, datatype, op = handles[0], handles[2], handles[3]
    target = receive.ctypes.data
    if kind == BROADCAST:
        return call_c(function, (target, count, datatype, np.int32(collective[_ROOT]), comm))
    if kind == ALLGATHER or kind == ALLTOALL:
        return call_c(function, (send.ctypes.data, count, datatype, target, count, datatype,
                                 comm))
    # Two calls: one variable holding either address reached MPI as the wrong argument
    # (numba 0.68).
    if send.ctypes.data == target:
        return call_c(function, (collective[_IN_PLACE], target, count, datatype, op, comm))
    return call_c(function, (send.ctypes.data, target, count, datatype, op, comm))


class CompiledExchange:
    """The compiled exchange of one group, set up once."""

    def __init__(self, group: Group, functions: MpiFunctions, signature_bytes: int,
                 header_bytes: int):
        schedule = schedule_of(group)
        status_words = -(-functions.status_bytes // 8)
        mailboxes = mailboxes_of(group)
        self._boxes, self._counters = (NO_BOXES, NO_BOXES) if mailboxes is None else \
            (mailboxes.boxes, mailboxes.counters)
        fields = [functions.sendrecv, functions.send, functions.recv,
                  0 if mailboxes is None else mailboxes.yield_address,
                  -1 if schedule.folded_into is None else schedule.folded_into,
                  -1 if schedule.folded_from is None else schedule.folded_from,
                  signature_bytes, header_bytes // 8, len(schedule.partners),
                  *schedule.partners]
        self._state = np.array(fields + [0] * status_words, np.int64)
        self._comm = functions.handle(group.comm)
        self._byte = functions.handle(MPI.BYTE)
        self._functions = functions
        self._header_bytes = header_bytes
        self._rank, self._size = group.rank, group.size

    def run(self, message: np.ndarray, length: int, receive: np.ndarray, mode: int,
            code: int = 0, mine: np.ndarray = _NO_PAYLOAD,
            received: np.ndarray = _NO_PAYLOAD) -> None:
        """Exchange ``message[:length]`` (uint8) as :func:`._recursive_doubling.exchange`
        does, combining by ``mode``; payloads by ``code`` (from :func:`payload_code`),
        ``mine`` and ``received`` being their typed views in ``message`` and ``receive``.

        Raises:
            MPI.Exception: an MPI call failed.
        """
        error = _exchange(self._state, self._comm, self._byte, self._boxes, self._counters,
                          message, length, receive, mode, code, mine, received)
        if error:
            raise MPI.Exception(error)

    def reduction(self, message: np.ndarray, length: int, receive: np.ndarray,
                  code: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]:
        """A small allreduce in one compiled call, bound to its messages:
        ``reduce(fresh_header, factors, source, result)`` writes ``fresh_header`` (uint8)
        and then ``source * factors[0]`` into ``message`` (``length`` bytes in all),
        exchanges them and combines by ``code`` as :meth:`run` does; then, if every
        rank's signature was ours, writes the data ``/ factors[1] * factors[2]`` into
        ``result`` and returns 0. ``factors`` are of ``source``'s dtype (1 where nothing
        is to be done: an integer payload is only copied); ``result`` may be ``source``.

        The call returns :data:`DIFFERENT` when some rank's signature differed (the
        message then holds the combined headers, as :meth:`run` leaves them, and
        ``result`` is untouched), and an MPI error code when an MPI call failed.

        It finds its arrays by address: ``message`` and ``receive`` must live as long as
        it is called (the group's own do, and so do this exchange's).
        """
        handles = np.array([self._comm, self._byte], self._comm.dtype)
        return functools.partial(_reduce_planned, self._plan(message, length, receive, code),
                                 handles)

    def checked_collective(self, message: np.ndarray, receive: np.ndarray, kind: int,
                           count: int, datatype: MPI.Datatype, op: MPI.Op = MPI.OP_NULL,
                           root: int = 0, words: np.ndarray = _NO_WORDS
                           ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], int]:
        """An MPI collective checked by the agreement in the same compiled call, bound
        to the agreement's messages: ``run(fresh_header, send, receive)`` exchanges the
        header (uint8) as :meth:`run` does in mode :data:`HEADERS_IF_DIFFERENT`, and,
        if every rank's signature was ours, makes the collective ``kind`` of ``count``
        elements of ``datatype`` (combined by ``op``; a broadcast from group rank
        ``root`` in ``receive``) from array ``send`` (in place when it is ``receive``)
        into array ``receive``, returning 0 or the MPI call's error code;
        :data:`DIFFERENT` (nothing moved) when some rank's signature differed. A
        reduce-scatter gives every rank ``count`` elements, an allgather takes
        ``count`` from each and an alltoall sends ``count`` to each (kinds
        :data:`MAILBOX_ALLGATHER` and :data:`MAILBOX_ALLTOALL`: ``count`` bytes, through
        the group's mailboxes, which it must have).

        An allgather's or alltoall's ``words`` (int64: its row count, its splits) ride
        behind the header, every rank's at its place, combined by bitwise or (mode
        :data:`PAYLOADS`, as :class:`._agreement.CarriedGather` sends them); where
        some rank's differ from this rank's the call returns :data:`UNEVEN`, nothing
        moved, every rank's words in the message's payload. The datatype and op must be
        the MPI library's own (a user-defined op would call Python without the GIL)."""
        functions = self._functions
        address = {ALLREDUCE: functions.allreduce, BROADCAST: functions.bcast,
                   REDUCE_SCATTER: functions.reduce_scatter_block,
                   ALLGATHER: functions.allgather, ALLTOALL: functions.alltoall,
                   MAILBOX_ALLGATHER: 0, MAILBOX_ALLTOALL: 0}[kind]
        collective = np.array([address, kind, count, root, int(MPI.IN_PLACE), self._rank,
                               words.size, *words.tolist()], np.int64)
        return self.checked(_checked_collective, message, receive,
                            self._header_bytes + 8 * self._size * words.size, collective,
                            datatype=datatype, op=op)

    def broadcast_held(self, message: np.ndarray, receive: np.ndarray,
                       root: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], int] | None:
        """A small broadcast (at most what a mailbox holds) in one compiled call through
        the group's mailboxes, bound to the agreement's messages:
        ``run(fresh_header, source, result)`` runs the exchange's schedule with the
        headers as :meth:`run` does in mode :data:`HEADERS_IF_DIFFERENT`, the bytes of
        group rank ``root`` travelling behind the header of the ranks that hold them,
        into ``result`` on every rank; 0, or :data:`DIFFERENT`.
        None where the group has no mailboxes."""
        if not self._boxes.size:
            return None
        holding = np.array([0, root, int(self._rank == root)], np.int64)
        return self.checked(_broadcast_held, message, receive, self._header_bytes, holding)

    def gather_held(self, message: np.ndarray, receive: np.ndarray, cells: np.ndarray,
                    known: np.ndarray) -> Callable[[np.ndarray, np.ndarray, np.ndarray],
                                                   int] | None:
        """A small gather in one compiled call through the group's mailboxes, bound to
        the agreement's messages: ``run(fresh_header, source, result)`` runs the
        exchange's schedule with the headers as :meth:`run` does in mode
        :data:`HEADERS_IF_DIFFERENT`, each message carrying the cells (words and data,
        laid out as ``cells`` says) its sender knows, into ``result`` on every rank; 0,
        or :data:`DIFFERENT`. None where the group has no mailboxes."""
        if not self._boxes.size:
            return None
        return self.checked(_gather_held, message, receive, self._header_bytes, cells,
                            known)

    def checked(self, compiled: Callable[..., int], message: np.ndarray,
                receive: np.ndarray, length: int, *arguments: np.ndarray,
                datatype: MPI.Datatype = MPI.BYTE, op: MPI.Op = MPI.OP_NULL
                ) -> Callable[..., int]:
        """``compiled`` bound to this group's arrays and to the messages it checks with
        (``length`` bytes of ``message``, received into ``receive``): called as
        ``compiled(plan, handles, *arguments, ...)``, where ``plan`` is what
        :func:`agreed` takes and ``handles`` are the group's communicator, ``MPI_BYTE``,
        ``datatype`` and ``op`` as the MPI library's handles."""
        handles = np.array([self._comm, self._byte, self._functions.handle(datatype),
                            self._functions.handle(op)], self._comm.dtype)
        return functools.partial(compiled, self._plan(message, length, receive, 0), handles,
                                 *arguments)

    def _plan(self, message: np.ndarray, length: int, receive: np.ndarray,
              code: int) -> np.ndarray:
        """Where a compiled call finds its group's arrays and its messages."""
        return np.array([self._state.ctypes.data, self._state.size, self._boxes.ctypes.data,
                         self._boxes.size, self._counters.ctypes.data, self._counters.size,
                         message.ctypes.data, message.size, receive.ctypes.data,
                         receive.size, length, code], np.int64)


def compiled_exchange(group: Group, signature_bytes: int,
                      header_bytes: int) -> CompiledExchange | None:
    """The compiled exchange of ``group``, or None where it is off or cannot run
    (:func:`._native_calls.mpi_functions`)."""
    functions = mpi_functions()
    return None if functions is None else \
        CompiledExchange(group, functions, signature_bytes, header_bytes)
