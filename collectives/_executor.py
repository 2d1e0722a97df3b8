"""Runs collectives one at a time, in the order they were called, on one background thread.

All ranks must issue collectives in the same order. Asynchronous calls are queued and
run by a single worker thread; a blocking call waits for the queued ones before it,
then runs on the caller's thread. MPI is therefore only ever entered by one thread at a
time, and the order on every rank is the program order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from .errors import RingtrainError


class Handle:
    """An asynchronous collective in flight; complete it with :func:`ringtrain.synchronize`.

    Attributes:
        collective: name of the collective.
        name: the tensor's name, or ``None``.
    """

    def __init__(self, run: Callable[..., Any], args: tuple, collective: str, name: str | None):
        self.collective = collective
        self.name = name
        self._run = run
        self._args = args
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _execute(self) -> None:
        try:
            self._result = self._run(*self._args)
        except BaseException as error:  # handed to the waiting caller
            self._error = error
        finally:
            self._run = self._args = None
            self._done.set()

    def done(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> Any:
        """Block until finished; return the result or raise the collective's error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<Handle {self.collective} {self.name!r} {state}>"


class Executor:
    """FIFO execution of collectives: queued ones on a worker thread, blocking ones inline."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._wakeup = threading.Condition(self._mutex)
        self._queue: collections.deque[Handle] = collections.deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def run(self, run: Callable[..., Any], args: tuple, collective: str, name: str | None) -> Any:
        """Run ``run(*args)`` now, after everything queued before it; return its result."""
        if self._thread is None and not self._closed:
            # Nothing was ever queued: no other thread can be inside MPI. (Collectives
            # are called from one thread; with several, their order is not defined.)
            return run(*args)
        with self._mutex:
            self._check_open()
            inline = not self._queue and not self._busy
            if inline:
                self._busy = True
            else:
                handle = self._enqueue(run, args, collective, name)
        if not inline:
            return handle.wait()
        try:
            return run(*args)
        finally:
            with self._mutex:
                self._busy = False
                if self._queue or self._closed:
                    self._wakeup.notify()

    def submit(self, run: Callable[..., Any], args: tuple, collective: str,
               name: str | None) -> Handle:
        """Queue ``run(*args)`` for the worker thread and return its handle."""
        with self._mutex:
            self._check_open()
            return self._enqueue(run, args, collective, name)

    def close(self) -> None:
        """Finish everything queued, then stop the worker thread."""
        with self._mutex:
            self._closed = True
            self._wakeup.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _enqueue(self, run: Callable[..., Any], args: tuple, collective: str,
                 name: str | None) -> Handle:
        handle = Handle(run, args, collective, name)
        self._queue.append(handle)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ringtrain-collectives",
                                            daemon=True)
            self._thread.start()
        if not self._busy:
            self._wakeup.notify()
        return handle

    def _work(self) -> None:
        while True:
            with self._mutex:
                while self._busy or (not self._queue and not self._closed):
                    self._wakeup.wait()
                if not self._queue:
                    return
                handle = self._queue.popleft()
                self._busy = True
            try:
                handle._execute()
            finally:
                with self._mutex:
                    self._busy = False
                    if self._queue:
                        self._wakeup.notify()

    def _check_open(self) -> None:
        if self._closed:
            raise RingtrainError("ringtrain was shut down; call ringtrain.init() again")
