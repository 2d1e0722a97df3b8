"""The timeline's file format, shared by its writer and its merger.

Each rank writes its timeline (:mod:`ringtrain.collectives.timeline`) as a Chrome
trace-event file: the events, one a line, between :data:`OPENING` and :data:`CLOSING`.
``ringtrain-run`` merges the ranks' files (:mod:`ringtrain.launcher.timeline_merge`).
Both find a rank's file with :func:`rank_path`, so the naming rule is written once.

Standard library only: the launcher imports this module.
"""

from __future__ import annotations

import os

from .variables import TIMELINE

__all__ = ["TIMELINE_VARIABLE", "OPENING", "CLOSING", "rank_path"]

TIMELINE_VARIABLE = TIMELINE.name
"""The variable that ``ringtrain-run --timeline PATH`` sets to ``PATH`` on every rank."""

OPENING = '{"displayTimeUnit": "ms", "otherData": %s, "traceEvents": [\n'
"""The text before the events; ``%s`` is the ``otherData`` object (JSON)."""

CLOSING = "\n]}\n"
"""The text after the events."""


def rank_path(path: str, rank: int, size: int) -> str:
    """The file rank ``rank`` of ``size`` ranks writes its timeline to.

    ``path`` itself when ``size`` is 1, else ``<root>.rank<R><ext>`` where
    ``root, ext = os.path.splitext(path)``, and ``ext`` is ``.json`` when ``path`` has none.

    Raises:
        ValueError: ``size`` below 1, or ``rank`` not in ``range(size)``.
    """
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"no rank {rank} among {size} ranks")
    if size == 1:
        return path
    root, extension = os.path.splitext(path)
    return f"{root}.rank{rank}{extension or '.json'}"
