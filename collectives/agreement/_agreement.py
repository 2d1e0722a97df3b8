"""Agreement: before any data moves, all ranks check they called the same collective alike.

Every collective starts with one recursive-doubling exchange of a 40-byte header of
int64s combined by elementwise max. Its first two fields are ``[signature,
-signature]``, so that every rank ends with the largest and (minus) the smallest
signature of the group. They differ exactly when
some rank's call differs, and then every rank knows it at the same moment: all of them
gather the ranks' descriptions of their calls (pickled, on this error path only) and
raise the same :class:`~ringtrain.MismatchError`. No data message has been sent, so the
library keeps working afterwards.

Two kinds of call wait rather than fail when they meet another (see :func:`resolve`): a
barrier keeps waiting while the collective the other ranks made fails, and a rank that
joined (:mod:`._join`) makes an allreduce the others made again, with zeros, while they
exchange their headers once more.

Named calls that threads made in different orders are matched by name on the same error
path (:mod:`._name_matching`): the call every rank made or has waiting runs first. An
unnamed call made by a thread other than the main one carries the thread's name in its
signature (:meth:`Call.made_by`), so the unnamed calls of two threads never meet.

The signature hashes everything that decides which messages follow (collective, tensor
name, dtype, shape, op, root, algorithm, segment size), so a mismatch can never turn
into a hang or a truncated message.

The other three fields carry what a compressed allreduce must know of all ranks before
it casts: the largest finite magnitude (a non-negative float64 orders like its int64
bits) and the highest and lowest rank whose values hold inf or NaN.

Small collectives ride in the same messages (:class:`CarriedReduction`,
:class:`CarriedBroadcast`, :class:`CarriedGather`): header and payload travel together
and are combined at each step, so the check costs no extra round trip. An allreduce
combines its payloads by its op; a broadcast, an allgather (each rank's rows at its own
offset) and a reducescatter (the whole array, each rank keeping its rows) use the same
exchange; through a node's mailboxes a broadcast's and a gather's messages carry only the
data their sender holds. Receive buffers
hold ``PAYLOAD_CAPACITY`` bytes on every rank whatever the local settings, so a rank
sending a different size still cannot overflow its partner, and payloads are combined
only when the headers agree.

The exchange runs as compiled code (:mod:`._compiled_exchange`) where it can, and its
messages pass through shared memory where all the group's ranks share a node
(:mod:`._mailboxes`), else through the MPI library's own point-to-point calls. Over
shared memory a step costs a copy and a cache line's trip between cores, less than the
MPI library's own small allreduce; a small allreduce (:class:`CarriedReduction`) is then
one compiled call. Handing the payload to ``MPI_Allreduce`` with a user-defined
reduction would cost what that call costs, and it could not bound what a mismatched rank
sends. Larger calls that MPI's own collective moves make it in the same compiled call
once the headers have agreed (:class:`CheckedCollective`).
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from ...kernels import is_floating, scale_into
from ...kernels.reduction import Combine
from .. import timeline
from ..algorithms._compiled_ring import checked_ring as compiled_ring
from ..base._activity import ACTIVITY
from ..base._executor import MAIN_THREAD, TURN
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._tracing import phase
from ..errors import ABSENT, MismatchError, UsageError, format_ranks, subject
from ..transport import _recursive_doubling
from ..transport._compiled_exchange import (DIFFERENT, HEADERS, HEADERS_IF_DIFFERENT, PAYLOADS,
                                            UNEVEN, ALL_WORDS, CELL_DATA, CompiledExchange,
                                            cells_length, compiled_exchange, pack_cells,
                                            payload_code, unpack_cells, words_agree)
from ..transport._mailboxes import mailboxes_of
from ..world._world import world
from . import _name_matching
from ._name_matching import Order

HEADER_BYTES = 40
SIGNATURE_BYTES = 16
PAYLOAD_CAPACITY = 128 * 1024
"""Largest payload that travels with the header (fixed: part of the protocol)."""
BYTES = np.dtype(np.uint8)
"""The dtype of payloads that are bytes (combined by bitwise or)."""

_SIGNATURE_MASK = (1 << 62) - 1
_CALLS_KEPT = 4096
_calls_made: dict[tuple, Call] = {}
_DIFFERENT = object()


class Call:
    """A collective call as the ranks compare it.

    Calls are kept by their fields (``Call(**fields)`` returns the one made before with
    equal fields): the signature of a call repeated every step is computed once.

    Attributes:
        fields: the call's fields by name, starting with ``collective`` and ``name``;
            shown, rank by rank, in the error message.
        signature: a 62-bit digest of the fields, the same on every rank and every run.
        header_bytes: this call's signature fields, ``[signature, -signature]`` as int64.
        fresh_header: the whole header this call starts its exchange with.
        fresh_array: ``fresh_header`` as a (read-only) uint8 array.
    """

    __slots__ = ("fields", "signature", "header_bytes", "fresh_header", "fresh_array",
                 "threaded", "_by_thread")

    def __new__(cls, **fields: Any) -> Call:
        try:
            # Equal but differently printed values (1 and 1.0, a dtype and its name)
            # would share a signature: the caller's tensor name is the only field not
            # of ringtrain's making.
            key: tuple | None = (type(fields.get("name")), *fields.items())
            made = _calls_made.get(key)
        except TypeError:  # an unhashable field: not kept
            key, made = None, None
        if made is None:
            made = super().__new__(cls)
            made._describe(fields)
            if key is not None:
                if len(_calls_made) >= _CALLS_KEPT:
                    _calls_made.clear()
                _calls_made[key] = made
        return made

    def _describe(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        digest = hashlib.blake2b(repr(tuple(fields.items())).encode(), digest_size=8).digest()
        self.signature = int.from_bytes(digest, "little") & _SIGNATURE_MASK
        self.header_bytes = struct.pack("<2q", self.signature, -self.signature)
        self.fresh_header = self.header_bytes + _NO_RANGE.tobytes()
        self.fresh_array = np.frombuffer(self.fresh_header, np.uint8)
        self.threaded = fields.get("name") is None and "thread" not in fields and \
            _carries_data(fields.get("collective", ""))
        self._by_thread: dict[str, Call] = {}

    def made_by(self, thread: threading.Thread) -> Call:
        """This call as ``thread`` made it: an unnamed call made by a thread other than
        the main thread carries the thread's name, so that the unnamed calls of two
        threads never meet (named calls are matched by name instead)."""
        if not self.threaded or thread is MAIN_THREAD:
            return self
        tagged = self._by_thread.get(thread.name)
        if tagged is None:
            tagged = self._by_thread[thread.name] = Call(**self.fields, thread=thread.name)
        return tagged


def _carries_data(collective: str) -> bool:
    """Barriers, joins and the ends of sequences move no data: any thread may meet them."""
    return collective not in ("barrier", "join") and not collective.startswith("end of")


@dataclass(frozen=True)
class ValueRange:
    """What every rank learns of all ranks' values in a compressed allreduce.

    Attributes:
        abs_max: the largest finite magnitude on any rank.
        nonfinite_ranks: ``(lowest, highest)`` rank of the group holding inf or NaN,
            or None when no rank does.
    """

    abs_max: float
    nonfinite_ranks: tuple[int, int] | None


_NO_RANK = -(1 << 62)
_NO_RANGE = np.array([0, _NO_RANK, _NO_RANK], np.int64)


class _Buffers:
    """The agreement's message buffers of one group, allocated once, the typed views of
    their payload areas (kept per dtype and length: a small call's views are made once),
    the group's compiled exchange (None: the Python one), and what the Python exchange's
    messages travel on (the group's mailboxes, else its communicator)."""

    def __init__(self, compiled: CompiledExchange | None, transport: Any) -> None:
        self.compiled = compiled
        self.transport = transport
        self.message = np.empty(HEADER_BYTES + PAYLOAD_CAPACITY, np.uint8)
        self.receive = np.empty(HEADER_BYTES + PAYLOAD_CAPACITY, np.uint8)
        self.header = self.message[:HEADER_BYTES].view(np.int64)
        self.received_header = self.receive[:HEADER_BYTES].view(np.int64)
        self.header_bytes = memoryview(self.message)[:HEADER_BYTES]
        self.signature = memoryview(self.message)[:SIGNATURE_BYTES]
        self.received_signature = memoryview(self.receive)[:SIGNATURE_BYTES]
        self.alone = self.message[:HEADER_BYTES]
        self._payloads: dict[tuple[np.dtype, int], _PayloadViews] = {}

    def payload(self, dtype: np.dtype, count: int) -> _PayloadViews:
        """The views of a payload of ``count`` elements of ``dtype``."""
        views = self._payloads.get((dtype, count))
        if views is None:
            if len(self._payloads) >= _VIEWS_KEPT:
                self._payloads.clear()
            views = self._payloads[(dtype, count)] = _PayloadViews(self, dtype, count)
        return views

    def combine_headers(self, _: np.ndarray | None = None) -> None:
        """Fold the received header into ours: elementwise max."""
        np.maximum(self.header, self.received_header, out=self.header)

    def combine_differing(self, _: np.ndarray | None = None) -> None:
        """:meth:`combine_headers` for headers without value ranges: a no-op when the
        signatures are equal, so only then skipped."""
        if self.received_signature != self.signature:
            np.maximum(self.header, self.received_header, out=self.header)


_VIEWS_KEPT = 256


class _PayloadViews:
    """A payload's place in the messages: ``message`` (header and data, as sent),
    ``data`` and ``received`` (the data areas, typed)."""

    __slots__ = ("message", "data", "received")

    def __init__(self, buffers: _Buffers, dtype: np.dtype, count: int):
        end = HEADER_BYTES + count * dtype.itemsize
        self.message = buffers.message[:end]
        self.data = buffers.message[HEADER_BYTES:end].view(dtype)
        self.received = buffers.receive[HEADER_BYTES:end].view(dtype)


def _buffers_of(group: Group) -> _Buffers:
    buffers = group.state.get("agreement")
    if buffers is None:
        buffers = group.state["agreement"] = _Buffers(
            compiled_exchange(group, SIGNATURE_BYTES, HEADER_BYTES),
            mailboxes_of(group) or group.comm)
    return buffers


def agree(group: Group, call: Call,
          local_range: tuple[float, bool] | None = None) -> ValueRange | None:
    """Check that every rank of ``group`` made the same call.

    Args:
        group: the ranks.
        call: what this rank was asked to do.
        local_range: this rank's largest finite magnitude and whether it holds inf or
            NaN, to be combined over all ranks; or None.

    Returns:
        The combined :class:`ValueRange` when ``local_range`` was given, else None.

    Raises:
        MismatchError: on every rank, when any rank's ``call`` differs.
    """
    if group.size == 1:
        _enter(group, call)
        ACTIVITY.agreed()
        if local_range is None:
            return None
        return ValueRange(local_range[0], (0, 0) if local_range[1] else None)
    return _agreed(group, call, lambda buffers, made: _exchange_header(group, made, buffers,
                                                                       local_range))


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
                 "_factors", "_prescale", "_floating")

    def __init__(self, group: Group, call: Call, dtype: np.dtype, count: int,
                 combine: Combine, finish: Finisher | None):
        self.group, self.call = group, call
        self._buffers = buffers = _buffers_of(group)
        self._views = buffers.payload(dtype, count)
        self._combine, self._finish = combine, finish
        code = None if buffers.compiled is None else payload_code(dtype, combine)
        self._reduce = None if code is None else buffers.compiled.reduction(
            buffers.message, self._views.message.nbytes, buffers.receive, code)
        divisor, postscale = (1, 1.0) if finish is None else \
            (finish.divisor, finish.postscale_factor)
        self._factors = np.array([1.0, divisor, postscale]).astype(dtype)
        self._prescale = 1.0
        self._floating = is_floating(dtype)

    def run(self, source: np.ndarray, result: np.ndarray, prescale_factor: float) -> None:
        """Agree on the call while allreducing C-contiguous ``source`` (multiplied by
        ``prescale_factor``) into C-contiguous ``result`` (may be ``source``).

        Raises:
            MismatchError: on every rank, when any rank's call differs.
        """
        if source.ndim != 1:
            source, result = source.reshape(-1), result.reshape(-1)
        call = _enter(self.group, self.call)
        try:
            if timeline.ACTIVE is None:  # no phase to record: no context to enter
                agreed = self._step(call, source, result, prescale_factor)
            else:
                with phase("wait for ranks"):
                    agreed = self._step(call, source, result, prescale_factor)
            if agreed is _DIFFERENT:
                with phase("wait for ranks"):
                    _until_agreed(self.group, call, self._buffers,
                                  lambda _, made: self._step(made, source, result,
                                                             prescale_factor),
                                  agreed)
        finally:
            ACTIVITY.agreed()

    def _step(self, call: Call, source: np.ndarray, result: np.ndarray,
              prescale_factor: float) -> Any:
        """One exchange: ``result``, or ``_DIFFERENT`` when some rank's call differs."""
        reduce = self._reduce
        if reduce is not None and (prescale_factor == 1.0 or self._floating):
            if prescale_factor != self._prescale:
                self._factors[0] = self._prescale = prescale_factor
            status = reduce(call.fresh_array, self._factors, source, result)
            if status == 0:
                return result
            if status == DIFFERENT:
                return _DIFFERENT
            raise MPI.Exception(status)
        combined = _exchange_carrying(self.group, call, self._buffers, self._views,
                                      lambda data: scale_into(source, prescale_factor, data),
                                      self._combine)
        if combined is _DIFFERENT:
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
    (:meth:`._compiled_exchange.CompiledExchange.broadcast_held`), which copies them
    once, from the mailbox into the result; or the same messages from Python
    (:class:`_HeldTransport`). Elsewhere the bytes travel as a :class:`CarriedReduction`
    of bytes: the root's, or'ed with the others' zeros.
    """

    __slots__ = ("group", "_buffers", "_mailboxes", "_held", "_reduction", "_zeros",
                 "_root", "_root_rank")

    def __init__(self, group: Group, call: Call, nbytes: int, root: int):
        self.group = group
        self._buffers = buffers = _buffers_of(group)
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
        return _exchange_through_mailboxes(
            self.group, buffers, fresh_header, buffers.alone, buffers.combine_differing,
            _HeldTransport(self._mailboxes, buffers, result, self._root, self._root_rank))


def _exchange_through_mailboxes(group: Group, buffers: _Buffers, fresh_header: np.ndarray,
                                message: np.ndarray, fold: Callable[[np.ndarray], None],
                                transport: _MailboxTransport) -> int:
    """The agreement's exchange from Python with ``fresh_header`` at the head of
    ``message`` (the agreement's), folded by ``fold``, what follows ``message`` made and
    taken by ``transport``: 0 where every rank's signature was ours, else
    :data:`DIFFERENT`."""
    buffers.header_bytes[:] = fresh_header
    _recursive_doubling.exchange(group, message, buffers.receive, fold, transport)
    return 0 if buffers.signature == fresh_header[:SIGNATURE_BYTES].tobytes() else DIFFERENT


class _MailboxTransport:
    """The mailboxes as :func:`._recursive_doubling.exchange` sees them when a call's
    data rides behind the header: subclasses make each message and take each one
    received."""

    def __init__(self, mailboxes: Any, buffers: _Buffers):
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
    ranks ``known`` (:func:`._compiled_exchange.pack_cells`); a received message's data
    taken into ``result`` where the partner's signature is this rank's."""

    def __init__(self, mailboxes: Any, buffers: _Buffers, cells: np.ndarray,
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
    """The mailboxes as :func:`._recursive_doubling.exchange` sees them in a broadcast
    riding in Python, sending what the compiled broadcast sends: the header, followed by
    ``result`` where this rank holds the root's bytes (but to the root, group rank
    ``root``); a received message's bytes are taken into ``result`` where this rank
    holds none yet and the partner's signature is this rank's."""

    def __init__(self, mailboxes: Any, buffers: _Buffers, result: np.ndarray, holds: bool,
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
    (:meth:`._compiled_exchange.CompiledExchange.gather_held`), or the same messages from
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
        self._buffers = buffers = _buffers_of(group)
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

        def fold(_: np.ndarray) -> None:
            if buffers.received_signature == buffers.signature:
                np.bitwise_or(words, received, out=words)
            else:
                buffers.combine_headers()

        verdict = _exchange_through_mailboxes(
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


_MPI_TYPES = {np.dtype(numpy_type): mpi_type for numpy_type, mpi_type in (
    (np.float32, MPI.FLOAT), (np.float64, MPI.DOUBLE), (np.int8, MPI.INT8_T),
    (np.uint8, MPI.UINT8_T), (np.int16, MPI.INT16_T), (np.int32, MPI.INT32_T),
    (np.int64, MPI.INT64_T))}
"""The collectives' dtypes that have an MPI datatype of the library's own (the 16-bit
floats have none)."""


class CheckedCollective:
    """One of the MPI library's own collectives made in the same compiled call as the
    agreement's check (:meth:`._compiled_exchange.CompiledExchange.checked_collective`),
    set up once for one kind of call: the headers travel alone (a gather's or an
    alltoall's words with them), and where every rank's call is the same the collective
    runs before the call returns to Python. A mismatch is resolved as :func:`agree`
    resolves it, and nothing has moved by then.

    Made by :func:`checked_collective`, which says where it cannot be.
    """

    __slots__ = ("group", "call", "_buffers", "_run", "_width")

    def __init__(self, group: Group, call: Call, buffers: _Buffers, run: Callable[..., int],
                 width: int):
        self.group, self.call, self._buffers, self._run = group, call, buffers, run
        self._width = width

    def run(self, send: np.ndarray, receive: np.ndarray) -> np.ndarray | None:
        """Agree on the call, then make the collective from 1-D ``send`` into 1-D
        ``receive`` (``send`` may be ``receive``: in place; a broadcast uses only
        ``receive``).

        Returns:
            None; or, for a gather or an alltoall where some rank's words differ from
            this rank's, every rank's words (a new ranks x width array), nothing moved.

        Raises:
            MismatchError: on every rank, when any rank's call differs.
            MPI.Exception: the MPI call failed.
        """
        call = _enter(self.group, self.call)
        try:
            status = self._run(call.fresh_array, send, receive)
            if not status:
                return None
            agreed = self._outcome(status)
            if agreed is _DIFFERENT:
                with phase("wait for ranks"):
                    agreed = _until_agreed(self.group, call, self._buffers,
                                           lambda _, made: self._step(made, send, receive),
                                           agreed)
            return agreed
        finally:
            ACTIVITY.agreed()

    def _step(self, call: Call, send: np.ndarray, receive: np.ndarray) -> Any:
        return self._outcome(self._run(call.fresh_array, send, receive))

    def _outcome(self, status: int) -> Any:
        """What a run that returned ``status`` agreed: None, the words, or _DIFFERENT."""
        if status == 0:
            return None
        if status == DIFFERENT:
            return _DIFFERENT
        if status == UNEVEN:
            words = self.group.size * self._width
            return self._buffers.message[HEADER_BYTES:HEADER_BYTES + 8 * words].view(
                np.int64).reshape(self.group.size, self._width).copy()
        raise MPI.Exception(status)


def checked_collective(group: Group, call: Call, kind: int, dtype: np.dtype, count: int,
                       op: MPI.Op = MPI.OP_NULL, root: int = 0,
                       words: np.ndarray | None = None) -> CheckedCollective | None:
    """The collective ``kind`` (``ALLREDUCE``, ``BROADCAST``, ``REDUCE_SCATTER``,
    ``ALLGATHER`` or ``ALLTOALL`` of :mod:`._compiled_exchange`) of ``count`` elements
    of ``dtype`` checked in one compiled call, or None where it cannot be or need not
    be: no compiled exchange, a dtype without an MPI datatype of the library's own, more
    elements than a C ``int`` counts, or a group of one rank (nothing to check or move).
    An allgather's and an alltoall's ``words`` (int64: this rank's row count, its
    splits) travel with the check, as :class:`CarriedGather` carries them. (Where a
    timeline records, callers take the Python path, whose phases it shows.)"""
    buffers = _buffers_of(group)
    datatype = _MPI_TYPES.get(np.dtype(dtype))
    if buffers.compiled is None or datatype is None or count >= 1 << 31 or group.size == 1:
        return None
    words = np.empty(0, np.int64) if words is None else words
    return CheckedCollective(group, call, buffers, buffers.compiled.checked_collective(
        buffers.message, buffers.receive, kind, count, datatype, op, root, words),
        words.size)


def checked_ring(group: Group, call: Call, dtype: np.dtype, bounds: list[int], gather: bool,
                 combine: Callable, finish: Finisher | None,
                 segment_bytes: int) -> CheckedCollective | None:
    """The ring (:mod:`._compiled_ring`) over the chunks of ``dtype`` between ``bounds``
    (elements), combined as numpy's ``combine`` does, ``finish``ed and ``gather``ed (an
    allreduce) or not (a reduce-scatter), checked in one compiled call; or None where it
    cannot be: no compiled exchange, values it does not combine, chunks too large, or a
    group of one rank."""
    buffers = _buffers_of(group)
    if buffers.compiled is None or group.size == 1:
        return None
    run = compiled_ring(buffers.compiled, buffers.message, buffers.receive, HEADER_BYTES,
                        group, dtype, bounds, gather, combine, finish, segment_bytes)
    return None if run is None else CheckedCollective(group, call, buffers, run, 0)


def _enter(group: Group, call: Call) -> Call:
    """Note the call in progress for the stall inspector; returns it as this thread made
    it (see :meth:`Call.made_by`)."""
    if call.threaded and not TURN.main_only:
        call = call.made_by(TURN.caller())
    ACTIVITY.enter(group.world_ranks, call.fields)
    return call


def _agreed(group: Group, call: Call, exchange: Callable[[_Buffers, Call], Any]) -> Any:
    """Run ``exchange(buffers, call)`` until every rank's call is the same (see
    :func:`resolve`); ``call`` as this thread made it."""
    call = _enter(group, call)
    buffers = _buffers_of(group)
    try:
        with phase("wait for ranks"):
            return _until_agreed(group, call, buffers, exchange, exchange(buffers, call))
    finally:
        ACTIVITY.agreed()


def _until_agreed(group: Group, call: Call, buffers: _Buffers,
                  exchange: Callable[[_Buffers, Call], Any], agreed: Any) -> Any:
    """Resolve the mismatches (see :func:`resolve`) and run ``exchange`` again until
    ``agreed``, what the last exchange returned, is not ``_DIFFERENT``; return it."""
    disagreeing_since = None
    while agreed is _DIFFERENT:
        now = time.monotonic()
        disagreeing_since = disagreeing_since or now
        _resolve_mismatch(group, call, now - disagreeing_since)
        agreed = exchange(buffers, call)
    return agreed


def agree_joined(group: Group, call: Call) -> list[dict[str, Any]] | None:
    """One round of a rank that has joined (see :mod:`._join`): meet the others' next call.

    Returns:
        Every rank's call fields, in group order, when some rank's call differs from
        ``call``; None when every rank made this same call.
    """
    if group.size == 1:
        return None
    buffers = _buffers_of(group)
    # Not entered into ACTIVITY: a joined rank waits for the others by design, and the
    # stall inspector must not report it.
    with phase("joined"):
        buffers.header_bytes[:] = call.fresh_header
        _exchange_headers(group, buffers, every_step=True)
        if buffers.signature == call.header_bytes:
            return None
        return [fields for fields, _ in group.comm.allgather((call.fields, Order()))]


def _exchange_header(group: Group, call: Call, buffers: _Buffers,
                     local_range: tuple[float, bool] | None) -> ValueRange | None:
    buffers.header_bytes[:] = call.fresh_header
    if local_range is not None:
        header = buffers.header
        header[2] = np.float64(local_range[0]).view(np.int64)
        if local_range[1]:
            header[3:] = (group.rank, -group.rank)
    _exchange_headers(group, buffers, every_step=local_range is not None)
    # The combined header is [max, -min] of all signatures: ours again exactly when all agree.
    if buffers.signature != call.header_bytes:
        return _DIFFERENT
    if local_range is None:
        return None
    header = buffers.header
    nonfinite = None if header[3] == _NO_RANK else (int(-header[4]), int(header[3]))
    return ValueRange(float(header[2:3].view(np.float64)[0]), nonfinite)


def _exchange_carrying(group: Group, call: Call, buffers: _Buffers, views: _PayloadViews,
                       fill: Callable[[np.ndarray], None], combine: Combine) -> Any:
    buffers.header_bytes[:] = call.fresh_header
    data, received = views.data, views.received
    fill(data)
    signature, received_signature = buffers.signature, buffers.received_signature
    compiled = buffers.compiled
    code = None if compiled is None else payload_code(data.dtype, combine)
    if code is not None:
        compiled.run(buffers.message, views.message.nbytes, buffers.receive, PAYLOADS, code,
                     data, received)
    else:
        def fold(_: np.ndarray) -> None:
            # Unequal headers mean unequal calls: the payloads may differ even in size.
            if received_signature == signature:
                combine(data, received, out=data)
            else:
                buffers.combine_headers()

        _recursive_doubling.exchange(group, views.message, buffers.receive, fold,
                                     buffers.transport)
    return data if signature == call.header_bytes else _DIFFERENT


def _exchange_headers(group: Group, buffers: _Buffers, every_step: bool) -> None:
    """Exchange the headers alone, combining them at every step or only where the
    signatures differ."""
    compiled = buffers.compiled
    if compiled is not None:
        compiled.run(buffers.message, HEADER_BYTES, buffers.receive,
                     HEADERS if every_step else HEADERS_IF_DIFFERENT)
    else:
        _recursive_doubling.exchange(group, buffers.alone, buffers.receive,
                                     buffers.combine_headers if every_step
                                     else buffers.combine_differing, buffers.transport)


def _resolve_mismatch(group: Group, call: Call, waited: float) -> None:
    """Raise the error this rank's call gets, or return when it must be exchanged again
    (after running, out of turn, the waiting call the ranks chose to run first)."""
    state = world()
    order = _name_matching.local_order(state.executor, group.world_ranks, state.group.size,
                                       waited)
    gathered = group.comm.allgather((call.fields, order))
    everyone = [fields for fields, _ in gathered]
    orders = [order for _, order in gathered]
    names = [fields.get("name") for fields in everyone]
    outcome = resolve(everyone)
    if outcome.failing and not outcome.joined and not outcome.again and \
            not any("refused" in fields for fields in everyone):
        chosen = _name_matching.choose(names, orders)
        if chosen == _name_matching.WAIT:
            _name_matching.pause(orders)
            return
        if chosen is not None:
            if call.fields.get("name") != chosen:
                _run_out_of_turn(state, group, chosen)
            return
        hint = _name_matching.threads_hint(group.world_ranks, names, orders)
        raise _mismatch_error(group, everyone, outcome.failing, hint)
    rank = group.rank
    if rank in outcome.again:
        return
    if outcome.joined_error:
        joined = format_ranks([group.world_ranks[r] for r in outcome.joined])
        raise UsageError(
            f"{subject(call.fields.get('collective', '?'), call.fields.get('name'))}: "
            f"{joined} joined (ringtrain.join) and can only contribute zeros to "
            f"allreduces and wait in barriers; call it on every rank, or join everywhere")
    raise _mismatch_error(group, everyone, outcome.failing)


def _run_out_of_turn(state: Any, group: Group, name: str) -> None:
    """Run this rank's waiting call ``name`` now, then resume the call in progress."""
    in_progress = ACTIVITY.current
    key = _name_matching.waiting_key(state.executor, name, group.world_ranks,
                                     state.group.size)
    state.executor.run_waiting(key)
    ACTIVITY.resume(in_progress)


@dataclass(frozen=True)
class Outcome:
    """What each rank does when the ranks' calls differ (see :func:`resolve`).

    Attributes:
        again: ranks that exchange their call again (the others will change theirs).
        failing: ranks whose call fails (with a MismatchError unless ``joined_error``).
        joined: ranks waiting in :func:`ringtrain.join`.
        replay: the call the joined ranks make next (with zeros), or None when they
            only wait for the next round.
        joined_error: the failing ranks' call cannot run while ranks are joined.
    """

    again: tuple[int, ...]
    failing: tuple[int, ...]
    joined: tuple[int, ...]
    replay: dict[str, Any] | None
    joined_error: bool = False


REPLAYABLE = {"allreduce", "grouped_allreduce", "barrier"}
"""Calls a joined rank can join in: with zeros for its data, or with nothing."""

REPLAYABLE_COMPRESSION = {"none", "fp16", "bf16"}


def resolve(everyone: list[dict[str, Any]]) -> Outcome:
    """Decide, identically on every rank, what follows a disagreement.

    ``everyone`` holds every rank's call fields. Ranks waiting in a barrier keep
    waiting and the collective the others made fails (a barrier waits for everyone).
    Ranks that joined make the others' call with zeros when it is an allreduce (or a
    barrier), and the others exchange it again; any other call fails on the ranks that
    made it, and the joined ranks wait for the next one.
    """
    joined = tuple(r for r, f in enumerate(everyone) if f.get("collective") == "join")
    waiting = tuple(r for r, f in enumerate(everyone) if f.get("collective") == "barrier")
    active = tuple(r for r in range(len(everyone)) if r not in joined and r not in waiting)
    calls = {repr(everyone[r]) for r in active}
    if active and (waiting or len(calls) > 1):
        return Outcome(again=waiting, failing=active, joined=joined, replay=None)
    if not active:  # barrier ranks and joined ranks: the joined ranks enter the barrier
        return Outcome(again=waiting, failing=(), joined=joined,
                       replay=everyone[waiting[0]] if waiting else None)
    fields = everyone[active[0]]
    replayable = fields.get("collective") in REPLAYABLE and "refused" not in fields and \
        fields.get("compression", "none") in REPLAYABLE_COMPRESSION
    if joined and replayable:
        return Outcome(again=active, failing=(), joined=joined, replay=fields)
    return Outcome(again=(), failing=active, joined=joined, replay=None,
                   joined_error=bool(joined))


def _mismatch_error(group: Group, everyone: list[dict[str, Any]],
                    failing: tuple[int, ...], hint: str | None = None) -> MismatchError:
    refused = any("refused" in description for description in everyone)
    names = ["refused"] if refused else \
        list(dict.fromkeys(name for description in everyone for name in description))
    differences = {}
    for name in names:
        absent = MAIN_THREAD.name if name == "thread" else ABSENT
        values = {group.world_ranks[r]: description.get(name, absent)
                  for r, description in enumerate(everyone)}
        if len({repr(v) for v in values.values()}) > 1:
            differences[name] = values
    # Every failing rank names the call as the first of them made it: one message everywhere.
    first = everyone[failing[0]]
    return MismatchError(first.get("collective"), first.get("name"), differences, hint)
