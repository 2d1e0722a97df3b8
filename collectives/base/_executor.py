"""Runs collectives one at a time, in the order they were called, whatever the thread.

All ranks must issue collectives in the same order. Asynchronous calls are queued and
run by a single worker thread; a blocking call waits for the queued ones before it,
then runs on the caller's thread. Whichever thread a call comes from, one call at a
time holds the turn (one lock, taken without waiting when it is free: a small part of
the Python around a call), so two calls' messages never interleave and MPI is entered by
one thread at a time.

Calls made by several threads reach the ranks in different orders; the agreement
matches named ones by name (see :mod:`._name_matching`), using what this module
tells of the calls waiting for their turn (:meth:`Executor.waiting_names`) and running
the one the ranks chose out of turn (:meth:`Executor.run_waiting`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from threading import get_ident
from typing import Any

from ..errors import RingtrainError

MatchKey = tuple[str, Any]
"""What a waiting named call is matched by: its tensor name and its process set (None
for all ranks)."""

MAIN_THREAD = threading.main_thread()
MAIN_IDENT = MAIN_THREAD.ident


class _Turn:
    """The call holding the turn: the thread that made it, when that is not the thread
    running it (a queued call: set while it runs), else None. The agreement needs it:
    unnamed calls of different threads must not meet."""

    thread: threading.Thread | None = None
    main_only = True
    """Whether every call so far came from the main thread (then ``thread`` is moot)."""

    def caller(self) -> threading.Thread:
        """The thread that made the call in progress."""
        return self.thread or threading.current_thread()


TURN = _Turn()


class Handle(concurrent.futures.Future):
    """An asynchronous collective in flight; complete it with :func:`ringtrain.synchronize`.

    A :class:`concurrent.futures.Future`: ``result(timeout)``, ``exception()``,
    ``add_done_callback``, :func:`concurrent.futures.wait` and
    :func:`concurrent.futures.as_completed` work on it, from any thread. It cannot be
    cancelled (the other ranks take part in the collective): :meth:`cancel` returns False.

    Attributes:
        collective: name of the collective.
        name: the tensor's name, or ``None``.
    """

    def __init__(self, run: Callable[..., Any], args: tuple, collective: str,
                 name: str | None, match_key: MatchKey | None = None):
        super().__init__()
        self.collective = collective
        self.name = name
        self.match_key = match_key
        self.caller = threading.current_thread()
        self._run: Callable[..., Any] | None = run
        self._args: tuple | None = args

    def _execute(self) -> None:
        self.set_running_or_notify_cancel()
        outer, TURN.thread = TURN.thread, self.caller
        try:
            result = self._run(*self._args)
        except BaseException as error:  # handed to the waiting caller
            self.set_exception(error)
        else:
            self.set_result(result)
        finally:
            self._run = self._args = None
            TURN.thread = outer

    def cancel(self) -> bool:
        """Refused: a collective, once submitted, must run on every rank. Returns False."""
        return False

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished; return the result or raise the collective's error.

        Args:
            timeout: seconds to wait at most (``concurrent.futures.TimeoutError`` then;
                the collective goes on).
        """
        return self.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<Handle {self.collective} {self.name!r} {state}>"


class Executor:
    """FIFO execution of collectives: queued ones on a worker thread, blocking ones inline.

    Attributes:
        several_threads: whether calls have come from more than one thread of this
            process (the worker thread aside).
    """

    def __init__(self) -> None:
        self._turn = threading.Lock()
        self._take_turn, self._end_turn = self._turn.acquire, self._turn.release
        self._mutex = threading.Lock()
        self._wakeup = threading.Condition(self._mutex)
        self._queue: collections.deque[Handle] = collections.deque()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._worker = -1
        self._caller = -1
        self._holder = -1
        self.several_threads = False

    def run(self, run: Callable[..., Any], args: tuple, collective: str, name: str | None,
            match_key: MatchKey | None = None) -> Any:
        """Run ``run(*args)`` now, after everything queued before it; return its result."""
        caller = get_ident()
        if caller != self._caller:
            self._note_caller(caller)
        # Queued calls go first: one queued by this thread is either still in the queue
        # or running on the worker, which then holds the turn.
        if not self._queue and self._take_turn(False):
            self._holder = caller
            try:
                if self._closed:
                    self._check_open()
                return run(*args)
            finally:
                self._holder = -1
                self._end_turn()
        if caller == self._holder:  # a call made inside the call in progress
            return run(*args)
        return self._submit(run, args, collective, name, match_key).wait()

    def submit(self, run: Callable[..., Any], args: tuple, collective: str,
               name: str | None, match_key: MatchKey | None = None) -> Handle:
        """Queue ``run(*args)`` for the worker thread and return its handle."""
        caller = get_ident()
        if caller != self._caller:
            self._note_caller(caller)
        return self._submit(run, args, collective, name, match_key)

    def holds_turn(self) -> bool:
        """Whether the calling thread is inside the call in progress (e.g. in a callback
        that a completing call runs): a blocking call made there runs at once."""
        return get_ident() == self._holder

    def waiting_names(self) -> list[MatchKey]:
        """The match keys of the named calls waiting for their turn, in queue order."""
        with self._mutex:
            return [handle.match_key for handle in self._queue if handle.match_key is not None]

    def run_waiting(self, match_key: MatchKey) -> None:
        """Run the first waiting call with ``match_key`` now, on this thread, out of turn.

        Only the thread holding the turn (inside a call) may do this; the call's result
        or error goes to its handle.

        Raises:
            LookupError: no waiting call has that key.
        """
        with self._mutex:
            handle = next((h for h in self._queue if h.match_key == match_key), None)
            if handle is None:
                raise LookupError(match_key)
            self._queue.remove(handle)
        handle._execute()

    def close(self, timeout: float | None = None) -> bool:
        """Finish everything queued, then stop the worker thread.

        Args:
            timeout: seconds to wait at most for the worker thread (None: until it ends).

        Returns:
            Whether the worker thread has ended (or never ran).
        """
        with self._mutex:
            self._closed = True
            self._wakeup.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return thread is None

    def _note_caller(self, caller: int) -> None:
        if caller == self._worker:
            return
        if caller != MAIN_IDENT:
            TURN.main_only = False
        if self._caller == -1:
            self._caller = caller
        else:
            self.several_threads = True

    def _submit(self, run: Callable[..., Any], args: tuple, collective: str,
                name: str | None, match_key: MatchKey | None) -> Handle:
        handle = Handle(run, args, collective, name, match_key)
        with self._mutex:
            self._check_open()
            self._queue.append(handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="ringtrain-collectives",
                                                daemon=True)
                self._thread.start()
                self._worker = self._thread.ident
            self._wakeup.notify()
        return handle

    def _work(self) -> None:
        me = get_ident()
        while True:
            with self._mutex:
                while not self._queue and not self._closed:
                    self._wakeup.wait()
                if not self._queue:
                    return
            with self._turn:
                with self._mutex:  # a call holding the turn may have run it out of turn
                    handle = self._queue.popleft() if self._queue else None
                if handle is not None:
                    self._holder = me
                    try:
                        handle._execute()
                    finally:
                        self._holder = -1

    def _check_open(self) -> None:
        if self._closed:
            raise RingtrainError("ringtrain was shut down; call ringtrain.init() again")
