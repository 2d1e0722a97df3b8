"""Small collectives riding in the agreement's own messages: header and payload travel
together and are combined at each step, so the check costs no extra round trip. An
allreduce combines its payloads by its op (:class:`CarriedReduction`); a broadcast
(:class:`CarriedBroadcast`), an allgather (each rank's rows at its own offset) and a
reducescatter (the whole array, each rank keeping its rows) use the same exchange
(:class:`CarriedGather`); through a node's mailboxes a broadcast's and a gather's
messages carry only the data their sender holds. Receive buffers hold
``PAYLOAD_CAPACITY`` bytes on every rank whatever the local settings, so a rank sending
a different size still cannot overflow its partner, and payloads are combined only
when the headers agree.

Over shared memory a step costs a copy and a cache line's trip between cores, less than
the MPI library's own small allreduce; a small allreduce is then one compiled call.
Handing the payload to ``MPI_Allreduce`` with a user-defined reduction would cost what
that call costs, and it could not bound what a mismatched rank sends.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from ...kernels import is_floating, scale_into
from ...kernels.elementwise import factors_for
from ...kernels.reduction import Combine, compiled_dtype, compiled_view
from .. import timeline
from ..base._activity import ACTIVITY
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._tracing import phase
from ..transport._compiled_riding import (ALL_WORDS, CELL_DATA, cells_length, pack_cells,
                                          unpack_cells, words_agree)
from ..transport._compiled_steps import DIFFERENT, payload_code
from ..transport._mailboxes import mailboxes_of
from ._agreement import (DISAGREED, Buffers, buffers_of, enter, exchange_carrying,
                         exchange_through_mailboxes, until_agreed)
from ._call import BYTES, HEADER_BYTES, PAYLOAD_CAPACITY, Call
from ._checked import CheckedCollective


class CarriedReduction:
    """A small allreduce whose payload rides in the agreement's own messages, set up
    once for one kind of call: ``count`` elements of ``dtype`` (at most
    ``PAYLOAD_CAPACITY`` bytes) combined by ``combine`` (``combine(a, b, out=a)``), then
    finished by ``finish`` (None: nothing to do). Payloads are combined only where the
    headers agree. A broadcast rides this way too, as bytes: the root's, or'ed with the
    others' zeros.

    Where the group has the compiled exchange and it combines ``dtype`` by ``combine``,
    a call is one call of machine code: it fills the message, exchanges, checks the
    signatures and writes the finished result. Otherwise the exchange runs in Python,
    the same messages: the results are the same either way.
    """

    __slots__ = ("group", "call", "_buffers", "_views", "_combine", "_finish", "_reduce",
                 "_code", "_factors", "_prescale", "_floating", "_bits")

    def __init__(self, group: Group, call: Call, dtype: np.dtype, count: int,
                 combine: Combine, finish: Finisher | None):
        self.group, self.call = group, call
        self._buffers = buffers = buffers_of(group)
        self._views = buffers.payload(dtype, count)
        self._combine, self._finish = combine, finish
        self._code = code = None if buffers.compiled is None else payload_code(dtype, combine)
        self._reduce = None if code is None else buffers.compiled.reduction(
            buffers.message, self._views.message.nbytes, buffers.receive, code)
        divisor, postscale = (1, 1.0) if finish is None else \
            (finish.divisor, finish.postscale_factor)
        self._factors = factors_for(code or 0, dtype, (1.0, divisor, postscale))
        self._prescale = 1.0
        self._floating = is_floating(dtype)
        self._bits = compiled_dtype(dtype) != dtype

    def run(self, source: np.ndarray, result: np.ndarray, prescale_factor: float) -> None:
        """Agree on the call while allreducing C-contiguous ``source`` (multiplied by
        ``prescale_factor``) into C-contiguous ``result`` (may be ``source``).

        Raises:
            MismatchError: on every rank, when any rank's call differs.
        """
        if source.ndim != 1:
            source, result = source.reshape(-1), result.reshape(-1)
        call = enter(self.group, self.call)
        try:
            if timeline.ACTIVE is None:  # no phase to record: no context to enter
                agreed = self._step(call, source, result, prescale_factor)
            else:
                with phase("wait for ranks"):
                    agreed = self._step(call, source, result, prescale_factor)
            if agreed is DISAGREED:
                with phase("wait for ranks"):
                    until_agreed(self.group, call, self._buffers,
                                 lambda _, made: self._step(made, source, result,
                                                            prescale_factor),
                                 agreed)
        finally:
            ACTIVITY.agreed()

    def _step(self, call: Call, source: np.ndarray, result: np.ndarray,
              prescale_factor: float) -> Any:
        """One exchange: ``result``, or ``DISAGREED`` when some rank's call differs."""
        reduce = self._reduce
        if reduce is not None and (prescale_factor == 1.0 or self._floating):
            if prescale_factor != self._prescale:
                self._prescale = prescale_factor
                self._factors[0] = factors_for(self._code, self._factors.dtype,
                                               (prescale_factor,))[0]
            if self._bits:
                source, result = compiled_view(source), compiled_view(result)
            status = reduce(call.fresh_array, self._factors, source, result)
            if status == 0:
                return result
            if status == DIFFERENT:
                return DISAGREED
            raise MPI.Exception(status)
        combined = exchange_carrying(self.group, call, self._buffers, self._views,
                                     lambda data: scale_into(source, prescale_factor, data),
                                     self._combine)
        if combined is DISAGREED:
            return combined
        if self._finish is None:
            np.copyto(result, combined)
        else:
            self._finish.into(combined, result)
        return result


