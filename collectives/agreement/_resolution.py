"""What follows a disagreement, decided identically on every rank (:func:`resolve`):
the same :class:`~ringtrain.MismatchError` everywhere; a barrier that keeps waiting
while the collective the other ranks made fails; a rank that joined
(:mod:`.._join`) making an allreduce the others made again, with zeros. Named calls
that threads made in different orders are matched by name (:mod:`._name_matching`):
the call every rank made or has waiting runs first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base._activity import ACTIVITY
from ..base._executor import MAIN_THREAD
from ..base._group import Group
from ..errors import ABSENT, MismatchError, UsageError, format_ranks, subject
from ..world._world import world
from . import _name_matching
from ._call import Call


def resolve_mismatch(group: Group, call: Call, waited: float) -> None:
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
