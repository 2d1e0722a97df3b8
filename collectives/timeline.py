"""The timeline: what each rank's collectives do, as a Chrome trace-event file.

Turned on by ``ringtrain-run --timeline PATH`` (which sets ``RINGTRAIN_TIMELINE=PATH`` on
every rank) or by :func:`start_timeline`; off, it costs the hot paths one global lookup::

    from . import timeline

    line = timeline.ACTIVE
    if line is not None:
        start = line.now()
    ...
    if line is not None:
        line.record(row, "pack", start, line.now(), {"bytes": nbytes})

(read ``timeline.ACTIVE``, never ``from .timeline import ACTIVE``: that copies the value
at import). A whole phase in one block is ``with line.span(row, "allreduce", ...):``.

**Viewing.** Open the file in Perfetto (https://ui.perfetto.dev, "Open trace file") or in
Chrome's ``chrome://tracing`` ("Load"). Each rank is a process named ``rank R``; each
tensor or bucket is a row (a thread) of its own, in the order first seen.

**Format.** The JSON object format of the Chrome trace-event files::

    {"displayTimeUnit": "ms", "otherData": {"rank": 0, "start_unix_us": ...},
     "traceEvents": [
    {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
    {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "allreduce 'w'"}},
    {"name": "pack", "ph": "X", "ts": 12.5, "dur": 3.25, "pid": 0, "tid": 1,
     "args": {"bytes": 4096}},
    ...
    ]}

One event a line. ``ts`` and ``dur`` are microseconds (to the nanosecond) since this
rank's timeline started; ``pid`` is the rank, ``tid`` the row. A row is any string: a
tensor or bucket name such as ``"allreduce 'w'"`` or ``"gradient bucket 2/5 [...]"``; it
is announced once, at first use, by a ``thread_name`` event (and a
``thread_sort_index``). Complete events (``"ph": "X"``) are phases, instant events
(``"ph": "i"``) moments. ``otherData.start_unix_us`` is the wall-clock time at which
the timeline started; the merge uses it to line the ranks up.

**The file is valid JSON at every moment**: it ends with the closing ``]}``, and new
events are written over that closing, followed by a new one, and flushed to the
operating system (no ``fsync``). Events are written in batches: the first event more
than :data:`FLUSH_SECONDS` after the last write writes every event kept since, as do
:meth:`Timeline.flush`, closing the timeline, and the stall inspector at each of its
checks while a call waits; a phase's text is made then too. A write per event would
cost a system call each, more than a small collective takes. A reader may load the file
while the job runs (one that reads during a write may find it cut short: reading again
gives a complete file), and a killed rank leaves a complete file behind, without the
events of its last moments.

**Phases** ringtrain records (the event names):

``"wait for ranks"``
    the agreement: this rank entered the collective and waits for the others to do so.
``"pack"``, ``"unpack"``
    copying tensors into a fusion buffer and back out.
``"compress"``, ``"decompress"``
    the compression (e.g. to fp16) before the transfer and its inverse after.
``"reduce-scatter"``, ``"allgather"``
    the two halves of the ring allreduce (and the collectives of the same names).
``"recursive doubling"``
    the recursive-doubling allreduce.
``"MPI allreduce"`` (``"MPI broadcast"``, ``"MPI allgather"``, and so on)
    the MPI library's own collective.
``"pairwise allgather"``, ``"pairwise alltoall"``
    blocks passed through the node's shared memory.
``"broadcast"``
    a broadcast's transfer.
the collective's name (``"allreduce"``, ``"broadcast"``, ...)
    the whole call, around the phases above.

**Args** of an event (where they apply): ``bytes`` (the size of the data), ``algorithm``
(the one chosen, e.g. ``"ring"``), ``dtype``, and ``error`` (the exception's type name)
on a span that ended with an exception.

**Files.** In a one-rank job the rank writes ``PATH`` itself; with more ranks each rank
writes ``<root>.rank<R><ext>`` (:func:`rank_path`: ``t.json`` -> ``t.rank0.json``, ...),
and ``ringtrain-run`` merges them into ``PATH`` when the job has ended (by hand:
``python -m ringtrain.launcher.timeline_merge OUT IN...``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import sys
import threading
import time
from typing import Any

from ..common.excepthook import before_stopping
from ..common.timeline_format import CLOSING, OPENING, TIMELINE_VARIABLE, rank_path
from .errors import NotInitializedError

__all__ = ["ACTIVE", "TIMELINE_VARIABLE", "Timeline", "rank_path", "start_timeline",
           "stop_timeline"]

ACTIVE: Timeline | None = None
"""The running timeline of this process, or None."""

_world_place: tuple[int, int] | None = None
"""ringtrain's rank and size while it is initialized (see :func:`set_world`)."""

