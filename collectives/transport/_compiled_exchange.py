"""The compiled exchange of one group (:class:`CompiledExchange`), set up once: its
schedule, mailboxes and MPI handles, and the compiled calls bound to the agreement's
messages.

A small allreduce is one compiled call (:meth:`CompiledExchange.reduction`): it fills
the message from the caller's array, exchanges, checks the signatures and writes the
finished result. So is a larger allreduce, broadcast, reduce-scatter, allgather or
alltoall that the MPI library's own collective moves
(:meth:`CompiledExchange.checked_collective`), and a small broadcast or gather riding
through the mailboxes (:meth:`CompiledExchange.broadcast_held`,
:meth:`CompiledExchange.gather_held`). The same schedule reduces data alone, after the
agreement, in segments (:func:`reduce_by_recursive_doubling`).
``RINGTRAIN_COMPILED_EXCHANGE=0`` turns the compiled exchange off: the agreement then
runs its Python exchange, the same messages.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ...kernels.reduction import compiled_view
from ..base._group import Group
from ._c_calls import NO_STAMPS, MpiFunctions, mpi_functions
from ._compiled_checked import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST, MAILBOX_ALLGATHER,
                                MAILBOX_ALLTOALL, REDUCE_SCATTER, checked_collective_call)
from ._compiled_riding import broadcast_held, gather_held
from ._compiled_steps import exchange, payload_code, reduce_planned, reduce_segments
from ._mailboxes import NO_BOXES, mailboxes_of
from ._recursive_doubling import schedule_of

_NO_PAYLOAD = np.empty(0, np.uint8)
_NO_WORDS = np.empty(0, np.int64)


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
                  signature_bytes, header_bytes // 8, group.rank, len(schedule.partners),
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
        error = exchange(self._state, self._comm, self._byte, self._boxes, self._counters,
                         message, length, receive, mode, code, mine, received)
        if error:
            raise MPI.Exception(error)

    def reduce_data(self, buffer: np.ndarray, receive: np.ndarray, code: int,
                    per_segment: int) -> None:
        """Allreduce 1-D ``buffer`` in place by this group's schedule, ``per_segment``
        elements a message, without a header (through MPI, never the mailboxes),
        combined by ``code``; ``receive`` (uint8) holds a message.

        Raises:
            MPI.Exception: an MPI call failed.
        """
        error = reduce_segments(self._state, self._comm, self._byte, buffer, receive,
                                per_segment, code)
        if error:
            raise MPI.Exception(error)

    def reduction(self, message: np.ndarray, length: int, receive: np.ndarray,
                  code: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]:
        """A small allreduce in one compiled call, bound to its messages:
        ``reduce(fresh_header, factors, source, result)`` writes ``fresh_header`` (uint8)
        and then ``source * factors[0]`` into ``message`` (``length`` bytes in all),
        exchanges them and combines by ``code`` as :meth:`run` does; then, if every
        rank's signature was ours, writes the data ``/ factors[1] * factors[2]`` into
        ``result`` and returns 0. ``factors`` are those of
        :func:`...kernels.elementwise.factors_for` (1 where nothing is to be done: an
        integer payload is only copied); ``result`` may be ``source``.

        The call returns :data:`DIFFERENT` when some rank's signature differed (the
        message then holds the combined headers, as :meth:`run` leaves them, and
        ``result`` is untouched), and an MPI error code when an MPI call failed.

        It finds its arrays by address: ``message`` and ``receive`` must live as long as
        it is called (the group's own do, and so do this exchange's).
        """
        handles = np.array([self._comm, self._byte], self._comm.dtype)
        return functools.partial(reduce_planned, self._plan(message, length, receive, code),
                                 handles)

    def checked_collective(self, message: np.ndarray, receive: np.ndarray, kind: int,
                           count: int, datatype: MPI.Datatype, op: MPI.Op = MPI.OP_NULL,
                           root: int = 0, words: np.ndarray = _NO_WORDS,
                           stamps: np.ndarray = NO_STAMPS
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
        :data:`PAYLOADS`, as :class:`..agreement._carried.CarriedGather` sends them); where
        some rank's differ from this rank's the call returns :data:`UNEVEN`, nothing
        moved, every rank's words in the message's payload. The datatype and op must be
        the MPI library's own (a user-defined op would call Python without the GIL).
        ``stamps`` (:func:`._c_calls.new_stamps`) take the times of the call's
        start, of the check's end and of the collective's end."""
        functions = self._functions
        address = {ALLREDUCE: functions.allreduce, BROADCAST: functions.bcast,
                   REDUCE_SCATTER: functions.reduce_scatter_block,
                   ALLGATHER: functions.allgather, ALLTOALL: functions.alltoall,
                   MAILBOX_ALLGATHER: 0, MAILBOX_ALLTOALL: 0}[kind]
        collective = np.array([address, kind, count, root, int(MPI.IN_PLACE), self._rank,
                               words.size, *words.tolist()], np.int64)
        return self.checked(checked_collective_call, message, receive,
                            self._header_bytes + 8 * self._size * words.size, collective,
                            stamps, datatype=datatype, op=op)

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
        return self.checked(broadcast_held, message, receive, self._header_bytes, holding)

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
        return self.checked(gather_held, message, receive, self._header_bytes, cells,
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
    (:func:`._c_calls.mpi_functions`)."""
    functions = mpi_functions()
    return None if functions is None else \
        CompiledExchange(group, functions, signature_bytes, header_bytes)


def reduce_by_recursive_doubling(group: Group, buffer: np.ndarray, combine: Callable,
                                 segment_bytes: int) -> bool:
    """Allreduce 1-D ``buffer`` in place by recursive doubling after the agreement, in one
    compiled call, the steps and messages of :func:`._recursive_doubling.allreduce`
    (segments of at most ``segment_bytes``, through MPI); False where it cannot be
    (values the compiled exchange does not combine, or it is off): nothing moved then."""
    code = payload_code(buffer.dtype, combine)
    if code is None:
        return False
    if "data exchange" not in group.state:
        group.state["data exchange"] = compiled_exchange(group, 0, 0)
    compiled = group.state["data exchange"]
    if compiled is None:
        return False
    buffer = compiled_view(buffer)
    per_segment = max(1, segment_bytes // buffer.itemsize)
    receive = group.scratch.get("rd.segment", min(buffer.size, per_segment) * buffer.itemsize)
    compiled.reduce_data(buffer, receive, code, per_segment)
    return True
