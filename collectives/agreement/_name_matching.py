"""Named calls that reach the ranks in different orders are matched by name.

Two threads of a rank may each call a collective; which of them takes the turn first
differs from rank to rank. When the ranks' calls differ, the agreement (see
:mod:`._agreement`) gathers every rank's call, and with it what this module adds: the
names of the calls waiting for their turn on that rank (same process set), whether
calls came from several threads there, and how long the ranks have been disagreeing.
From that, every rank decides the same thing (:func:`choose`):

- a name that every rank has made or has waiting runs now: the ranks whose call it is
  exchange theirs again, the others run their waiting call of that name out of turn,
  then go back to their own call (so a call made everywhere runs, in one agreed order);
- when no name is common yet but calls came from several threads somewhere (or from a
  thread other than the main thread), the ranks wait a little and look again, as the
  other thread's call may be on its way, for at most ``name_match_seconds`` (a setting;
  the lowest rank's value decides);
- otherwise the calls really differ: every rank raises the same MismatchError, which,
  when several threads were calling, says to name the calls or make them from one thread.

Unnamed calls are not matched: they keep each rank's program order, and those of two
different threads never meet (their signatures carry the thread's name, see
:meth:`._agreement.Call.made_by`). Nothing of this runs while the ranks' calls agree;
it costs nothing on that path.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..base._executor import MAIN_THREAD, TURN, Executor, MatchKey
from ..config import current_settings
from ..errors import format_ranks

WAIT = "wait"
"""What :func:`choose` returns when the ranks should look again shortly."""


@dataclasses.dataclass(frozen=True)
class Order:
    """What one rank tells the others of its calls when they disagree.

    Attributes:
        waiting: names of its calls (on the same ranks) waiting for their turn.
        several_threads: whether calls came from more than one of its threads, or its
            current call from a thread other than the main thread.
        waited: seconds this rank has disagreed with the others on its current call.
        limit: how long this rank would look for a common name (the lowest rank's
            limit decides, so that every rank decides alike).
    """

    waiting: tuple[str, ...] = ()
    several_threads: bool = False
    waited: float = 0.0
    limit: float = 0.0


def local_order(executor: Executor, world_ranks: tuple[int, ...], all_ranks: int,
                waited: float) -> Order:
    """This rank's :class:`Order` for a call on ``world_ranks`` (of ``all_ranks`` ranks)."""
    names = tuple(name for name, process_set in executor.waiting_names()
                  if _ranks(process_set, all_ranks) == world_ranks)
    threaded = executor.several_threads or TURN.caller() is not MAIN_THREAD
    return Order(names, threaded, waited, current_settings().name_match_seconds)


def waiting_key(executor: Executor, name: str, world_ranks: tuple[int, ...],
                all_ranks: int) -> MatchKey:
    """The key of this rank's first waiting call named ``name`` on ``world_ranks``."""
    return next(key for key in executor.waiting_names()
                if key[0] == name and _ranks(key[1], all_ranks) == world_ranks)


def _ranks(process_set: Any, all_ranks: int) -> tuple[int, ...]:
    return tuple(range(all_ranks)) if process_set is None else tuple(process_set.ranks)


def choose(names: list[str | None], orders: list[Order]) -> str | None:
    """Decide, identically on every rank, what follows a disagreement.

    Args:
        names: each rank's current call's tensor name (None when unnamed), by rank.
        orders: each rank's :class:`Order`, by rank.

    Returns:
        The name every rank runs next, :data:`WAIT`, or None when the calls differ
        for good.
    """
    if len(set(names)) == 1:  # the same call everywhere, made differently
        return None
    available = [set(order.waiting) | ({name} if name is not None else set())
                 for name, order in zip(names, orders)]
    candidates = [name for name in names if name is not None]
    candidates += [name for order in orders for name in order.waiting]
    for candidate in candidates:
        if all(candidate in names_there for names_there in available):
            return candidate
    if threaded_ranks(orders) and max(order.waited for order in orders) < orders[0].limit:
        return WAIT
    return None


def threaded_ranks(orders: list[Order]) -> list[int]:
    """The ranks (group ranks) where calls came from several threads."""
    return [rank for rank, order in enumerate(orders) if order.several_threads]


def pause(orders: list[Order]) -> None:
    """Sleep before the ranks look again: short at first, longer as they keep waiting."""
    waited = max(order.waited for order in orders)
    time.sleep(min(0.02, 0.0005 + waited / 20))


def threads_hint(world_ranks: tuple[int, ...], names: list[str | None],
                 orders: list[Order]) -> str | None:
    """What the MismatchError adds when different calls came from several threads."""
    threaded = threaded_ranks(orders)
    if not threaded or len(set(names)) == 1:
        return None
    where = format_ranks([world_ranks[rank] for rank in threaded])
    return (f"calls came from several threads on {where}, and the ranks made them in "
            f"orders that no name matched: give each call a name= that is the same on "
            f"every rank (named calls are matched by name; unnamed ones keep each rank's "
            f"order), or make them from one thread")