_CLOSING = CLOSING.encode()
_starting = threading.Lock()

_closed_at_exit = False

FLUSH_SECONDS = 0.05
"""Events kept longer than this are written with the next event."""


def _plain(value: Any) -> Any:
    """A JSON value for an argument json cannot write: numpy scalars become numbers,
    anything else (a dtype) its text."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (TypeError, ValueError):
            return str(value)
        if isinstance(value, (int, float, str, bool)) or value is None:
            return value
    return str(value)


def _dumps(event: dict) -> str:
    try:
        return json.dumps(event, default=_plain, allow_nan=False)
    except (TypeError, ValueError):
        # A NaN or an infinity (not JSON), or a key json cannot write: such args as text.
        event["args"] = {str(key): _text(value) for key, value in event["args"].items()}
        return json.dumps(event, default=_plain, allow_nan=False)


_TIMES = '%.3f, "dur": %.3f}'
"""The end of a complete event's text, after its head (:meth:`_Heads.of`)."""
_HEADS_KEPT = 1024


class _Heads:
    """The text of complete events up to their times, kept by phase, row and args: a
    traced loop records the same few again and again, so an event's text is then its
    head and two numbers, without building and encoding a dict."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._heads: dict[tuple, str] = {}

    def of(self, phase: str, tid: int, args: dict | None) -> str:
        """``{"name": ..., "ph": "X", "pid": ..., "tid": ..., "args": {...}, "ts": ``."""
        try:
            key: tuple | None = (phase, tid, tuple(args.items()) if args else None)
            head = self._heads.get(key)
        except TypeError:  # an unhashable value: not kept
            key, head = None, None
        if head is None:
            whole = _dumps({"name": str(phase), "ph": "X", "pid": self._rank, "tid": tid,
                            "args": args or {}})
            head = whole[:-1] + ', "ts": '
            if key is not None:
                if len(self._heads) >= _HEADS_KEPT:
                    self._heads.clear()
                self._heads[key] = head
        return head


def _text(value: Any) -> Any:
    """``value`` if json can write it, else its ``repr``."""
    if isinstance(value, float):  # numpy's floats too
        value = float(value)
    try:
        json.dumps(value, default=_plain, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return repr(value)


def _unwritable(error: OSError, path: str) -> OSError:
    """``error`` (of its own type) saying which file could not be written, and why."""
    return type(error)(error.errno, f"cannot write the timeline file {path} "
                       f"({error.strerror or error})")


class _Span:
    """The context manager of :meth:`Timeline.span`."""

    __slots__ = ("timeline", "row", "phase", "args", "start")

    def __init__(self, timeline: Timeline, row: str, phase: str, args: dict) -> None:
        self.timeline = timeline
        self.row = row
        self.phase = phase
        self.args = args

    def __enter__(self) -> dict:
        self.start = self.timeline.now()
        return self.args

    def __exit__(self, kind: type | None, _error: object, _traceback: object) -> None:
        end = self.timeline.now()
        if kind is not None:
            self.args["error"] = kind.__name__
        self.timeline.record(self.row, self.phase, self.start, end, self.args)


class Timeline:
    """One rank's trace-event file, written in batches of events (see the module's
    description).

    Events may come from any thread. After :meth:`close`, events are ignored.

    Args:
        path: the file; created or truncated.
        rank: this process's rank: the process id of its events.

    Raises:
        OSError: the file cannot be written; the message names it.
    """

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self._rows: dict[str, int] = {}
        self._origin = time.perf_counter()
        self._monotonic_origin = time.clock_gettime(time.CLOCK_MONOTONIC)
        start_unix_us = time.time_ns() / 1000
        try:
            self._file = open(path, "wb")
        except OSError as error:
            raise _unwritable(error, path) from None
        other = json.dumps({"rank": rank, "start_unix_us": start_unix_us})
        head = (OPENING % other).encode()
        head += _dumps({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                        "args": {"name": f"rank {rank}"}}).encode()
        head += b",\n" + _dumps({"name": "process_sort_index", "ph": "M", "pid": rank,
                                 "tid": 0, "args": {"sort_index": rank}}).encode()
        try:
            self._file.write(head + _CLOSING)
            self._file.flush()
        except OSError as error:
            with contextlib.suppress(OSError):
                self._file.close()  # flushes again, and fails again
            raise _unwritable(error, path) from None
        self._end = len(head)  # where the closing text starts
        # Events not yet written: text, or a phase's (phase, tid, args, start_ns,
        # duration_ns), made into text when written (see _text_of).
        self._kept: list[str | tuple] = []
        self._heads = _Heads(rank)
        self._written_at = time.monotonic()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has been called (or writing failed)."""
        return self._file is None

    def now(self) -> float:
        """Microseconds since this timeline started."""
        return (time.perf_counter() - self._origin) * 1e6

    def from_monotonic(self, seconds: float) -> float:
        """A time of ``time.clock_gettime(time.CLOCK_MONOTONIC)`` (as compiled code takes
        it) in microseconds since this timeline started, as :meth:`now` gives them."""
        return (seconds - self._monotonic_origin) * 1e6

    def _write(self, events: list[str | tuple]) -> None:
        """Keep ``events``; write the kept ones where :data:`FLUSH_SECONDS` have passed
        since the last write. Holds the lock."""
        self._kept += events
        if time.monotonic() - self._written_at >= FLUSH_SECONDS:
            self._write_kept()

    def flush(self) -> None:
        """Write every event kept so far."""
        with self._lock:
            if self._file is not None and self._kept:
                self._write_kept()

    def _write_kept(self) -> None:
        """Write the kept events over the closing text, then the closing text again. Holds
        the lock."""
        data = "".join(",\n" + self._text_of(event) for event in self._kept).encode()
        self._kept = []
        self._written_at = time.monotonic()
        try:
            self._file.seek(self._end)
            self._file.write(data + _CLOSING)
            self._file.flush()
        except (OSError, ValueError) as error:
            # Training goes on without its timeline rather than failing on a full disk.
            file, self._file = self._file, None
            with contextlib.suppress(OSError, ValueError):
                file.close()
            sys.stderr.write(f"ringtrain: the timeline {self.path} stopped: cannot write it "
                             f"({error})\n")
            return
        self._end += len(data)

    def _text_of(self, event: str | tuple) -> str:
        """A kept event's text."""
        if isinstance(event, str):
            return event
        phase, tid, args, start_ns, duration_ns = event
        return self._heads.of(phase, tid, args) + _TIMES % (start_ns / 1000, duration_ns / 1000)

    def _row_id(self, row: str, events: list[str | tuple]) -> int:
        """The row's thread id; a new row's metadata is added to ``events``. Holds the lock."""
        tid = self._rows.get(row)
        if tid is None:
            tid = self._rows[row] = len(self._rows) + 1
            events.append(_dumps({"name": "thread_name", "ph": "M", "pid": self.rank,
                                  "tid": tid, "args": {"name": str(row)}}))
            events.append(_dumps({"name": "thread_sort_index", "ph": "M", "pid": self.rank,
                                  "tid": tid, "args": {"sort_index": tid}}))
        return tid

    def record(self, row: str, phase: str, start_us: float, end_us: float,
               args: dict | None = None) -> None:
        """Write one phase: a complete event on ``row`` from ``start_us`` to ``end_us``.

        Args:
            row: the tensor or bucket it belongs to (its row in the viewer).
            phase: the phase's name (see the module's list).
            start_us: its start, from :meth:`now`.
            end_us: its end, from :meth:`now`.
            args: shown with the event, e.g. ``{"bytes": 4096, "algorithm": "ring"}``;
                not to be changed afterwards (the event's text is made when written).
        """
        self.record_phases(row, [(phase, start_us, end_us, args)])

    def record_phases(self, row: str,
                      phases: list[tuple[str, float, float, dict | None]]) -> None:
        """Write several phases on ``row`` at once: ``(phase, start_us, end_us, args)``
        each, as :meth:`record` takes them."""
        if self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            events: list[str | tuple] = []
            tid = self._row_id(row, events)
            for phase, start_us, end_us, args in phases:
                start_ns = round(start_us * 1000)
                # Rounding both ends (not the duration) keeps nested phases nested.
                duration_ns = max(0, round(end_us * 1000) - start_ns)
                events.append((phase, tid, args, start_ns, duration_ns))
            self._write(events)

    def span(self, row: str, phase: str, **args: Any) -> _Span:
        """A context manager recording its body as a phase on ``row``.

        ``with line.span(row, "allreduce", bytes=n) as args:`` -- ``args`` is the dict of
        arguments, which the body may add to (``args["algorithm"] = "ring"``). When the
        body raises, the event gets ``error``: the exception's type name, and the
        exception goes on.
        """
        return _Span(self, row, phase, args)

    def instant(self, row: str, phase: str, **args: Any) -> None:
        """Write a moment on ``row`` (an instant event, ``"ph": "i"``), now."""
        if self._file is None:
            return
        when = round(self.now(), 3)
        with self._lock:
            if self._file is None:
                return
            events: list[str | tuple] = []
            tid = self._row_id(row, events)
            events.append(_dumps({"name": str(phase), "ph": "i", "s": "t", "ts": when,
                                  "pid": self.rank, "tid": tid, "args": args}))
            self._write(events)

    def close(self) -> None:
        """Write the kept events and close the file; later events are ignored."""
        with self._lock:
            if self._file is not None and self._kept:
                self._write_kept()
            file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError, ValueError):
                file.close()

    def __repr__(self) -> str:
        state = "closed" if self._file is None else f"{len(self._rows)} rows"
        return f"<Timeline of rank {self.rank} at {self.path!r}, {state}>"


