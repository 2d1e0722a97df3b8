"""The ring allreduce and reduce-scatter of :mod:`._ring` in machine code, checked by
the agreement in the same compiled call.

The schedule, segments, tags and the rule that each element is reduced on one rank
are :mod:`._ring`'s, so the result is the same and bit-identical on every rank; only
the Python between the steps is gone. That Python costs more than its microseconds in a
warm loop suggest: each segment's transfer sweeps the caches, and every interpreter step
after it misses (docs/lab/2026-11-26-the-ring-in-compiled-code.md measures it).

Host arrays of the dtypes the compiled exchange combines (:func:`payload_code`: numpy's
own, and the 16-bit floats as their bits, compressed wires included). A call a timeline
records runs the same steps in two compiled calls, the reduce-scatter and the allgather,
each one phase. The data phases call :func:`allreduce_by_ring` and
:func:`reduce_scatter_by_ring`, which take :mod:`._ring`'s Python steps only where
compiled calls are off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
from mpi4py import MPI

from ...kernels.elementwise import combine_values, factors_for, finish_values
from ...kernels.reduction import compiled_view
from .. import timeline
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._tracing import phase
from ..transport._c_calls import NO_STAMPS, MpiFunctions, call_c, mpi_functions, stamp
from ..transport._compiled_exchange import CompiledExchange
from ..transport._compiled_steps import HEADERS_IF_DIFFERENT, agreed, payload_code
from . import _ring
from ._ring import ALLGATHER_TAG, REDUCE_SCATTER_TAG, chunk_bounds

# Words of a ring's description (int64): where this rank's finished chunk goes in the
# result, whether the chunks are then gathered (an allreduce) or not (a reduce-scatter);
# the chunk bounds (size + 1 words), then room for an MPI_Status, follow them.
_SENDRECV, _SEND, _RECV, _RANK, _SIZE, _SEGMENT, _OP, _OWN_AT, _GATHER, _BOUNDS = range(10)
_REDUCE_SCATTER, _ALLGATHER, _BOTH = 1, 2, 3  # the halves :func:`_ring_steps` runs
_MAX_MESSAGE_BYTES = (1 << 31) - 1
_RINGS_KEPT = 64
"""Descriptions of unchecked rings kept per group (all dropped when it is reached)."""


@numba.njit(cache=True, nogil=True)
def _transfer(ring, comm, byte, send, send_bytes, right, incoming, receive_bytes, left,
              tag: int, both: bool) -> int:
    """Send ``send_bytes`` at address ``send`` to ``right`` and receive
    ``receive_bytes`` at ``incoming`` from ``left``: both in one call if ``both``, else
    only the ones that are not empty (as :mod:`._ring` does). 0 or the MPI error."""
    status = ring[_BOUNDS + ring[_SIZE] + 1:].ctypes.data
    send_count, receive_count = np.int32(send_bytes), np.int32(receive_bytes)
    if both or send_count and receive_count:
        return call_c(ring[_SENDRECV], (send, send_count, byte, np.int32(right),
                                        np.int32(tag), incoming, receive_count, byte,
                                        np.int32(left), np.int32(tag), comm, status))
    if send_count:
        return call_c(ring[_SEND], (send, send_count, byte, np.int32(right), np.int32(tag),
                                    comm))
    if receive_count:
        return call_c(ring[_RECV], (incoming, receive_count, byte, np.int32(left),
                                    np.int32(tag), comm, status))
    return 0


@numba.njit(cache=True, nogil=True)
def _checked_ring(plan, handles, ring, factors, scratch, stamps, fresh_header, source,
                  result) -> int:
    """The agreement's check, then, where every rank's signature was ours,
    :func:`_ring_steps`: 0, ``DIFFERENT`` or an MPI error. Where ``stamps`` are taken
    (:func:`..transport._c_calls.stamp`), they hold the times of the call's start,
    of the check's end, and of the end of each half of the ring."""
    stamp(stamps, 0)
    # np.int64: one compilation for every value (see _compiled_steps._reduce).
    error = agreed(plan, handles, fresh_header, np.int64(HEADERS_IF_DIFFERENT))
    if error != 0:
        return error
    stamp(stamps, 1)
    error = _ring_steps(ring, handles, factors, scratch, source, result,
                        np.int64(_REDUCE_SCATTER))
    stamp(stamps, 2)
    if error == 0:
        error = _ring_steps(ring, handles, factors, scratch, source, result,
                            np.int64(_ALLGATHER))
    stamp(stamps, 3)
    return error


