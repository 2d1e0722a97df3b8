"""Small collectives riding behind the agreement's headers through the node's mailboxes,
in machine code: a broadcast (:func:`broadcast_held`) and a gather (:func:`gather_held`)
run the exchange's schedule (:func:`._compiled_steps.exchange`) with the headers, each
message carrying only the data its sender holds by then, copied straight between the
mailbox and the caller's arrays, and taken only from a partner whose signature is the
taker's own.
"""
from __future__ import annotations

import numba
import numpy as np

from ._c_calls import copy_bytes, void_pointer
from ._compiled_steps import (_BITWISE_OR, _FOLDED_FROM, _FOLDED_INTO, _HEADER_WORDS,
                              _PARTNER_COUNT, _PARTNERS, _YIELD, DIFFERENT,
                              HEADERS_IF_DIFFERENT, PAYLOADS, fold, plan_arrays,
                              same_signature)
from ._mailboxes import (mailbox_arrival, mailbox_claim, mailbox_consume, mailbox_data,
                         mailbox_length, mailbox_publish)

UNEVEN = -2
"""What :func:`gather_held` and :func:`._compiled_checked.checked_collective_call` return
when every rank's signature was the same but the words of a gather or an alltoall
differed (every rank's words are then in the message's payload)."""


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
    same = same_signature(state, message, receive)
    if same and not holds and mailbox_length(boxes, base) == header_bytes + data.size:
        copy_bytes(data.ctypes.data, at + header_bytes, data.size)
        holds = True
    mailbox_consume(boxes, counters, peer, base)
    if adopt:
        copy_bytes(message.ctypes.data, receive.ctypes.data, header_bytes)
    else:
        # np.int64: one compilation for every value (see _compiled_steps._reduce).
        fold(state, message, receive, np.int64(HEADERS_IF_DIFFERENT), np.int64(0), message[:0],
             receive[:0], False)
    return holds


@numba.njit(cache=True, nogil=True)
def broadcast_held(plan, handles, holding, fresh_header, source, result) -> int:
    """A whole small broadcast through the mailboxes, in the agreement's schedule and
    with its headers: the root's ``source`` (bytes) into every rank's ``result`` (may be
    ``source``); ``holding`` (int64) is scratch for whether this rank holds the bytes,
    then the root's group rank and whether this rank is the root. Only ranks
    that hold the data by then send it (never to the root), and a rank takes it only
    from a partner whose signature is its own, straight into ``result``: 0, or
    :data:`DIFFERENT` when some rank's signature differed (``result`` then unspecified
    but for the root's)."""
    state, boxes, counters, message, receive = plan_arrays(plan)
    header_bytes = fresh_header.size
    copy_bytes(message.ctypes.data, fresh_header.ctypes.data, header_bytes)
    holding[0] = holding[2]
    if holding[2] and source.ctypes.data != result.ctypes.data:
        copy_bytes(result.ctypes.data, source.ctypes.data, result.size)
    _walk_riding(state, boxes, counters, message, receive, header_bytes, _RIDE_BROADCAST,
                 holding, holding, result)
    if not same_signature(state, message, fresh_header):
        return DIFFERENT
    return 0


_RIDE_BROADCAST, _RIDE_GATHER = range(2)
"""What rides behind the headers in :func:`_walk_riding`."""


@numba.njit(cache=True, nogil=True)
def _walk_riding(state, boxes, counters, message, receive, head_bytes: int, kind: int,
                 cells, known, result) -> None:
    """The exchange's schedule (:func:`._compiled_steps.exchange`) with data riding behind the first
    ``head_bytes`` of ``message``: a broadcast's (``kind`` :data:`_RIDE_BROADCAST`;
    ``known``: whether this rank holds the root's bytes, then the root's rank) or a
    gather's (:data:`_RIDE_GATHER`; ``cells`` and ``known`` as :func:`gather_held`
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
    same = same_signature(state, message, receive)
    if same and cells[CELL_DATA] and length > head_bytes:
        unpack_cells(at + head_bytes, length - head_bytes, cells, known, result)
    mailbox_consume(boxes, counters, peer, base)
    if adopt:
        copy_bytes(message.ctypes.data, receive.ctypes.data, head_bytes)
    else:
        header_bytes = 8 * state[_HEADER_WORDS]
        fold(state, message, receive, np.int64(PAYLOADS), np.int64(_BITWISE_OR),
             message[header_bytes:head_bytes], receive[header_bytes:head_bytes], False)


@numba.njit(cache=True, nogil=True)
def gather_held(plan, handles, cells, known, fresh_header, source, result) -> int:
    """A whole small gather through the mailboxes, in the agreement's schedule and with
    its headers: ``source`` and ``result`` laid out as a gather's result (every rank's
    words, then every rank's data), ``source`` holding this rank's words at their place
    and zeros in the other ranks' words, ``result`` already holding this rank's data at
    its place. The words travel as
    :func:`._compiled_checked.checked_collective_call` sends them (every rank's, combined by
    bitwise or at every step); behind them each message carries the data its sender
    knows by then (``known``: scratch, one byte per rank), which a rank takes from a
    partner whose signature is its own. 0 where every rank's words are this rank's,
    :data:`UNEVEN` where some differ (every rank's data has arrived all the same), or
    :data:`DIFFERENT` when some rank's signature differed (``result`` then
    unspecified)."""
    state, boxes, counters, message, receive = plan_arrays(plan)
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
    if not same_signature(state, message, fresh_header):
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
