"""Where the collectives put their phases on the timeline (see :mod:`.timeline`).

Collectives run one at a time (on the collectives thread, or inline on the caller's),
so the row of the call in progress is one module-level value, set by :func:`call_span`
around each call. :func:`phase` is a context manager for a phase of that call; while no
timeline runs, it is one global lookup and a shared do-nothing context.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

from .. import timeline
from ._activity import ACTIVITY, Entry, entry

_NOTHING = contextlib.nullcontext()
_row = "(none)"


def row_of(collective: str, name: str | None) -> str:
    """A call's row: its tensor or bucket name, else the collective."""
    return name if name is not None else f"{collective} (unnamed)"


def phase(name: str, **args: Any) -> ContextManager[Any]:
    """Record ``name`` as a phase of the call in progress, if a timeline runs."""
    line = timeline.ACTIVE
    return _NOTHING if line is None else line.span(_row, name, **args)


def record_stamped(phases: tuple[str, ...], seconds: list[float], args: dict) -> None:
    """Record the ``phases`` of the call in progress between consecutive ``seconds`` (of
    the monotonic clock, as a compiled call took them), if a timeline runs: the first
    phase (the agreement's) plain, the others with ``args`` (not to be changed
    afterwards)."""
    line = timeline.ACTIVE
    if line is None:
        return
    times = [line.from_monotonic(second) for second in seconds]
    line.record_phases(_row, [(name, times[index], times[index + 1], args if index else None)
                              for index, name in enumerate(phases)])


def call_span(line: timeline.Timeline, collective: str, name: str | None) -> _CallSpan:
    """Record a whole call on its row, with the bytes and algorithm it agreed on:
    ``with call_span(line, collective, name):``."""
    global _row
    _row = row_of(collective, name)
    return _CallSpan(line, collective)


_CALLS_KEPT = 1024
_call_args: dict[int, tuple[dict, dict]] = {}
"""The args of a call's event by its fields (a kept call's are one dict): the fields
themselves, to tell a dict that took the id of one gone, and the args."""


def _args_of(call: Entry) -> dict[str, Any]:
    """The call's args on the timeline: the bytes, algorithm and dtype it agreed on (one
    dict per kind of call, not to be changed)."""
    fields = call.fields
    kept = _call_args.get(id(fields))
    if kept is not None and kept[0] is fields:
        return kept[1]
    if len(_call_args) >= _CALLS_KEPT:
        _call_args.clear()
    args = {"bytes": call.nbytes, "algorithm": fields.get("algorithm"),
            "dtype": str(fields.get("dtype"))}
    _call_args[id(fields)] = (fields, args)
    return args


class _CallSpan:
    """The context manager of :func:`call_span`."""

    __slots__ = ("_line", "_collective", "_before", "_start")

    def __init__(self, line: timeline.Timeline, collective: str) -> None:
        self._line, self._collective = line, collective

    def __enter__(self) -> None:
        self._before = ACTIVITY.last
        self._start = self._line.now()

    def __exit__(self, kind: type | None, _error: object, _traceback: object) -> None:
        end = self._line.now()
        args: dict[str, Any] = {}
        last = ACTIVITY.last
        if last is not None and last is not self._before:
            args = _args_of(entry(last))
        if kind is not None:
            args = {**args, "error": kind.__name__}
        self._line.record(_row, self._collective, self._start, end, args)
