"""Collectives checked by the agreement in the same compiled call that moves them: one of
the MPI library's own (:func:`checked_collective`) or the compiled ring
(:func:`checked_ring`), made before the call returns to Python once every rank's header
has agreed, and resolved as :func:`._agreement.agree` resolves a mismatch otherwise,
nothing moved by then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..algorithms._compiled_ring import checked_ring as compiled_ring
from ..base._activity import ACTIVITY
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._tracing import phase
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


class CheckedCollective:
    """One of the MPI library's own collectives made in the same compiled call as the
    agreement's check (:meth:`..transport._compiled_exchange.CompiledExchange.checked_collective`),
    set up once for one kind of call: the headers travel alone (a gather's or an
    alltoall's words with them), and where every rank's call is the same the collective
    runs before the call returns to Python. A mismatch is resolved as :func:`._agreement.agree`
    resolves it, and nothing has moved by then.

    Made by :func:`checked_collective`, which says where it cannot be.
    """

    __slots__ = ("group", "call", "_buffers", "_run", "_width")

    def __init__(self, group: Group, call: Call, buffers: Buffers, run: Callable[..., int],
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
        call = enter(self.group, self.call)
        try:
            status = self._run(call.fresh_array, send, receive)
            if not status:
                return None
            agreed = self._outcome(status)
            if agreed is DISAGREED:
                with phase("wait for ranks"):
                    agreed = until_agreed(self.group, call, self._buffers,
                                          lambda _, made: self._step(made, send, receive),
                                          agreed)
            return agreed
        finally:
            ACTIVITY.agreed()

    def _step(self, call: Call, send: np.ndarray, receive: np.ndarray) -> Any:
        return self._outcome(self._run(call.fresh_array, send, receive))

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


def checked_collective(group: Group, call: Call, kind: int, dtype: np.dtype, count: int,
                       op: MPI.Op = MPI.OP_NULL, root: int = 0,
                       words: np.ndarray | None = None) -> CheckedCollective | None:
    """The collective ``kind`` (``ALLREDUCE``, ``BROADCAST``, ``REDUCE_SCATTER``,
    ``ALLGATHER`` or ``ALLTOALL`` of :mod:`..transport._compiled_checked`) of ``count`` elements
    of ``dtype`` checked in one compiled call, or None where it cannot be or need not
    be: no compiled exchange, a dtype without an MPI datatype of the library's own, more
    elements than a C ``int`` counts, or a group of one rank (nothing to check or move).
    An allgather's and an alltoall's ``words`` (int64: this rank's row count, its
    splits) travel with the check, as :class:`._carried.CarriedGather` carries them. (Where a
    timeline records, callers take the Python path, whose phases it shows.)"""
    buffers = buffers_of(group)
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
    """The ring (:mod:`..algorithms._compiled_ring`) over the chunks of ``dtype`` between ``bounds``
    (elements), combined as numpy's ``combine`` does, ``finish``ed and ``gather``ed (an
    allreduce) or not (a reduce-scatter), checked in one compiled call; or None where it
    cannot be: no compiled exchange, values it does not combine, chunks too large, or a
    group of one rank."""
    buffers = buffers_of(group)
    if buffers.compiled is None or group.size == 1:
        return None
    run = compiled_ring(buffers.compiled, buffers.message, buffers.receive, HEADER_BYTES,
                        group, dtype, bounds, gather, combine, finish, segment_bytes)
    return None if run is None else CheckedCollective(group, call, buffers, run, 0)
