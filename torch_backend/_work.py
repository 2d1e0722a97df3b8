"""The ``Work`` objects the backend's calls return: one already completed (a call that
ran on the caller's thread), one in flight (a call queued on ringtrain's collectives
thread, or a point-to-point message in flight).

torch reads a call's outcome through ``wait()`` and ``get_future()``; the future's value
is the list of the call's output tensors, which DDP's communication hooks read.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from concurrent.futures import Future as _HandleFuture
from typing import Any

import torch
import torch.distributed as dist

Finish = Callable[[Any], list[torch.Tensor]]
"""Turns what a ringtrain call returned into the output tensors of the torch call."""


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """A torch timeout in seconds; torch's "no timeout" (zero) is None."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
        else float(timeout)
    return seconds if seconds > 0 else None


class CompletedWork(dist.Work):
    """The work of a call that completed before it returned."""

    def __init__(self, outputs: list[torch.Tensor], source_rank: int = -1):
        super().__init__()
        self._outputs = outputs
        self._source = source_rank

    def holding(self, outputs: list[torch.Tensor]) -> CompletedWork:
        """This work again, now of ``outputs``: a blocking call (``async_op=False``),
        whose work torch waits for once and drops, reuses its group's one."""
        self._outputs = outputs
        return self

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._outputs)
        return future

    def source_rank(self) -> int:
        return self._source

    _source_rank = source_rank


class WorkInFlight(dist.Work):
    """The work of a call whose ringtrain handle completes later.

    Args:
        handle: the ringtrain handle (a :class:`concurrent.futures.Future`).
        finish: turns the handle's result into the output tensors (copies into the
            caller's tensors where the result is a new array); runs once, on the thread
            that completes the handle, before the future is set.
        source_rank: for a receive from any rank, a callable giving the sender's rank in
            the group once the handle is complete.
    """

    def __init__(self, handle: _HandleFuture, finish: Finish,
                 source_rank: Callable[[], int] | None = None):
        super().__init__()
        self._handle = handle
        self._finish = finish
        self._source = source_rank
        self._outputs: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()
        self._settled = threading.Event()
        handle.add_done_callback(self._settle)

    def _settle(self, handle: _HandleFuture) -> None:
        try:
            self._outputs = self._finish(handle.result())
        except BaseException as error:  # the caller meets it in wait() or the future
            self._error = error
        with self._lock:
            self._settled.set()
            future = self._future
        if future is not None:
            self._complete(future)

    def _complete(self, future: torch.futures.Future) -> None:
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._outputs)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the call is done; raise its error (ringtrain's own exception)."""
        self._handle.exception(_seconds(timeout))  # waits (moving messages); may time out
        self._settled.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._handle.done() and self._settled.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self.is_completed() else None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A torch future completed with the output tensors (or the call's error)."""
        with self._lock:
            if self._future is not None:
                return self._future
            future: torch.futures.Future = torch.futures.Future()
            self._future = future
            settled = self._settled.is_set()
        if settled:
            self._complete(future)
        return future

    def source_rank(self) -> int:
        self.wait()
        return -1 if self._source is None else self._source()

    _source_rank = source_rank