@numba.njit(cache=True, nogil=True)
def _ring_steps(ring, handles, factors, scratch, source, result, halves) -> int:
    """The ring that ``ring`` describes over the communicator of ``handles`` (with
    ``MPI_BYTE``): the reduce-scatter of 1-D ``source``, this rank's chunk finished by
    ``factors`` into ``result`` at its place, then, for an allreduce, the allgather of
    every chunk in ``result`` (may be ``source``); of these, the ``halves``
    (``_REDUCE_SCATTER``, ``_ALLGATHER`` or ``_BOTH``): 0 or an MPI error."""
    comm, byte, itemsize = handles[0], handles[1], source.itemsize
    rank, size, op, own_at = ring[_RANK], ring[_SIZE], ring[_OP], ring[_OWN_AT]
    bounds = ring[_BOUNDS:_BOUNDS + size + 1]
    right, left = (rank + 1) % size, (rank + size - 1) % size
    longest = 0
    for chunk in range(size):
        longest = max(longest, bounds[chunk + 1] - bounds[chunk])
    per_segment = max(1, min(longest, ring[_SEGMENT]))
    received, partial = scratch[:per_segment], scratch[per_segment:2 * per_segment]
    finishing = factors[1] != 1 or factors[2] != 1
    pieces = (longest + per_segment - 1) // per_segment if halves & _REDUCE_SCATTER else 0
    for piece in range(pieces):
        outgoing = source.ctypes.data  # where the step's data is: a partial sum after the first
        for step in range(size - 1):
            sent_chunk = (rank - step - 1 + size) % size
            received_chunk = (rank - step - 2 + 2 * size) % size
            a = min(bounds[sent_chunk] + piece * per_segment, bounds[sent_chunk + 1])
            a_end = min(a + per_segment, bounds[sent_chunk + 1])
            b = min(bounds[received_chunk] + piece * per_segment, bounds[received_chunk + 1])
            b_end = min(b + per_segment, bounds[received_chunk + 1])
            if step == 0:  # (an address as a slice's: arithmetic would make it a float)
                outgoing = source[a:].ctypes.data
            error = _transfer(ring, comm, byte, outgoing, (a_end - a) * itemsize, right,
                              received.ctypes.data, (b_end - b) * itemsize, left,
                              REDUCE_SCATTER_TAG, False)
            if error != 0:
                return error
            if b == b_end:
                continue
            # The last step receives this rank's own chunk: it goes to the result.
            into = partial[:b_end - b] if step < size - 2 else \
                result[b - own_at:b_end - own_at]
            combine_values(op, source[b:b_end], received[:b_end - b], into)
            if step == size - 2 and finishing:
                finish_values(op, into, factors, into)
            outgoing = into.ctypes.data
    if ring[_GATHER] == 0 or not halves & _ALLGATHER:
        return 0
    for step in range(size - 1):
        sent, arriving = (rank - step + size) % size, (rank - step - 1 + size) % size
        error = _transfer(ring, comm, byte, result[bounds[sent]:].ctypes.data,
                          (bounds[sent + 1] - bounds[sent]) * itemsize, right,
                          result[bounds[arriving]:].ctypes.data,
                          (bounds[arriving + 1] - bounds[arriving]) * itemsize, left,
                          ALLGATHER_TAG, True)
        if error != 0:
            return error
    return 0


@dataclass(frozen=True)
class _Ring:
    """What the compiled ring takes for one kind of call: its description (int64 words),
    the finishing factors (:func:`...kernels.elementwise.factors_for`) and the two
    segments in flight."""

    words: np.ndarray
    factors: np.ndarray
    segments: np.ndarray