class CarriedBroadcast:
    """A small broadcast riding in the agreement, set up once for one kind of call:
    ``nbytes`` (at most ``PAYLOAD_CAPACITY``) from group rank ``root``.

    Through the node's mailboxes, in the exchange's schedule, only the ranks that already
    hold the root's bytes send them behind their header, and a rank takes them from a
    partner whose call is its own: one compiled call
    (:meth:`..transport._compiled_exchange.CompiledExchange.broadcast_held`), which copies them
    once, from the mailbox into the result; or the same messages from Python
    (:class:`_HeldTransport`). Elsewhere the bytes travel as a :class:`CarriedReduction`
    of bytes: the root's, or'ed with the others' zeros.
    """

    __slots__ = ("group", "_buffers", "_mailboxes", "_held", "_reduction", "_zeros",
                 "_root", "_root_rank")

    def __init__(self, group: Group, call: Call, nbytes: int, root: int):
        self.group = group
        self._buffers = buffers = buffers_of(group)
        self._mailboxes = mailboxes_of(group)
        self._root, self._root_rank = group.rank == root, root
        if self._mailboxes is None:
            self._reduction = CarriedReduction(group, call, BYTES, nbytes, np.bitwise_or, None)
            self._zeros = np.zeros(0 if self._root else nbytes, np.uint8)
            return
        held = None if buffers.compiled is None else \
            buffers.compiled.broadcast_held(buffers.message, buffers.receive, root)
        self._held = CheckedCollective(group, call, buffers, held or self._held_in_python, 0)

    def run(self, source: np.ndarray, result: np.ndarray) -> None:
        """Agree on the call while broadcasting the root's ``source`` into ``result``
        (1-D uint8 arrays, ``result`` may be ``source``; only the root's ``source`` is
        read).

        Raises:
            MismatchError: on every rank, when any rank's call differs.
        """
        if self._mailboxes is not None:
            self._held.run(source, result)
        else:
            self._reduction.run(source if self._root else self._zeros, result, 1.0)

    def _held_in_python(self, fresh_header: np.ndarray, source: np.ndarray,
                        result: np.ndarray) -> int:
        if self._root and source.ctypes.data != result.ctypes.data:
            result[:] = source
        buffers = self._buffers
        return exchange_through_mailboxes(
            self.group, buffers, fresh_header, buffers.alone, buffers.combine_differing,
            _HeldTransport(self._mailboxes, buffers, result, self._root, self._root_rank))


