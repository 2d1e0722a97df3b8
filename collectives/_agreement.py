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

A small uncompressed allreduce rides in the same messages: header and payload travel together and
are combined at each step, so the check costs no extra round trip. Receive buffers hold
``PAYLOAD_CAPACITY`` bytes on every rank whatever the local settings, so a rank sending
a different size still cannot overflow its partner.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..kernels.host import scale_into
from ..kernels.reduction import Combine
from . import _name_matching, _recursive_doubling
from ._activity import ACTIVITY
from ._tracing import phase
from ._executor import MAIN_THREAD, TURN
from ._group import Group
from ._name_matching import Order
from ._world import world
from .errors import ABSENT, MismatchError, UsageError, format_ranks, subject

HEADER_BYTES = 40
SIGNATURE_BYTES = 16
PAYLOAD_CAPACITY = 128 * 1024
"""Largest allreduce payload that travels with the header (fixed: part of the protocol)."""

_SIGNATURE_MASK = (1 << 62) - 1
_DIFFERENT = object()


class Call:
    """A collective call as the ranks compare it.

    Attributes:
        fields: the call's fields by name, starting with ``collective`` and ``name``;
            shown, rank by rank, in the error message.
        signature: a 62-bit digest of the fields, the same on every rank and every run.
        header: this call's signature fields, ``[signature, -signature]`` as int64.
    """

    __slots__ = ("fields", "signature", "header", "header_bytes", "threaded", "_by_thread")

    def __init__(self, **fields: Any):
        self.fields = fields
        digest = hashlib.blake2b(repr(tuple(fields.items())).encode(), digest_size=8).digest()
        self.signature = int.from_bytes(digest, "little") & _SIGNATURE_MASK
        self.header = np.array([self.signature, -self.signature], np.int64)
        self.header_bytes = self.header.tobytes()
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
    """The agreement's message buffers of one group, allocated once."""

    def __init__(self) -> None:
        self.message = np.empty(HEADER_BYTES + PAYLOAD_CAPACITY, np.uint8)
        self.receive = np.empty(HEADER_BYTES + PAYLOAD_CAPACITY, np.uint8)
        self.header = self.message[:HEADER_BYTES].view(np.int64)
        self.received_header = self.receive[:HEADER_BYTES].view(np.int64)
        self.signature = self.message[:SIGNATURE_BYTES]
        self.received_signature = self.receive[:SIGNATURE_BYTES]

    def combine_headers(self, _: np.ndarray | None = None) -> None:
        """Fold the received header into ours: elementwise max."""
        np.maximum(self.header, self.received_header, out=self.header)


def agree(group: Group, call: Call, payload: np.ndarray | None = None,
          combine: Combine | None = None, result: np.ndarray | None = None,
          prescale_factor: float = 1.0,
          local_range: tuple[float, bool] | None = None) -> ValueRange | None:
    """Check that every rank of ``group`` made the same call; optionally allreduce a payload.

    Args:
        group: the ranks.
        call: what this rank was asked to do.
        payload: a 1-D contiguous array of at most ``PAYLOAD_CAPACITY`` bytes to reduce
            with ``combine`` over all ranks, or None.
        combine: the reduction for ``payload``.
        result: where the reduced payload goes (may be ``payload``); written only
            when the check passes.
        prescale_factor: multiplies the payload before the reduction (``payload``
            itself is left as it is).
        local_range: this rank's largest finite magnitude and whether it holds inf or
            NaN, to be combined over all ranks; or None.

    Returns:
        The combined :class:`ValueRange` when ``local_range`` was given, else None.

    Raises:
        MismatchError: on every rank, when any rank's ``call`` differs.
    """
    if call.threaded and not TURN.main_only:
        call = call.made_by(TURN.caller())
    ACTIVITY.enter(group.world_ranks, call.fields)
    if group.size == 1:
        ACTIVITY.agreed()
        if payload is not None:
            scale_into(payload, prescale_factor, result)
        if local_range is None:
            return None
        return ValueRange(local_range[0], (0, 0) if local_range[1] else None)
    buffers = group.state.get("agreement")
    if buffers is None:
        buffers = group.state["agreement"] = _Buffers()
    disagreeing_since = None
    try:
        with phase("wait for ranks"):
            while True:
                agreed = _exchange(group, call, buffers, payload, combine, result,
                                   prescale_factor, local_range)
                if agreed is not _DIFFERENT:
                    return agreed
                now = time.monotonic()
                disagreeing_since = disagreeing_since or now
                _resolve_mismatch(group, call, now - disagreeing_since)
    finally:
        ACTIVITY.agreed()


def agree_joined(group: Group, call: Call) -> list[dict[str, Any]] | None:
    """One round of a rank that has joined (see :mod:`._join`): meet the others' next call.

    Returns:
        Every rank's call fields, in group order, when some rank's call differs from
        ``call``; None when every rank made this same call.
    """
    if group.size == 1:
        return None
    buffers = group.state.get("agreement")
    if buffers is None:
        buffers = group.state["agreement"] = _Buffers()
    # Not entered into ACTIVITY: a joined rank waits for the others by design, and the
    # stall inspector must not report it.
    with phase("joined"):
        buffers.header[:2] = call.header
        buffers.header[2:] = _NO_RANGE
        _recursive_doubling.exchange(group, buffers.message[:HEADER_BYTES], buffers.receive,
                                     buffers.combine_headers)
        if buffers.signature.tobytes() == call.header_bytes:
            return None
        return [fields for fields, _ in group.comm.allgather((call.fields, Order()))]


def _exchange(group: Group, call: Call, buffers: _Buffers, payload: np.ndarray | None,
              combine: Combine | None, result: np.ndarray | None, prescale_factor: float,
              local_range: tuple[float, bool] | None) -> ValueRange | None:
    header = buffers.header
    header[:2] = call.header
    header[2:] = _NO_RANGE
    if local_range is not None:
        header[2] = np.float64(local_range[0]).view(np.int64)
        if local_range[1]:
            header[3:] = (group.rank, -group.rank)
    if payload is None:
        _recursive_doubling.exchange(group, buffers.message[:HEADER_BYTES], buffers.receive,
                                     buffers.combine_headers)
    else:
        end = HEADER_BYTES + payload.nbytes
        data = buffers.message[HEADER_BYTES:end].view(payload.dtype)
        scale_into(payload, prescale_factor, data)
        received = buffers.receive[HEADER_BYTES:end].view(payload.dtype)

        def fold(_: np.ndarray) -> None:
            # Unequal headers mean unequal calls: the payloads may differ even in size.
            if buffers.received_signature.tobytes() == buffers.signature.tobytes():
                combine(data, received, out=data)
            else:
                buffers.combine_headers()

        _recursive_doubling.exchange(group, buffers.message[:end], buffers.receive, fold)
    # The combined header is [max, -min] of all signatures: ours again exactly when all agree.
    if buffers.signature.tobytes() != call.header_bytes:
        return _DIFFERENT
    if payload is not None:
        result[:] = data
    if local_range is None:
        return None
    nonfinite = None if header[3] == _NO_RANK else (int(-header[4]), int(header[3]))
    return ValueRange(float(header[2:3].view(np.float64)[0]), nonfinite)


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
    entry = ACTIVITY.current
    key = _name_matching.waiting_key(state.executor, name, group.world_ranks,
                                     state.group.size)
    state.executor.run_waiting(key)
    ACTIVITY.resume(entry)


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
