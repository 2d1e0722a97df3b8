"""Blocking point-to-point messages in machine code: the steps of :mod:`._p2p_protocol`'s
send and receive as Numba-compiled loops that call the MPI library's own functions
(:mod:`._c_calls`).

A blocking ``send`` or ``recv`` moved alone (:meth:`._p2p_progress.Progress.complete`) takes
its steps here: the sender posts the header (with the data when small) and the data
(when large) and waits for the reply; the receiver takes the header with a matched
probe, compares it with what it expected, posts the receive of the data and its reply,
and waits. The messages are the Python steps' own, so either side may take either
form. Anything but a header that matches the receive, or a reply that accepts the
send, goes back to the Python steps as it stands (a refusal, a header to explain, a
receive that takes its shape from the sender), which raise the error both ranks see.

Each call polls MPI up to :data:`POLLS` times without the GIL and returns, so the
progress loop's waiting (spinning, then yielding the core, then sleeping, and telling the
stall inspector) is the same for both forms.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import numba
import numpy as np
from mpi4py import MPI

from ..transport._c_calls import MpiFunctions, call_c, copy_bytes, mpi_functions, void_pointer
from ..transport._p2p_channels import Channels
from ._p2p_header import FIXED_BYTES, NO_NAME_CHECK, SEQUENCE_WORD

POLLS = 64
"""How many times one compiled call polls MPI before it returns to the waiting loop."""
FIRST_POLLS = 1024
"""How many times a kept plan's call polls (:mod:`._p2p_plans`): a ready peer's reply or
message comes within them, where returning costs building the operation to wait with."""

WAITING = 0
"""Returned: nothing moved in this call's polls."""
MOVED = 1
"""Returned: a step was taken; not done yet."""
DONE = 2
"""Returned: the send was accepted, or the receive's data is in its target."""
REFUSED = 3
"""Returned by a send: the reply is not a plain acceptance (the Python steps take it);
the send's own messages have completed."""
HEADER = 4
"""Returned by a receive: the message (:meth:`CompiledMessages.received`) is not one
the compiled receive accepts; nothing posted (the Python steps take it)."""

# Words of a thread's work buffer (int64, its first bytes): the phase, the number of
# requests in flight, room for int results (flag, count), a message handle and two
# requests (of C width), the functions' addresses and the handles' width (written
# once), the reply byte; then the statuses, and the bytes where a header is received.
_PHASE, _REQUEST_COUNT, _FLAG, _COUNT, _MESSAGE, _REQUESTS = range(6)
_FUNCTIONS = _REQUESTS + 2
_ISEND, _IRECV, _TESTALL, _IPROBE, _IMPROBE, _MRECV, _GET_COUNT, _RECV = \
    range(_FUNCTIONS, _FUNCTIONS + 8)
_HANDLE_BYTES, _REPLY, _STATUSES = range(_FUNCTIONS + 8, _FUNCTIONS + 11)
# The handles array (of the C type): the communicators and the byte datatype.
_MESSAGES, _TRANSFERS, _BYTE = range(3)
_STATUS_WORDS = 16
"""Words kept for two ``MPI_Status`` (their size is checked when the buffer is made)."""
_HEADER_BYTES = (_STATUSES + _STATUS_WORDS) * 8
"""Where the message area starts in the work buffer."""
AREA_BYTES = 4096 + (12 << 10)
"""The message area, where a send builds its first message and a receive takes it: a
header and data inline in its message (``INLINE_MAX_BYTES``). A larger first message
takes the Python steps."""


@numba.njit(cache=True, nogil=True, inline="always")
def _word_address(state, word: int):
    return state[word:].ctypes.data


@numba.njit(cache=True, nogil=True, inline="always")
def _request(state, index: int):
    """The address of request ``index`` (an array of C ``MPI_Request`` from word
    ``_REQUESTS``)."""
    return state[_REQUESTS:].ctypes.data + index * state[_HANDLE_BYTES]


@numba.njit(cache=True, nogil=True, inline="always")
def _statuses(state):
    return state[_STATUSES:].ctypes.data


@numba.njit(cache=True, nogil=True, inline="always")
def _copy(state, target, source) -> None:
    """``target[:] = source`` (bytes)."""
    copy_bytes(target.ctypes.data, source.ctypes.data, source.size)


@numba.njit(cache=True, nogil=True, inline="always")
def _arrived(state, byte, error: int) -> int:
    """After a probe that returned ``error``: minus an MPI error, 0 when no message was
    there, else its bytes plus one."""
    if error != 0:
        return -error
    if np.int32(state[_FLAG]) == 0:
        return 0
    error = call_c(state[_GET_COUNT], (_statuses(state), byte, _word_address(state, _COUNT)))
    if error != 0:
        return -error
    return np.int32(state[_COUNT]) + 1