class _MailboxTransport:
    """The mailboxes as :func:`..transport._recursive_doubling.exchange` sees them when a call's
    data rides behind the header: subclasses make each message and take each one
    received."""

    def __init__(self, mailboxes: Any, buffers: Buffers):
        self._mailboxes, self._buffers = mailboxes, buffers

    def Send(self, message: np.ndarray, destination: int, tag: int = 0) -> None:
        raise NotImplementedError

    def Recv(self, receive: np.ndarray, source: int, tag: int = 0) -> None:
        raise NotImplementedError

    def Sendrecv(self, message: np.ndarray, destination: int, sendtag: int,
                 receive: np.ndarray, source: int, recvtag: int) -> None:
        self.Send(message, destination)
        self.Recv(receive, source)

    def _same_call(self) -> bool:
        """Whether the message just received was sent by a rank whose signature is ours."""
        return self._buffers.received_signature == self._buffers.signature


class _CellTransport(_MailboxTransport):
    """A gather's messages from Python, as the compiled gather sends them: the header and
    the words (the message given), then, where the gather carries data, the data of the
    ranks ``known`` (:func:`..transport._compiled_riding.pack_cells`); a received message's data
    taken into ``result`` where the partner's signature is this rank's."""

    def __init__(self, mailboxes: Any, buffers: Buffers, cells: np.ndarray,
                 known: np.ndarray, result: np.ndarray):
        super().__init__(mailboxes, buffers)
        self._cells, self._known, self._result = cells, known, result

    def Send(self, message: np.ndarray, destination: int, tag: int = 0) -> None:
        length = message.nbytes
        if self._cells[CELL_DATA]:
            pack_cells(message.ctypes.data + length, self._cells, self._known, self._result)
            length += cells_length(self._cells, self._known)
        self._mailboxes.Send(self._buffers.message[:length], destination)

    def Recv(self, receive: np.ndarray, source: int, tag: int = 0) -> None:
        length = min(self._mailboxes.Recv(receive, source), receive.size)
        head = HEADER_BYTES + int(self._cells[ALL_WORDS])
        if self._cells[CELL_DATA] and length > head and self._same_call():
            unpack_cells(receive.ctypes.data + head, length - head, self._cells,
                         self._known, self._result)


class _HeldTransport(_MailboxTransport):
    """The mailboxes as :func:`..transport._recursive_doubling.exchange` sees them in a broadcast
    riding in Python, sending what the compiled broadcast sends: the header, followed by
    ``result`` where this rank holds the root's bytes (but to the root, group rank
    ``root``); a received message's bytes are taken into ``result`` where this rank
    holds none yet and the partner's signature is this rank's."""

    def __init__(self, mailboxes: Any, buffers: Buffers, result: np.ndarray, holds: bool,
                 root: int):
        super().__init__(mailboxes, buffers)
        self._result, self._holds, self._root = result, holds, root

    def Send(self, message: np.ndarray, destination: int, tag: int = 0) -> None:
        length = HEADER_BYTES
        if self._holds and destination != self._root:
            length += self._result.size
            self._buffers.message[HEADER_BYTES:length] = self._result
        self._mailboxes.Send(self._buffers.message[:length], destination)

    def Recv(self, receive: np.ndarray, source: int, tag: int = 0) -> None:
        length = self._mailboxes.Recv(receive, source)
        count = self._result.size
        if not self._holds and length == HEADER_BYTES + count and self._same_call():
            self._result[:] = receive[HEADER_BYTES:HEADER_BYTES + count]
            self._holds = True


