"""The timeline's file format, shared by its writer and its merger.

Each rank writes its timeline (:mod:`ringtrain.collectives.timeline`) as a Chrome
trace-event file: the events, one a line, between :data:`OPENING` and :data:`CLOSING`.
``ringtrain-run`` merges the ranks' files (:mod:`ringtrain.launcher.timeline_merge`), and
so do the ranks themselves under a plain ``mpiexec``, with :func:`merge_files`. All find a
rank's file with :func:`rank_path`, so the naming rule is written once.

Standard library only: the launcher imports this module.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import BinaryIO

from .atomic_file import write_atomically
from .environment import TIMELINE

__all__ = ["TIMELINE_VARIABLE", "OPENING", "CLOSING", "rank_path", "read_trace", "merge",
           "merge_files"]

MERGE_PROG = "timeline_merge"
"""What a merge's warning lines start with, by default."""

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


def _warn(prefix: str, message: str) -> None:
    sys.stderr.flush()
    sys.stderr.write(f"{prefix}: warning: {message}\n")
    sys.stderr.flush()


def read_trace(path: str) -> tuple[list, dict]:
    """The events of a trace file and its ``otherData``.

    Raises:
        ValueError: the file is empty or not a trace (the message says which).
        OSError: it cannot be read.
    """
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if not text.strip():
        raise ValueError("empty")
    try:
        trace = json.loads(text)
    except ValueError as error:
        raise ValueError(f"not valid JSON ({error})") from None
    if isinstance(trace, list):  # the JSON array format of the trace-event files
        return trace, {}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a trace (no traceEvents list)")
    other = trace.get("otherData")
    return trace["traceEvents"], other if isinstance(other, dict) else {}


def _start(other: dict) -> float | None:
    start = other.get("start_unix_us")
    return float(start) if isinstance(start, (int, float)) else None


def merge_files(rank_files: Sequence[str], out_path: str,
                prefix: str = MERGE_PROG) -> tuple[int, list[str]]:
    """Like :func:`merge`; also returns the files that were merged, and warnings start with
    ``prefix``."""
    starts: dict[str, float | None] = {}
    for path in rank_files:
        try:
            _, other = read_trace(path)
        except FileNotFoundError:
            _warn(prefix, f"timeline {path} skipped: no such file")
            continue
        except (OSError, ValueError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else error
            _warn(prefix, f"timeline {path} skipped: {reason}")
            continue
        starts[path] = _start(other)
    known = [start for start in starts.values() if start is not None]
    origin = min(known) if known else None
    events = 0
    merged: list[str] = []

    def write(handle: BinaryIO) -> None:
        nonlocal events
        other = {"ranks": len(starts)}
        if origin is not None:
            other["start_unix_us"] = origin
        handle.write((OPENING % json.dumps(other)).encode())
        for path, start in starts.items():
            try:
                file_events, _ = read_trace(path)
            except (OSError, ValueError) as error:  # changed since it was first read
                _warn(prefix, f"timeline {path} skipped: {error}")
                continue
            shift = 0.0 if start is None or origin is None else start - origin
            for event in file_events:
                if shift and isinstance(event, dict) \
                        and isinstance(event.get("ts"), (int, float)):
                    event["ts"] = round(event["ts"] + shift, 3)
                handle.write(((",\n" if events else "") + json.dumps(event)).encode())
                events += 1
            merged.append(path)
        handle.write(CLOSING.encode())

    write_atomically(out_path, write)
    return events, merged


def merge(rank_files: list[str], out_path: str) -> int:
    """Merge the ranks' timeline files into the one trace ``out_path``.

    The events keep their process ids (the ranks). Each file's events are shifted so that
    the ranks' clocks line up (see the module's description). ``out_path`` is written
    whole and then renamed into place, so it may be one of ``rank_files``.

    Args:
        rank_files: the per-rank files; one that is missing, empty or not a trace is
            skipped with a warning line on stderr.
        out_path: the merged trace (Chrome trace-event JSON object format).

    Returns:
        The number of events written (metadata events included).

    Raises:
        OSError: ``out_path`` cannot be written.
    """
    return merge_files(rank_files, out_path)[0]