@numba.njit(cache=True, nogil=True)
def _test_requests(state) -> int:
    """MPI_Testall on the requests in flight: 1 done, 0 not yet, negative an MPI error."""
    error = call_c(state[_TESTALL], (np.int32(state[_REQUEST_COUNT]), _request(state, 0),
                                     _word_address(state, _FLAG), _statuses(state)))
    if error != 0:
        return -error
    return 1 if np.int32(state[_FLAG]) != 0 else 0


@numba.njit(cache=True, nogil=True)
def _send_steps(work, handles, template, data, inline: bool, peer: int, tag: int,
                sequence: int, polls: int) -> int:
    """Take the send's steps (phase 0: build the first message from the header's
    ``template`` and post it, and the data when large; 1: wait for the reply; 2 or 3:
    wait for the posted messages); a WAITING/MOVED/DONE/REFUSED code, or minus an MPI
    error."""
    state = work[:_HEADER_BYTES].view(np.int64)
    messages, transfers, byte = handles[_MESSAGES], handles[_TRANSFERS], handles[_BYTE]
    peer32, reply_tag = np.int32(peer), np.int32(2 * sequence)
    moved = False
    for _ in range(polls):
        phase = state[_PHASE]
        if phase == 0:
            message = work[_HEADER_BYTES:_HEADER_BYTES + template.size +
                           (data.size if inline else 0)]
            _copy(state, message, template)
            message[:FIXED_BYTES].view(np.int64)[SEQUENCE_WORD] = sequence
            if inline:
                _copy(state, message[template.size:], data)
            error = call_c(state[_ISEND], (message.ctypes.data, np.int32(message.size),
                                           byte, peer32, np.int32(tag), messages,
                                           _request(state, 0)))
            if error == 0 and not inline:
                error = call_c(state[_ISEND], (data.ctypes.data, np.int32(data.size), byte,
                                               peer32, np.int32(2 * sequence + 1),
                                               transfers, _request(state, 1)))
            if error != 0:
                return -error
            state[_REQUEST_COUNT] = 1 if inline else 2
            state[_PHASE] = 1
            moved = True
        elif phase == 1:
            arrived = _arrived(state, byte, call_c(state[_IPROBE], (
                peer32, reply_tag, transfers, _word_address(state, _FLAG), _statuses(state))))
            if arrived < 0:
                return arrived
            if arrived == 0:
                continue
            if arrived != 2:  # a refusal, with what differed
                state[_PHASE] = 3
            else:  # the one-byte acceptance
                error = call_c(state[_RECV], (_word_address(state, _REPLY), np.int32(1),
                                              byte, peer32, reply_tag, transfers,
                                              _statuses(state)))
                if error != 0:
                    return -error
                state[_PHASE] = 2
            moved = True
        else:
            done = _test_requests(state)
            if done < 0:
                return done
            if done:
                return DONE if phase == 2 else REFUSED
    return MOVED if moved else WAITING


@numba.njit(cache=True, nogil=True)
def _header_matches(received, expected, data_bytes: int) -> int:
    """The data's offset in ``received`` when its header is the expected one (see
    :func:`._p2p_header.expected_header`) and its length is the header's plus
    ``data_bytes``; else -1."""
    ndim = expected[:FIXED_BYTES].view(np.int64)[3]
    words = expected[:8 * (5 + ndim)].view(np.int64)
    name = expected[8 * (5 + ndim):]
    offset = FIXED_BYTES + 8 * ndim
    if received.size < offset:
        return -1
    header = received[:offset].view(np.int64)
    for i in range(4):
        if header[i] != words[i]:
            return -1
    for i in range(ndim):
        if header[6 + i] != words[4 + i]:
            return -1
    name_length = header[5]
    if words[4 + ndim] != NO_NAME_CHECK:
        if name_length != name.size or received.size < offset + name_length:
            return -1
        for i in range(name_length):
            if received[offset + i] != name[i]:
                return -1
    if name_length > 0:
        offset += name_length + (-name_length % 8)
    return offset if received.size == offset + data_bytes else -1


