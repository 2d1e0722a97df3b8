"""Where the collectives put their phases on the timeline (see :mod:`.timeline`).

Collectives run one at a time (on the collectives thread, or inline on the caller's),
so the row of the call in progress is one module-level value, set by :func:`call_span`
around each call. :func:`phase` is a context manager for a phase of that call; while no
timeline runs, it is one global lookup and a shared do-nothing context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ContextManager

from .. import timeline
from ._activity import ACTIVITY, entry

_NOTHING = contextlib.nullcontext()
_row = "(none)"


def row_of(collective: str, name: str | None) -> str:
    """A call's row: its tensor or bucket name, else the collective."""
    return name if name is not None else f"{collective} (unnamed)"


def phase(name: str, **args: Any) -> ContextManager[Any]:
    """Record ``name`` as a phase of the call in progress, if a timeline runs."""
    line = timeline.ACTIVE
    return _NOTHING if line is None else line.span(_row, name, **args)


@contextlib.contextmanager
def call_span(line: timeline.Timeline, collective: str, name: str | None) -> Iterator[None]:
    """Record a whole call on its row, with the bytes and algorithm it agreed on."""
    global _row
    _row = row_of(collective, name)
    before = ACTIVITY.last
    with line.span(_row, collective) as args:
        yield
        last = ACTIVITY.last
        if last is not None and last is not before:
            call = entry(last)
            args.update(bytes=call.nbytes, algorithm=call.fields.get("algorithm"),
                        dtype=str(call.fields.get("dtype")))
