"""The MPI library's own collective made in the same compiled call as the agreement's
check (:func:`checked_collective_call`): the headers (with a gather's row counts, an
alltoall's splits) are exchanged and checked, then the collective is called, before
the call returns to Python.
"""
from __future__ import annotations

import numba
import numpy as np

from ._c_calls import call_c, stamp, void_pointer
from ._compiled_riding import UNEVEN, words_agree
from ._compiled_steps import (_AT_MESSAGE, _LENGTH, _YIELD, HEADERS_IF_DIFFERENT, PAYLOADS,
                              agreed, plan_arrays)
from ._mailboxes import mailbox_ranks
from ._pairwise import through_mailboxes

ALLREDUCE, BROADCAST, REDUCE_SCATTER, ALLGATHER, ALLTOALL, MAILBOX_ALLGATHER, \
    MAILBOX_ALLTOALL = range(7)
"""The collectives that :func:`checked_collective_call` makes: the MPI library's own, and
the pairwise allgather and alltoall through the group's mailboxes (:mod:`._pairwise`)."""
# Words of a checked collective's description (int64); a gather's or an alltoall's
# words follow.
_FUNCTION, _KIND, _COUNT, _ROOT, _IN_PLACE, _RANK, _WIDTH, _WORDS = range(8)


@numba.njit(cache=True, nogil=True)
def checked_collective_call(plan, handles, collective, stamps, fresh_header, send,
                            receive) -> int:
    """The check of the signatures, then, where every rank's was ours, the MPI library's
    own collective that ``collective`` describes from ``send`` (``MPI_IN_PLACE`` when it
    is ``receive``) into ``receive``, with the datatype and op of ``handles`` (or, for
    :data:`MAILBOX_ALLGATHER` and :data:`MAILBOX_ALLTOALL`, the pairwise exchange of
    blocks of ``count`` bytes through the group's mailboxes):
    :data:`._compiled_steps.DIFFERENT`, :data:`UNEVEN`, 0, or the MPI call's error.

    The headers travel alone, except for a gather and an alltoall: every rank's words
    then ride behind the header (at its rank's place, or'ed into zeros, as
    :class:`..agreement._carried.CarriedGather` sends them), and the collective is made
    only where every rank's words are this rank's.

    Where ``stamps`` are taken (:func:`._c_calls.stamp`), they hold the times of
    the call's start, of the check's end and of the collective's end."""
    stamp(stamps, 0)
    header_bytes, length = fresh_header.size, plan[_LENGTH]
    width = collective[_WIDTH]
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
    stamp(stamps, 1)
    error = _collective(plan, handles, collective, send, receive)
    stamp(stamps, 2)
    return error


@numba.njit(cache=True, nogil=True)
def _collective(plan, handles, collective, send, receive) -> int:
    """The collective of :func:`checked_collective_call`, once checked."""
    kind = collective[_KIND]
    if kind == MAILBOX_ALLGATHER or kind == MAILBOX_ALLTOALL:
        state, boxes, counters, _, _ = plan_arrays(plan)
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