def _ring_for(group: Group, functions: MpiFunctions, dtype: np.dtype, bounds: list[int],
              gather: bool, op: int | None, finish: Finisher | None,
              segment_bytes: int) -> _Ring | None:
    """The compiled ring over ``group`` of the chunks of ``dtype`` between ``bounds``
    (elements), combined by payload code ``op``, finished by ``finish`` and gathered
    (an allreduce) or not (a reduce-scatter, whose result is this rank's chunk); None
    where it cannot run: values it does not combine, or a chunk larger than one MPI
    message of bytes can be. The segments in flight are held in the group's scratch
    memory, where the Python ring holds them."""
    if op is None:
        return None
    longest = max(bounds[chunk + 1] - bounds[chunk] for chunk in range(group.size))
    itemsize = np.dtype(dtype).itemsize
    if longest * itemsize > _MAX_MESSAGE_BYTES:
        return None
    per_segment = max(1, min(longest, segment_bytes // itemsize))
    words = np.array([functions.sendrecv, functions.send, functions.recv, group.rank,
                      group.size, per_segment, op, 0 if gather else bounds[group.rank],
                      int(gather), *bounds] + [0] * -(-functions.status_bytes // 8), np.int64)
    factors = factors_for(op, dtype, (1, 1, 1) if finish is None else
                          (1, finish.divisor, finish.postscale_factor))
    nbytes = 2 * per_segment * itemsize
    segments = group.scratch.get("ring.segments", nbytes)[:nbytes].view(dtype)
    return _Ring(words, factors, compiled_view(segments))


def checked_ring(exchange: CompiledExchange, message: np.ndarray, receive: np.ndarray,
                 header_bytes: int, group: Group, dtype: np.dtype, bounds: list[int],
                 gather: bool, combine: Callable, finish: Finisher | None,
                 segment_bytes: int, stamps: np.ndarray = NO_STAMPS
                 ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], int] | None:
    """The check and the ring over ``group`` (see :func:`_ring_for`) of elements of
    ``dtype`` combined as numpy's ``combine`` does, in one compiled call bound to
    ``exchange``'s messages (``header_bytes`` of them): ``run(fresh_header, source,
    result)``, as :meth:`CompiledExchange.checked` describes; or None where it cannot
    be. ``stamps`` (:func:`..transport._c_calls.new_stamps`) take the times of the
    call's start, of the check's end and of each half's end."""
    functions = mpi_functions()
    ring = None if functions is None else _ring_for(
        group, functions, dtype, bounds, gather, payload_code(np.dtype(dtype), combine),
        finish, segment_bytes)
    return None if ring is None else exchange.checked(
        _checked_ring, message, receive, header_bytes, ring.words, ring.factors,
        ring.segments, stamps)


def ring_allreduce(group: Group, source: np.ndarray, result: np.ndarray, combine: Callable,
                   finish: Callable[[np.ndarray], None] | None, segment_bytes: int) -> bool:
    """The ring allreduce of 1-D ``source`` into ``result`` (may be it) in one compiled
    call, after the agreement, as :func:`._ring.allreduce` makes it; False where it
    cannot be (nothing moved then: the Python ring must)."""
    return _run_ring(group, source, result, None, combine, finish, segment_bytes)


def ring_reduce_scatter(group: Group, source: np.ndarray, own: np.ndarray,
                        bounds: list[int], combine: Callable,
                        finish: Callable[[np.ndarray], None] | None,
                        segment_bytes: int) -> bool:
    """The ring reduce-scatter of 1-D ``source`` into ``own``, this rank's chunk of those
    between ``bounds``, in one compiled call, after the agreement, as
    :func:`._ring.reduce_scatter` makes it; False where it cannot be (nothing moved
    then: the Python ring must)."""
    return _run_ring(group, source, own, bounds, combine, finish, segment_bytes)


def allreduce_by_ring(group: Group, source: np.ndarray, result: np.ndarray, combine: Callable,
                      finish: Callable[[np.ndarray], None] | None, segment_bytes: int) -> None:
    """The ring allreduce of 1-D ``source`` into ``result`` (may be it), after the
    agreement: one compiled call (:func:`ring_allreduce`), or :mod:`._ring`'s steps in
    Python where it cannot be."""
    if not ring_allreduce(group, source, result, combine, finish, segment_bytes):
        _ring.allreduce(group, source, result, combine, finish, segment_bytes)


def reduce_scatter_by_ring(group: Group, source: np.ndarray, own: np.ndarray,
                           bounds: list[int], combine: Callable,
                           finish: Callable[[np.ndarray], None] | None,
                           segment_bytes: int) -> None:
    """The ring reduce-scatter of 1-D ``source`` into ``own`` (this rank's chunk between
    ``bounds``), after the agreement: one compiled call (:func:`ring_reduce_scatter`), or
    :mod:`._ring`'s steps in Python where it cannot be."""
    if not ring_reduce_scatter(group, source, own, bounds, combine, finish, segment_bytes):
        _ring.reduce_scatter(group, source, own, bounds, combine, finish, segment_bytes)


def _run_ring(group: Group, source: np.ndarray, result: np.ndarray, bounds: list[int] | None,
              combine: Callable, finish: Callable[[np.ndarray], None] | None,
              segment_bytes: int) -> bool:
    """The ring allreduce (``bounds`` None: even chunks) or reduce-scatter (chunks between
    ``bounds``, ``result`` this rank's) of ``source`` in one compiled call; False where
    it cannot be (a ``finish`` other than a :class:`Finisher`, or see :func:`_ring_for`)."""
    if finish is not None and not isinstance(finish, Finisher):
        return False
    gather = bounds is None
    key = (source.size, source.dtype, None if gather else tuple(bounds), combine, finish,
           segment_bytes)
    rings = group.state.setdefault("compiled rings", {})
    if key not in rings:
        if len(rings) >= _RINGS_KEPT:
            rings.clear()
        functions = mpi_functions()
        rings[key] = (None, None) if functions is None else (
            np.array([functions.handle(group.comm), functions.handle(MPI.BYTE)],
                     functions.handle_dtype),
            _ring_for(group, functions, source.dtype,
                      chunk_bounds(source.size, group.size) if gather else list(bounds),
                      gather, payload_code(source.dtype, combine), finish, segment_bytes))
    handles, ring = rings[key]
    if ring is None:
        return False
    source, result = compiled_view(source), compiled_view(result)
    if timeline.ACTIVE is None:
        error = _ring_steps(ring.words, handles, ring.factors, ring.segments, source, result,
                            _BOTH)
    else:  # the same steps, each half a phase of the timeline
        with phase("reduce-scatter", bytes=source.nbytes):
            error = _ring_steps(ring.words, handles, ring.factors, ring.segments, source,
                                result, _REDUCE_SCATTER)
        if error == 0 and gather:
            with phase("allgather", bytes=result.nbytes):
                error = _ring_steps(ring.words, handles, ring.factors, ring.segments, source,
                                    result, _ALLGATHER)
    if error != 0:
        raise MPI.Exception(error)
    return True