class CarriedGather:
    """A small gather riding in the agreement, set up once for one kind of call: every
    rank's ``width`` int64 words, and its ``data_bytes`` bytes of data where every
    rank's data fits in the payload (else none is carried).

    The result holds every rank's words, then every rank's data at the offset it would
    have if every rank gave as many bytes as this one. Each rank puts its words into
    zeros, and the ranks combine them by bitwise or at every step. Through the node's
    mailboxes each message then carries the data its sender knows by then, and a rank
    takes what it lacks from a partner whose call is its own: one compiled call
    (:meth:`..transport._compiled_exchange.CompiledExchange.gather_held`), or the same messages from
    Python (:class:`_CellTransport`). Elsewhere the data is or'ed too, each rank's at its
    place in zeros (a :class:`CarriedReduction` of bytes).

    Attributes:
        carries_data: whether the data rides along.
        data_offset: where the data starts in a result of :meth:`run`.
    """

    __slots__ = ("carries_data", "data_offset", "group", "_reduction", "_held", "_buffers",
                 "_mailboxes", "_cells", "_known", "_source", "_words", "_own", "_shape",
                 "_given")

    def __init__(self, group: Group, call: Call, width: int, data_bytes: int):
        size, rank = group.size, group.rank
        self.group = group
        self._buffers = buffers = buffers_of(group)
        word_bytes = 8 * size * width
        self._mailboxes = mailboxes_of(group)
        # Through the mailboxes the data is preceded by a count and the ranks it is of.
        room = PAYLOAD_CAPACITY - (0 if self._mailboxes is None else 16 + 8 * size)
        self.carries_data = 0 < data_bytes and word_bytes + size * data_bytes <= room
        mine = data_bytes if self.carries_data else 0
        total = word_bytes + size * mine
        self._source = np.zeros(total, np.uint8)
        self._words = self._source[:word_bytes].view(np.int64)[rank * width:
                                                               (rank + 1) * width]
        self._own = slice(word_bytes + rank * mine, word_bytes + (rank + 1) * mine)
        self._shape, self.data_offset = (size, width), word_bytes
        self._given: np.ndarray | None = None
        self._held: CheckedCollective | None = None
        if self._mailboxes is None:
            self._reduction = CarriedReduction(group, call, BYTES, total, np.bitwise_or, None)
            return
        self._cells = np.array([rank, mine, word_bytes], np.int64)
        self._known = np.zeros(size, np.uint8)
        held = None if buffers.compiled is None else buffers.compiled.gather_held(
            buffers.message, buffers.receive, self._cells, self._known)
        self._held = CheckedCollective(group, call, buffers, held or self._held_in_python,
                                       width)

    def _held_in_python(self, fresh_header: np.ndarray, source: np.ndarray,
                        result: np.ndarray) -> int:
        rank, _, all_words = self._cells.tolist()
        buffers, known = self._buffers, self._known
        known[:] = 0
        known[rank] = 1
        words = buffers.message[HEADER_BYTES:HEADER_BYTES + all_words]
        received = buffers.receive[HEADER_BYTES:HEADER_BYTES + all_words]
        words[:] = source[:all_words]

        def fold(*_: Any) -> None:
            if buffers.received_signature == buffers.signature:
                np.bitwise_or(words, received, out=words)
            else:
                buffers.combine_headers()

        verdict = exchange_through_mailboxes(
            self.group, buffers, fresh_header, buffers.message[:HEADER_BYTES + all_words],
            fold, _CellTransport(self._mailboxes, buffers, self._cells, known, result))
        result[:all_words] = words
        if verdict == 0:
            return words_agree(words.view(np.int64), rank, self._shape[1])
        return verdict

    def run(self, words: np.ndarray,
            data: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Check that every rank made the same call while gathering ``words`` (int64,
        ``width`` of them; not copied again when it is the array given last, so an array
        given again must not have changed) and ``data`` (bytes, ``data_bytes`` of them;
        unused when it does not ride along) from every rank.

        Returns:
            Every rank's words (ranks x width, a new array), or None where every rank's
            words are this rank's; and a new byte array whose data part, from
            ``data_offset`` on, holds every rank's data (ranks x data bytes), or None
            where no data rides along. The data part holds every rank's data only where
            every rank gave as many bytes: the caller tells from the words.

        Raises:
            MismatchError: on every rank, when any rank's call differs.
        """
        if words is not self._given:
            self._words[:] = words
            self._given = words
        result = np.empty(self._source.size, np.uint8)
        if self._held is not None:
            if self.carries_data:  # this rank's data goes straight to its place
                result[self._own] = data
            every = self._held.run(self._source, result)
        else:
            if self.carries_data:
                self._source[self._own] = data
            self._reduction.run(self._source, result, 1.0)
            words = result[:self.data_offset].view(np.int64)
            every = None if words_agree(words, self.group.rank, self._shape[1]) == 0 else \
                words.reshape(self._shape)
        return every, result if self.carries_data else None
