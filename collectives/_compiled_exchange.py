"""The agreement's exchange in machine code: one call of a Numba-compiled function runs the
whole recursive-doubling schedule of :func:`._recursive_doubling.exchange`, calling the
MPI library's own ``MPI_Sendrecv``, ``MPI_Send`` and ``MPI_Recv``
(:mod:`._native_calls`), and between the steps compares the signatures and combines the
headers or the payloads without returning to Python.

The messages, tags and rule of combining are the Python exchange's, so ranks may use
either; ``RINGTRAIN_COMPILED_EXCHANGE=0`` turns this one off. The Python exchange spends
a few microseconds of interpreter time around each MPI call; this one costs what
``MPI_Sendrecv`` does. It releases the GIL while it runs, as mpi4py's blocking calls do,
so the stall inspector's thread runs while it waits.

Payloads combine here by the operations numpy's ufuncs perform (``np.add``,
``np.minimum``, ``np.maximum``, ``np.multiply`` on the dtypes below, each dtype compiled
when it is first used; ``np.bitwise_or`` on bytes): the same values, except that a
minimum or maximum of +0 and -0 is -0 or +0 whatever the operands' order (numpy returns
its second operand on a tie), so that the ranks' results are bit-identical. Other
combinations (16-bit floats) take the Python exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
from mpi4py import MPI

from ._group import Group
from ._native_calls import MpiFunctions, call_c, mpi_functions
from ._recursive_doubling import TAG, schedule_of

HEADERS_IF_DIFFERENT = 0
"""Combine the headers (elementwise max of int64 words) when the signatures differ."""
HEADERS = 1
"""Combine the headers at every step."""
PAYLOADS = 2
"""Combine the payloads when the signatures are equal, else the headers."""

_OPS: dict[Callable, int] = {np.add: 0, np.minimum: 1, np.maximum: 2, np.multiply: 3}
_BITWISE_OR = -1
_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.uint8, np.int16,
                                          np.int32, np.int64))
_NO_PAYLOAD = np.empty(0, np.uint8)

# Words of the per-group state array (int64); an MPI_Status follows them.
_SENDRECV, _SEND, _RECV, _FOLDED_INTO, _FOLDED_FROM, _SIGNATURE_BYTES, _HEADER_WORDS, \
    _PARTNER_COUNT, _PARTNERS = range(9)


def payload_code(dtype: np.dtype, combine: Callable) -> int | None:
    """How the compiled exchange combines payloads of ``dtype`` by ``combine``, or None
    when it cannot (the Python exchange must)."""
    if combine is np.bitwise_or:
        return _BITWISE_OR
    return _OPS.get(combine) if dtype in _DTYPES else None


@numba.njit(cache=True, nogil=True, inline="always")
def _pick(op: int, a, b):
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
        mine[i] = _pick(op, mine[i], received[i])


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
def _exchange(state, comm, byte, message, length: int, receive, mode: int, op: int,
              mine, received) -> int:
    status = state[_PARTNERS + state[_PARTNER_COUNT]:].ctypes.data
    tag, sent, room = np.int32(TAG), np.int32(length), np.int32(receive.size)
    folded_into, folded_from = state[_FOLDED_INTO], state[_FOLDED_FROM]
    if folded_into >= 0:
        error = call_c(state[_SEND], (message.ctypes.data, sent, byte,
                                      np.int32(folded_into), tag, comm))
        if error == 0:
            error = call_c(state[_RECV], (receive.ctypes.data, room, byte,
                                          np.int32(folded_into), tag, comm, status))
        if error == 0:
            message[:length] = receive[:length]
        return error
    if folded_from >= 0:
        error = call_c(state[_RECV], (receive.ctypes.data, room, byte, np.int32(folded_from),
                                      tag, comm, status))
        if error != 0:
            return error
        _fold(state, message, receive, mode, op, mine, received)
    for step in range(state[_PARTNER_COUNT]):
        partner = np.int32(state[_PARTNERS + step])
        error = call_c(state[_SENDRECV], (message.ctypes.data, sent, byte, partner, tag,
                                          receive.ctypes.data, room, byte, partner, tag,
                                          comm, status))
        if error != 0:
            return error
        _fold(state, message, receive, mode, op, mine, received)
    if folded_from >= 0:
        return call_c(state[_SEND], (message.ctypes.data, sent, byte, np.int32(folded_from),
                                     tag, comm))
    return 0


class CompiledExchange:
    """The compiled exchange of one group, set up once."""

    def __init__(self, group: Group, functions: MpiFunctions, signature_bytes: int,
                 header_bytes: int):
        schedule = schedule_of(group)
        status_words = -(-functions.status_bytes // 8)
        fields = [functions.sendrecv, functions.send, functions.recv,
                  -1 if schedule.folded_into is None else schedule.folded_into,
                  -1 if schedule.folded_from is None else schedule.folded_from,
                  signature_bytes, header_bytes // 8, len(schedule.partners),
                  *schedule.partners]
        self._state = np.array(fields + [0] * status_words, np.int64)
        self._comm = functions.handle(group.comm)
        self._byte = functions.handle(MPI.BYTE)

    def run(self, message: np.ndarray, length: int, receive: np.ndarray, mode: int,
            code: int = 0, mine: np.ndarray = _NO_PAYLOAD,
            received: np.ndarray = _NO_PAYLOAD) -> None:
        """Exchange ``message[:length]`` (uint8) as :func:`._recursive_doubling.exchange`
        does, combining by ``mode``; payloads by ``code`` (from :func:`payload_code`),
        ``mine`` and ``received`` being their typed views in ``message`` and ``receive``.

        Raises:
            MPI.Exception: an MPI call failed.
        """
        error = _exchange(self._state, self._comm, self._byte, message, length, receive,
                          mode, code, mine, received)
        if error:
            raise MPI.Exception(error)


def compiled_exchange(group: Group, signature_bytes: int,
                      header_bytes: int) -> CompiledExchange | None:
    """The compiled exchange of ``group``, or None where it is off or cannot run
    (:func:`._native_calls.mpi_functions`)."""
    functions = mpi_functions()
    return None if functions is None else \
        CompiledExchange(group, functions, signature_bytes, header_bytes)