@numba.njit(cache=True, nogil=True)
def _receive_steps(work, handles, expected, target, peer: int, tag: int,
                   polls: int) -> int:
    """Take the receive's steps (phase 0: take and check the header, post the data's
    receive and the reply; 1: wait for them); a WAITING/MOVED/DONE/HEADER code, or
    minus an MPI error. With HEADER the message is in the receive area (its length in
    the count word) unless it is larger (then it is matched, not received: phase 2)."""
    state = work[:_HEADER_BYTES].view(np.int64)
    area = work[_HEADER_BYTES:]
    messages, transfers, byte = handles[_MESSAGES], handles[_TRANSFERS], handles[_BYTE]
    peer32 = np.int32(peer)
    moved = False
    for _ in range(polls):
        if state[_PHASE] == 1:
            done = _test_requests(state)
            if done < 0:
                return done
            if done:
                return DONE
            continue
        arrived = _arrived(state, byte, call_c(state[_IMPROBE], (
            peer32, np.int32(tag), messages, _word_address(state, _FLAG),
            _word_address(state, _MESSAGE), _statuses(state))))
        if arrived < 0:
            return arrived
        if arrived == 0:
            continue
        count = np.int32(arrived - 1)
        state[_COUNT] = count
        if count > area.size:
            state[_PHASE] = 2
            return HEADER
        error = call_c(state[_MRECV], (area.ctypes.data, count, byte,
                                       _word_address(state, _MESSAGE), _statuses(state)))
        if error != 0:
            return -error
        received = area[:count]
        inline = expected[8:16].view(np.int64)[0] != 0
        offset = _header_matches(received, expected, target.size if inline else 0)
        if offset < 0:
            return HEADER
        sequence = received[:FIXED_BYTES].view(np.int64)[SEQUENCE_WORD]
        requests = 0
        if inline:
            _copy(state, target, received[offset:])
        else:
            error = call_c(state[_IRECV], (target.ctypes.data, np.int32(target.size), byte,
                                           peer32, np.int32(2 * sequence + 1), transfers,
                                           _request(state, 0)))
            if error != 0:
                return -error
            requests = 1
        state[_REPLY] = 0
        error = call_c(state[_ISEND], (_word_address(state, _REPLY), np.int32(1), byte,
                                       peer32, np.int32(2 * sequence), transfers,
                                       _request(state, requests)))
        if error != 0:
            return -error
        state[_REQUEST_COUNT] = requests + 1
        state[_PHASE] = 1
        moved = True
    return MOVED if moved else WAITING


@numba.njit(cache=True, nogil=True)
def _send_planned(handles, words, work, data, count: int) -> int:
    """:func:`_send_steps` of a new send, the ``count``-th to its peer, with the
    arguments a plan keeps in ``words`` (the template's address and bytes, inline,
    peer, tag, polls, the number of sequence numbers): fewer for the dispatcher to
    check at every call."""
    work[:_HEADER_BYTES].view(np.int64)[_PHASE] = 0
    template = numba.carray(void_pointer(words[0]), words[1], np.uint8)
    return _send_steps(work, handles, template, data, words[2] != 0, words[3], words[4],
                       count % words[6], words[5])


@numba.njit(cache=True, nogil=True)
def _receive_planned(handles, words, work, target) -> int:
    """:func:`_receive_steps` of a new receive, with the arguments a plan keeps in
    ``words`` (the expected header's address and bytes, peer, tag, polls)."""
    work[:_HEADER_BYTES].view(np.int64)[_PHASE] = 0
    expected = numba.carray(void_pointer(words[0]), words[1], np.uint8)
    return _receive_steps(work, handles, expected, target, words[2], words[3], words[4])


@numba.njit(cache=True, nogil=True)
def _receive_matched(work, handles, buffer) -> int:
    """Receive the message a HEADER left matched into ``buffer``; 0 or an MPI error."""
    state = work[:_HEADER_BYTES].view(np.int64)
    return call_c(state[_MRECV], (buffer.ctypes.data, np.int32(buffer.size),
                                  handles[_BYTE], _word_address(state, _MESSAGE),
                                  _statuses(state)))


