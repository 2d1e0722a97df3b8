"""Plans kept for the calls like the ones that made them: a collective's arguments
validated, its algorithm chosen and its signature made once, then reused until the
settings or the process set's ranks change."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from ..base._group import Group
from ..config import Settings, current_settings
from ._process_sets import ProcessSet, resolve_group
from ._world import world


class Plan(Protocol):
    """What a cached plan was made for."""

    group: Group
    settings: Settings


P = TypeVar("P", bound=Plan)


class PlanCache(Generic[P]):
    """The plans of one collective by the arguments that decide them.

    Args:
        limit: plans kept at most (all are dropped when it is reached: a program makes
            a few kinds of call again and again).
    """

    def __init__(self, limit: int = 1024):
        self._plans: dict[Hashable, P] = {}
        self._limit = limit

    def get(self, key: Hashable, process_set: ProcessSet | None, collective: str,
            name: str | None) -> P | None:
        """The plan kept for ``key``, if it was made with the current settings and
        ``process_set``'s current group; else None (make one and :meth:`keep` it)."""
        try:
            plan = self._plans.get(key)
        except TypeError:  # an unhashable argument: making the plan says what is wrong
            return None
        if plan is None or plan.settings is not current_settings():
            return None
        group = world().group if process_set is None else \
            resolve_group(process_set, collective, name)
        return plan if plan.group is group else None

    def keep(self, key: Hashable, plan: P) -> P:
        """Keep ``plan`` for ``key`` (unless ``key`` cannot be kept); return it."""
        if len(self._plans) >= self._limit:
            self._plans.clear()
        try:
            self._plans[key] = plan
        except TypeError:
            pass
        return plan

    def clear(self) -> None:
        """Drop every plan."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
