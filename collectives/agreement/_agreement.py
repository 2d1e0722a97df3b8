"""Agreement: before any data moves, all ranks check they called the same collective alike.

Every collective starts with one recursive-doubling exchange of a 40-byte header of
int64s (:mod:`._call`) combined by elementwise max. Its first two fields are
``[signature, -signature]``, so that every rank ends with the largest and (minus) the
smallest signature of the group. They differ exactly when some rank's call differs, and
then every rank knows it at the same moment and settles what follows
(:mod:`._resolution`): the same :class:`~ringtrain.MismatchError` on every rank, a
barrier that keeps waiting, a joined rank that makes the others' allreduce with zeros,
or named calls that threads made in different orders matched by name. No data message
has been sent, so the library keeps working afterwards.

The exchange runs as compiled code (:mod:`..transport._compiled_steps`) where it can,
and its messages pass through shared memory where all the group's ranks share a node
(:mod:`..transport._mailboxes`), else through the MPI library's own point-to-point
calls. Small collectives ride in the same messages (:mod:`._carried`), and larger ones
that MPI's own collective moves are made in the same compiled call once the headers
have agreed (:mod:`._checked`): the check then costs no extra round trip.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ...kernels.reduction import Combine
from ..base._activity import ACTIVITY
from ..base._executor import TURN
from ..base._group import Group
from ..base._tracing import phase
from ..transport import _recursive_doubling
from ..transport._compiled_exchange import CompiledExchange, compiled_exchange
from ..transport._compiled_steps import (DIFFERENT, HEADERS, HEADERS_IF_DIFFERENT, PAYLOADS,
                                         payload_code)
from ..transport._mailboxes import mailboxes_of
from ._call import HEADER_BYTES, NO_RANK, PAYLOAD_CAPACITY, SIGNATURE_BYTES, Call, ValueRange
from ._name_matching import Order
from ._resolution import resolve_mismatch

DISAGREED = object()
"""What an exchange returns when some rank's call differed from this rank's."""


class Buffers:
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
        self._payloads: dict[tuple[np.dtype, int], PayloadViews] = {}

    def payload(self, dtype: np.dtype, count: int) -> PayloadViews:
        """The views of a payload of ``count`` elements of ``dtype``."""
        views = self._payloads.get((dtype, count))
        if views is None:
            if len(self._payloads) >= _VIEWS_KEPT:
                self._payloads.clear()
            views = self._payloads[(dtype, count)] = PayloadViews(self, dtype, count)
        return views

    def combine_headers(self, *_: Any) -> None:
        """Fold the received header into ours: elementwise max."""
        np.maximum(self.header, self.received_header, out=self.header)

    def combine_differing(self, *_: Any) -> None:
        """:meth:`combine_headers` for headers without value ranges: a no-op when the
        signatures are equal, so only then skipped."""
        if self.received_signature != self.signature:
            np.maximum(self.header, self.received_header, out=self.header)


_VIEWS_KEPT = 256


class PayloadViews:
    """A payload's place in the messages: ``message`` (header and data, as sent),
    ``data`` and ``received`` (the data areas, typed)."""

    __slots__ = ("message", "data", "received")

    def __init__(self, buffers: Buffers, dtype: np.dtype, count: int):
        end = HEADER_BYTES + count * dtype.itemsize
        self.message = buffers.message[:end]
        self.data = buffers.message[HEADER_BYTES:end].view(dtype)
        self.received = buffers.receive[HEADER_BYTES:end].view(dtype)


def buffers_of(group: Group) -> Buffers:
    buffers = group.state.get("agreement")
    if buffers is None:
        buffers = group.state["agreement"] = Buffers(
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
        enter(group, call)
        ACTIVITY.agreed()
        if local_range is None:
            return None
        return ValueRange(local_range[0], (0, 0) if local_range[1] else None)
    return _agreed(group, call, lambda buffers, made: _exchange_header(group, made, buffers,
                                                                       local_range))


def exchange_through_mailboxes(group: Group, buffers: Buffers, fresh_header: np.ndarray,
                               message: np.ndarray, fold: Callable[[np.ndarray, bool], None],
                               transport: Any) -> int:
    """The agreement's exchange from Python with ``fresh_header`` at the head of
    ``message`` (the agreement's), folded by ``fold``, what follows ``message`` made and
    taken by ``transport``: 0 where every rank's signature was ours, else
    :data:`..transport._compiled_steps.DIFFERENT`."""
    buffers.header_bytes[:] = fresh_header
    _recursive_doubling.exchange(group, message, buffers.receive, fold, transport)
    return 0 if buffers.signature == fresh_header[:SIGNATURE_BYTES].tobytes() else DIFFERENT


def enter(group: Group, call: Call) -> Call:
    """Note the call in progress for the stall inspector; returns it as this thread made
    it (see :meth:`Call.made_by`)."""
    if call.threaded and not TURN.main_only:
        call = call.made_by(TURN.caller())
    ACTIVITY.enter(group.world_ranks, call.fields)
    return call


def _agreed(group: Group, call: Call, exchange: Callable[[Buffers, Call], Any]) -> Any:
    """Run ``exchange(buffers, call)`` until every rank's call is the same (see
    :func:`._resolution.resolve`); ``call`` as this thread made it."""
    call = enter(group, call)
    buffers = buffers_of(group)
    try:
        with phase("wait for ranks"):
            return until_agreed(group, call, buffers, exchange, exchange(buffers, call))
    finally:
        ACTIVITY.agreed()


def until_agreed(group: Group, call: Call, buffers: Buffers,
                 exchange: Callable[[Buffers, Call], Any], agreed: Any) -> Any:
    """Resolve the mismatches (see :func:`._resolution.resolve`) and run ``exchange`` again until
    ``agreed``, what the last exchange returned, is not ``DISAGREED``; return it."""
    disagreeing_since = None
    while agreed is DISAGREED:
        now = time.monotonic()
        disagreeing_since = disagreeing_since or now
        resolve_mismatch(group, call, now - disagreeing_since)
        agreed = exchange(buffers, call)
    return agreed


def agree_joined(group: Group, call: Call) -> list[dict[str, Any]] | None:
    """One round of a rank that has joined (see :mod:`.._join`): meet the others' next call.

    Returns:
        Every rank's call fields, in group order, when some rank's call differs from
        ``call``; None when every rank made this same call.
    """
    if group.size == 1:
        return None
    buffers = buffers_of(group)
    # Not entered into ACTIVITY: a joined rank waits for the others by design, and the
    # stall inspector must not report it.
    with phase("joined"):
        buffers.header_bytes[:] = call.fresh_header
        _exchange_headers(group, buffers, every_step=True)
        if buffers.signature == call.header_bytes:
            return None
        return [fields for fields, _ in group.comm.allgather((call.fields, Order()))]


def _exchange_header(group: Group, call: Call, buffers: Buffers,
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
        return DISAGREED
    if local_range is None:
        return None
    header = buffers.header
    nonfinite = None if header[3] == NO_RANK else (int(-header[4]), int(header[3]))
    return ValueRange(float(header[2:3].view(np.float64)[0]), nonfinite)


def exchange_carrying(group: Group, call: Call, buffers: Buffers, views: PayloadViews,
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
        def fold(_: np.ndarray, theirs_first: bool) -> None:
            # Unequal headers mean unequal calls: the payloads may differ even in size.
            if received_signature == signature:
                if theirs_first:
                    combine(received, data, out=data)
                else:
                    combine(data, received, out=data)
            else:
                buffers.combine_headers()

        _recursive_doubling.exchange(group, views.message, buffers.receive, fold,
                                     buffers.transport)
    return data if signature == call.header_bytes else DISAGREED


def _exchange_headers(group: Group, buffers: Buffers, every_step: bool) -> None:
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