class CompiledMessages:
    """The compiled steps over one group's point-to-point communicators.

    Each thread has its own work buffer (a blocking call is the only one its thread
    moves until it returns).
    """

    def __init__(self, channels: Channels, functions: MpiFunctions):
        words = np.zeros(_HEADER_BYTES // 8, np.int64)
        words[_ISEND:_RECV + 1] = [functions.isend, functions.irecv, functions.testall,
                                   functions.iprobe, functions.improbe, functions.mrecv,
                                   functions.get_count, functions.recv]
        words[_HANDLE_BYTES] = functions.handle_dtype.itemsize
        self._first_words = words
        self._handles = np.array([functions.handle(channels.messages),
                                  functions.handle(channels.transfers),
                                  functions.handle(MPI.BYTE)], functions.handle_dtype)
        self._local = threading.local()

    def begin(self) -> np.ndarray:
        """This thread's work buffer, set for a new call."""
        work = self.work()
        work[:_HEADER_BYTES].view(np.int64)[_PHASE] = 0
        return work

    def work(self) -> np.ndarray:
        """This thread's work buffer as the last call left it (a planned call sets it
        for a new call itself)."""
        try:
            return self._local.work
        except AttributeError:
            work = np.zeros(_HEADER_BYTES + AREA_BYTES, np.uint8)
            work[:_HEADER_BYTES].view(np.int64)[:] = self._first_words
            self._local.work = work
            return work

    def send_steps(self, work: np.ndarray, template: np.ndarray, data: np.ndarray,
                   inline: bool, peer: int, tag: int, sequence: int) -> int:
        """Take the send's steps (``template``: its header with sequence number 0;
        ``data``: bytes, in the first message when ``inline``); WAITING, MOVED, DONE or
        REFUSED.

        Raises:
            MPI.Exception: an MPI call failed.
        """
        return _checked(_send_steps(work, self._handles, template, data, inline, peer, tag,
                                    sequence, POLLS))

    def receive_steps(self, work: np.ndarray, expected: np.ndarray, target: np.ndarray,
                      peer: int, tag: int) -> int:
        """Take the receive's steps into ``target`` (bytes); WAITING, MOVED, DONE or
        HEADER (then :meth:`received` gives the message).

        Raises:
            MPI.Exception: an MPI call failed.
        """
        return _checked(_receive_steps(work, self._handles, expected, target, peer, tag,
                                       POLLS))

    def planned_send(self, template: np.ndarray, inline: bool, peer: int, tag: int,
                     polls: int, sequences: int) -> Callable[[np.ndarray, np.ndarray, int], int]:
        """:meth:`send_steps` with all but the work buffer, the data and the message's
        count bound (its sequence number is the count modulo ``sequences``:
        :attr:`._p2p_channels.Channels.sent`), as a kept plan calls them
        (:mod:`._p2p_plans`), for a new send in :meth:`work`; the call returns the code,
        or minus an MPI error (not raised)."""
        return _bound(_send_planned, self._handles,
                      [template.ctypes.data, template.size, inline, peer, tag, polls,
                       sequences], template)

    def planned_receive(self, expected: np.ndarray, peer: int, tag: int,
                        polls: int) -> Callable[[np.ndarray, np.ndarray], int]:
        """:meth:`receive_steps` with all but the work buffer and the target bound, for
        a new receive in :meth:`work`; the call returns the code, or minus an MPI error
        (not raised)."""
        return _bound(_receive_planned, self._handles,
                      [expected.ctypes.data, expected.size, peer, tag, polls], expected)

    def received(self, work: np.ndarray) -> np.ndarray:
        """The message a receive's HEADER left (a copy).

        Raises:
            MPI.Exception: an MPI call failed.
        """
        state = work[:_HEADER_BYTES].view(np.int64)
        count = int(state[_COUNT])
        if state[_PHASE] != 2:
            return work[_HEADER_BYTES:_HEADER_BYTES + count].copy()
        message = np.empty(count, np.uint8)
        _checked(-_receive_matched(work, self._handles, message))
        return message


def _bound(function: Callable[..., int], handles: np.ndarray, words: list[int],
           kept: np.ndarray) -> Callable[..., int]:
    """``function`` with ``handles`` and ``words`` bound; the result keeps ``kept``
    alive, whose address ``words`` hold."""
    bound = functools.partial(function, handles, np.array(words, np.int64))
    bound.kept = kept  # type: ignore[attr-defined]
    return bound


def _checked(code: int) -> int:
    if code < 0:
        raise MPI.Exception(-code)
    return code


def compiled_messages(channels: Channels) -> CompiledMessages | None:
    """``channels``' compiled steps (built at first use), or None where compiled calls
    are off or cannot run (:func:`._c_calls.mpi_functions`)."""
    compiled = channels.compiled
    if compiled is None:
        functions = mpi_functions()
        if functions is None or 2 * functions.status_bytes > 8 * _STATUS_WORDS:
            return None
        compiled = channels.compiled = CompiledMessages(channels, functions)
    return compiled


def fits(first_bytes: int, data_bytes: int) -> bool:
    """Whether a message can take the compiled steps: its first message (header, and
    data inline) of ``first_bytes`` in the message area, its data a count MPI's C
    ``int`` holds."""
    return first_bytes <= AREA_BYTES and data_bytes < 2 ** 31 - 1
