"""Handles of Horovod's asynchronous operations, and the names of those in flight.

One Horovod operation may take several ringtrain collectives (a grouped allgather is one
allgather per tensor) and a local step at the end (an integer average divides). A
:class:`Handle` holds the ringtrain handles and that last step; ``synchronize`` waits
for the collectives and runs it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from ... import collectives as rtc
from ...collectives import timeline


class HorovodInternalError(RuntimeError):
    """A collective failed while moving data (Horovod's name): ringtrain's
    ``CommunicationError``, MPI having reported an error, typically because a rank died.
    The one class of that name: ``hvd.HorovodInternalError`` and
    ``hvd.elastic.HorovodInternalError`` are it. Under ringtrain-run an elastic job is
    restarted from its last commit instead: nothing needs to catch it.

    Wrong arguments raise ringtrain's own errors (``MismatchError`` is a RuntimeError,
    ``InvalidArgumentError`` a ValueError).
    """


Finish = Callable[[list], Any]

_in_flight: dict[str, Handle] = {}
_lock = threading.Lock()


class Handle:
    """An operation started by one of the ``*_async`` functions.

    Pass it to :func:`poll` or :func:`synchronize`; calling it (``handle()``) also
    synchronizes, as Horovod's sparse allreduce handles do.
    """

    def __init__(self, parts: Sequence[Any], finish: Finish, key: str | None) -> None:
        self._parts = list(parts)  # ringtrain Handles, or results of blocking calls
        self._finish = finish
        self._key = key
        self._done = False
        self._result: Any = None
        self._finishing = threading.Lock()  # synchronize may come from several threads
        line = timeline.ACTIVE
        self._started = line.now() if line is not None else None

    def done(self) -> bool:
        """Whether every collective of the operation has finished."""
        return self._done or all(not isinstance(part, rtc.Handle) or part.done()
                                 for part in self._parts)

    def wait(self) -> Any:
        """Wait for the collectives, then return the operation's output (from any thread)."""
        with self._finishing:
            return self._wait()

    def _wait(self) -> Any:
        if self._done:
            return self._result
        try:
            results = [part.wait() if isinstance(part, rtc.Handle) else part
                       for part in self._parts]
        except rtc.CommunicationError as error:
            raise HorovodInternalError(str(error)) from error
        finally:
            self._release()
        self._result = self._finish(results)
        self._done, self._parts = True, []
        _record(self._key, self._started)
        return self._result

    __call__ = wait

    def _release(self) -> None:
        with _lock:
            if self._key is not None and _in_flight.get(self._key) is self:
                del _in_flight[self._key]

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<horovod Handle {self._key or '(unnamed)'} {state}>"


def reserve(key: str | None) -> None:
    """Refuse a name that an operation of this process still in flight holds (ValueError)."""
    if key is None:
        return
    with _lock:
        other = _in_flight.get(key)
        if other is not None and not other.done():
            collective, name = key.split(".", 1)
            where = f"rank {rtc.rank()}: " if rtc.is_initialized() else ""
            raise ValueError(f"{where}{collective} of tensor {name!r}: an operation of this "
                             f"name is still in flight on this rank, and names in flight "
                             f"must be unique")


def start(parts: Sequence[Any], finish: Finish, key: str | None,
          asynchronous: bool) -> Any:
    """A Handle for an operation just started (asynchronous), else its output."""
    _mark_start(key)
    handle = Handle(parts, finish, key)
    if not asynchronous:
        return handle.wait()
    if key is not None:
        with _lock:
            _in_flight[key] = handle
    return handle


def launch(asynchronous: bool, blocking: Callable[..., Any], nonblocking: Callable[..., Any],
           *args: Any, **kwargs: Any) -> Any:
    """Call a ringtrain collective: its ``*_async`` form (a ringtrain Handle) or its
    blocking form (the result)."""
    if asynchronous:
        return nonblocking(*args, **kwargs)
    try:
        return blocking(*args, **kwargs)
    except rtc.CommunicationError as error:
        raise HorovodInternalError(str(error)) from error


def forget_all() -> None:
    """Drop the names in flight (at shutdown: their handles can no longer complete)."""
    with _lock:
        _in_flight.clear()


class _Marks:
    """Whether Horovod's event names go to the running timeline, and cycle marks too."""

    active = False
    cycles = False


_MARKS = _Marks()


def mark_timeline(active: bool, cycles: bool = False) -> None:
    """Add Horovod's event names (``NEGOTIATE_ALLREDUCE``, ``ALLREDUCE``, and with
    ``cycles`` ``CYCLE_START``) to the timeline, or stop adding them."""
    _MARKS.active, _MARKS.cycles = active, cycles


def _mark_start(key: str | None) -> None:
    line = timeline.ACTIVE
    if key is None or line is None or not _MARKS.active:
        return
    if _MARKS.cycles:
        line.instant(key, "CYCLE_START")
    line.instant(key, f"NEGOTIATE_{key.split('.', 1)[0].upper()}")


def _record(key: str | None, started: float | None) -> None:
    line = timeline.ACTIVE
    if key is None or started is None or line is None or not _MARKS.active:
        return
    line.record(key, key.split(".", 1)[0].upper(), started, line.now())