def set_world(place: tuple[int, int] | None) -> None:
    """Tell the timeline ringtrain's ``(rank, size)``, the defaults of
    :func:`start_timeline`: called by ``ringtrain.init``, and with None by ``shutdown``."""
    global _world_place
    _world_place = place


def start_timeline(path: str, rank: int | None = None, size: int | None = None) -> None:
    """Start writing this process's timeline; it becomes :data:`ACTIVE`.

    A running timeline is closed first (also when the new one then fails). The file is
    ``rank_path(path, rank, size)``: ``path`` itself with one rank, else
    ``<root>.rank<R><ext>``.

    Args:
        path: the job's timeline, e.g. ``$RINGTRAIN_TIMELINE``.
        rank: this process's rank; default ringtrain's (:func:`ringtrain.rank`).
        size: the number of ranks; default ringtrain's (:func:`ringtrain.size`).

    Raises:
        NotInitializedError: ``rank`` or ``size`` left out before ``ringtrain.init()``.
        OSError: the file cannot be written; the message names it.
        ValueError: ``rank`` not in ``range(size)``.
    """
    global ACTIVE, _closed_at_exit
    if rank is None or size is None:
        place = _world_place
        if place is None:
            raise NotInitializedError(
                "ringtrain is not initialized: call ringtrain.init() first")
        rank = place[0] if rank is None else rank
        size = place[1] if size is None else size
    file = rank_path(path, rank, size)
    with _starting:
        stop_timeline()
        ACTIVE = Timeline(file, rank)
        if not _closed_at_exit:  # the events kept when the process ends are written
            atexit.register(stop_timeline)
            before_stopping(stop_timeline)
            _closed_at_exit = True


def stop_timeline() -> None:
    """Close the running timeline, if any; :data:`ACTIVE` becomes None."""
    global ACTIVE
    line, ACTIVE = ACTIVE, None
    if line is not None:
        line.close()
