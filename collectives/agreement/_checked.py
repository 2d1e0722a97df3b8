"""Collectives checked by the agreement in the same compiled call that moves them: one of
the MPI library's own (:func:`checked_collective`) or the compiled ring
(:func:`checked_ring`), made before the call returns to Python once every rank's header
has agreed, and resolved as :func:`._agreement.agree` resolves a mismatch otherwise,
nothing moved by then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from ...kernels.reduction import compiled_dtype, compiled_view
from .. import timeline
from ..algorithms._compiled_ring import checked_ring as compiled_ring
from ..base._activity import ACTIVITY
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._tracing import phase, record_stamped
from ..transport._c_calls import NO_STAMPS, new_stamps, stamped_seconds
from ..transport._compiled_checked import (ALLGATHER, ALLREDUCE, ALLTOALL, BROADCAST,
                                           MAILBOX_ALLGATHER, MAILBOX_ALLTOALL, REDUCE_SCATTER)
from ..transport._compiled_riding import UNEVEN
from ..transport._compiled_steps import DIFFERENT
from ._agreement import DISAGREED, Buffers, buffers_of, enter, until_agreed
from ._call import HEADER_BYTES, Call


_MPI_TYPES = {np.dtype(numpy_type): mpi_type for numpy_type, mpi_type in (
    (np.float32, MPI.FLOAT), (np.float64, MPI.DOUBLE), (np.int8, MPI.INT8_T),
    (np.uint8, MPI.UINT8_T), (np.int16, MPI.INT16_T), (np.int32, MPI.INT32_T),
    (np.int64, MPI.INT64_T))}
"""The collectives' dtypes that have an MPI datatype of the library's own (the 16-bit
floats have none)."""


@dataclass(frozen=True)
class TracedRun:
    """A checked collective's compiled call that also takes the times of its phases, for
    the timeline: the same route as the call untraced.

    Attributes:
        run: the compiled call, bound to ``stamps``.
        stamps: where it writes the times (:func:`..transport._c_calls.new_stamps`).
        phases: the names of the phases between consecutive times, the agreement's
            ``wait for ranks`` first.
        args: the data phases' args on the timeline: the bytes they move.
    """

    run: Callable[..., int]
    stamps: np.ndarray
    phases: tuple[str, ...]
    args: dict

    def record(self) -> None:
        """Put the phases the last run took on the timeline, if one records."""
        record_stamped(self.phases, stamped_seconds(self.stamps), self.args)


class CheckedCollective:
    """One of the MPI library's own collectives (or the compiled ring) made in the same
    compiled call as the agreement's check
    (:meth:`..transport._compiled_exchange.CompiledExchange.checked_collective`), set up
    once for one kind of call: the headers travel alone (a gather's or an alltoall's
    words with them), and where every rank's call is the same the collective runs before
    the call returns to Python. A mismatch is resolved as :func:`._agreement.agree`
    resolves it, and nothing has moved by then. While a timeline records, the same call
    runs as ``traced``, which times its phases.

    Made by :func:`checked_collective` and :func:`checked_ring`, which say where it
    cannot be.
    """

    __slots__ = ("group", "call", "_buffers", "_run", "_width", "_traced", "_bits")

    def __init__(self, group: Group, call: Call, buffers: Buffers, run: Callable[..., int],
                 width: int, traced: TracedRun | None = None, bits: bool = False):
        self.group, self.call, self._buffers, self._run = group, call, buffers, run
        self._width, self._traced, self._bits = width, traced, bits

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
        if self._bits:
            send, receive = compiled_view(send), compiled_view(receive)
        call = enter(self.group, self.call)
        try:
            if timeline.ACTIVE is None or self._traced is None:
                status = self._run(call.fresh_array, send, receive)
                if not status:
                    return None
                agreed = self._outcome(status)
            else:
                agreed = self._step(call, send, receive)
            if agreed is DISAGREED:
                with phase("wait for ranks"):
                    agreed = until_agreed(self.group, call, self._buffers,
                                          lambda _, made: self._step(made, send, receive),
                                          agreed)
            return agreed
        finally:
            ACTIVITY.agreed()

    def _step(self, call: Call, send: np.ndarray, receive: np.ndarray) -> Any:
        traced = self._traced if timeline.ACTIVE is not None else None
        if traced is None:
            return self._outcome(self._run(call.fresh_array, send, receive))
        status = traced.run(call.fresh_array, send, receive)
        if status == 0:
            traced.record()
        return self._outcome(status)

    def _outcome(self, status: int) -> Any:
        """What a run that returned ``status`` agreed: None, the words, or DISAGREED."""
        if status == 0:
            return None
        if status == DIFFERENT:
            return DISAGREED
        if status == UNEVEN:
            words = self.group.size * self._width
            return self._buffers.message[HEADER_BYTES:HEADER_BYTES + 8 * words].view(
                np.int64).reshape(self.group.size, self._width).copy()
        raise MPI.Exception(status)


_PHASES = {ALLREDUCE: "MPI allreduce", BROADCAST: "MPI broadcast",
           REDUCE_SCATTER: "MPI reducescatter", ALLGATHER: "MPI allgather",
           ALLTOALL: "MPI alltoall", MAILBOX_ALLGATHER: "pairwise allgather",
           MAILBOX_ALLTOALL: "pairwise alltoall"}
"""The timeline's name of each checked collective's data phase."""


def checked_collective(group: Group, call: Call, kind: int, dtype: np.dtype, count: int,
                       op: MPI.Op = MPI.OP_NULL, root: int = 0,
                       words: np.ndarray | None = None) -> CheckedCollective | None:
    """The collective ``kind`` (``ALLREDUCE``, ``BROADCAST``, ``REDUCE_SCATTER``,
    ``ALLGATHER``, ``ALLTOALL``, ``MAILBOX_ALLGATHER`` or ``MAILBOX_ALLTOALL`` of
    :mod:`..transport._compiled_checked`) of ``count`` elements of ``dtype`` checked in
    one compiled call, or None where it cannot be or need not be: no compiled exchange,
    a dtype without an MPI datatype of the library's own, more elements than a C ``int``
    counts, or a group of one rank (nothing to check or move). An allgather's and an
    alltoall's ``words`` (int64: this rank's row count, its splits) travel with the
    check, as :class:`._carried.CarriedGather` carries them."""
    buffers = buffers_of(group)
    datatype = _MPI_TYPES.get(np.dtype(dtype))
    if buffers.compiled is None or datatype is None or count >= 1 << 31 or group.size == 1:
        return None
    words = np.empty(0, np.int64) if words is None else words
    stamps = new_stamps(3)

    def bound(taking: np.ndarray) -> Callable[..., int]:
        return buffers.compiled.checked_collective(buffers.message, buffers.receive, kind,
                                                   count, datatype, op, root, words, taking)

    nbytes = count * np.dtype(dtype).itemsize * (1 if kind in (ALLREDUCE, BROADCAST)
                                                 else group.size)
    return CheckedCollective(group, call, buffers, bound(NO_STAMPS), words.size,
                             TracedRun(bound(stamps), stamps,
                                       ("wait for ranks", _PHASES[kind]), {"bytes": nbytes}))


def checked_ring(group: Group, call: Call, dtype: np.dtype, bounds: list[int], gather: bool,
                 combine: Callable, finish: Finisher | None,
                 segment_bytes: int) -> CheckedCollective | None:
    """The ring (:mod:`..algorithms._compiled_ring`) over the chunks of ``dtype`` between
    ``bounds`` (elements), combined as numpy's ``combine`` does, ``finish``ed and
    ``gather``ed (an allreduce) or not (a reduce-scatter), checked in one compiled call;
    or None where it cannot be: no compiled exchange, values it does not combine, chunks
    too large, or a group of one rank."""
    buffers = buffers_of(group)
    if buffers.compiled is None or group.size == 1:
        return None
    stamps = new_stamps(4)

    def bound(taking: np.ndarray) -> Callable[..., int] | None:
        return compiled_ring(buffers.compiled, buffers.message, buffers.receive,
                             HEADER_BYTES, group, dtype, bounds, gather, combine, finish,
                             segment_bytes, taking)

    run = bound(NO_STAMPS)
    if run is None:
        return None
    phases = ("wait for ranks", "reduce-scatter", "allgather")
    return CheckedCollective(group, call, buffers, run, 0, TracedRun(
        bound(stamps), stamps, phases if gather else phases[:2],
        {"bytes": (bounds[-1] - bounds[0]) * np.dtype(dtype).itemsize}),
        compiled_dtype(dtype) != dtype)
