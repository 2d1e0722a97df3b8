"""The progress loop that moves every point-to-point operation of this process in flight.

Whatever waits (a blocking call, ``synchronize``, ``poll``) advances all of them, so
sends and receives posted together complete in any order the peers post theirs, and
MPI's progress is driven by the waiting thread. While it waits, the stall inspector
knows what for (``ACTIVITY.point_to_point``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from mpi4py import MPI

from ..base._activity import ACTIVITY, PeerWait
from ..base._executor import Handle
from ..errors import CommunicationError, RingtrainError
from ..world._world import cores_shared, world

SPIN_SECONDS = 200e-6
"""How long a wait polls without giving up its core (a near peer answers within it)."""
SHARED_SPIN_SECONDS = 20e-6
"""The same where the node runs more ranks than cores: the peer may be waiting for this
core, and a message then takes about as long as the spin, so the spin is short
(docs/lab/2026-11-26-point-to-point-data-in-the-header-and-spinning.md)."""
YIELD_SECONDS = 2e-3
"""How long it then offers its core to other processes at each poll (``sleep(0)``)
before sleeping between polls."""
_LONGEST_SLEEP = 1e-3


class PeerHandle(Handle):
    """The handle of a point-to-point call in flight: a :class:`concurrent.futures.Future`
    completed by :func:`ringtrain.synchronize` (or ``wait``/``result``), which move every
    message this process has in flight until this one is done; :func:`ringtrain.poll`
    moves them once and says whether it is."""

    settled = False
    """Whether the call has completed: what the progress loop polls (a plain attribute, where
    the future's own ``done`` takes a lock)."""
    source: int | None = None
    """For a receive: the world rank of its sender, once its message has matched (at
    once for a receive from one rank; for one from ``ANY_SOURCE``, when it arrives)."""

    def __init__(self, operation: str, name: str | None):
        super().__init__(None, (), operation, name)

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self.settled = True

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        self.settled = True

    def result(self, timeout: float | None = None) -> Any:
        """Wait (moving the messages in flight) and return the result or raise its error."""
        if not self.settled and not super().done():  # done: a callback asks, while settling
            PROGRESS.wait([self], timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait (moving the messages in flight) and return the error, if any."""
        if not self.settled and not super().done():
            PROGRESS.wait([self], timeout)
        return super().exception(0)

    def done(self) -> bool:
        """Move the messages in flight once; whether this call has completed."""
        if not self.settled:
            PROGRESS.advance_all()
        return self.settled


class Outcome:
    """How a blocking send or receive ended: what a :class:`PeerHandle` records for an
    asynchronous one, without a future (nobody else waits for it).

    Attributes:
        name: the tensor's name, or None.
        settled: whether the call has completed.
    """

    __slots__ = ("name", "settled", "source", "_result", "_error")

    def __init__(self, operation: str, name: str | None):
        self.name = name
        self.settled = False
        self.source: int | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    def set_result(self, result: Any) -> None:
        self._result, self.settled = result, True

    def set_exception(self, exception: BaseException) -> None:
        self._error, self.settled = exception, True

    def result(self, timeout: float | None = None) -> Any:
        """The result, or raise the call's error (once :attr:`settled`)."""
        if self._error is not None:
            raise self._error
        return self._result


class InFlight(Protocol):
    """What the progress loop needs of a send or receive in flight (see :mod:`._p2p_protocol`;
    the methods here are the defaults of its operations)."""

    handle: PeerHandle | Outcome
    channels: Any
    kind: str
    direction: str
    peer_world: int
    tag: int
    alone: bool

    def start(self) -> None:
        """Post the first message(s)."""

    def advance(self) -> bool:
        """Take every step that needs no waiting; whether anything moved."""
        raise NotImplementedError

    def probe_key(self) -> tuple[Any, int, int] | None:
        """For a receive still looking for its header: what MPI matches it by."""
        return None

    def wait_entry(self) -> PeerWait:
        """What the operation waits for, for the stall inspector."""
        raise NotImplementedError


class Progress:
    """Every point-to-point operation of this process in flight, advanced together.

    One thread advances them at a time (a lock); any thread may wait.
    """

    def __init__(self) -> None:
        self._pending: list[InFlight] = []
        self._lock = threading.Lock()

    def post(self, operations: Sequence[InFlight]) -> None:
        """Start ``operations`` (their first messages leave now) and keep them in flight."""
        self._in_turn(self._post, operations)

    def _post(self, operations: Sequence[InFlight]) -> bool:
        with self._lock:
            for operation in operations:
                operation.start()
                self._pending.append(operation)
            return self._advance()

    def advance_all(self) -> bool:
        """Advance every operation once (no waiting); whether anything moved.

        Under an MPI without ``MPI_THREAD_MULTIPLE``, in turn with the collectives (one
        thread in MPI at a time); otherwise alongside them, so that a collective running
        on the collectives thread never holds up a message.
        """
        return self._in_turn(self._advance_locked)

    @staticmethod
    def _in_turn(step: Callable[..., bool], *args: Any) -> bool:
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            return world().executor.run(step, args, "point-to-point", None)
        return step(*args)

    def _advance_locked(self) -> bool:
        with self._lock:
            return self._advance()

    def wait(self, handles: Sequence[PeerHandle | Outcome],
             timeout: float | None = None) -> None:
        """Advance until every one of ``handles`` is done (or ``timeout`` seconds passed)."""
        _wait_until(lambda: all(handle.settled for handle in handles), self.advance_all,
                    lambda: self._waiting_entry(handles), timeout)

    def moves_alone(self) -> bool:
        """Whether a blocking call now moves its operation alone: nothing else of this
        process in flight, and an MPI that any thread may call."""
        return not self._pending and MPI.Query_thread() >= MPI.THREAD_MULTIPLE

    def complete(self, operation: InFlight) -> Any:
        """Start ``operation``, move it until it is done and return its result (or raise
        its error).

        A blocking send or receive while nothing else of this process is in flight (the
        usual case, :meth:`moves_alone`) is moved alone, without the progress loop's list and
        lock; otherwise it joins the others (:meth:`post`, :meth:`wait`) so that it
        completes in any order with them. Messages are the same either way; alone, the
        operation takes its steps in compiled code where it can (:mod:`._p2p_compiled`).
        """
        if not self.moves_alone():
            self.post([operation])
            self.wait([operation.handle])
            return operation.handle.result()
        operation.alone = True
        operation.start()
        if not (_advance_one(operation) and operation.handle.settled):
            self.wait_alone(operation)  # else a peer that was ready: no waiting loop
        return operation.handle.result()

    @staticmethod
    def wait_alone(operation: InFlight) -> Any:
        """Move ``operation``, started and moved alone, until it is done; its result
        (or raise its error)."""
        _wait_until(lambda: operation.handle.settled, lambda: _advance_one(operation),
                    operation.wait_entry)
        return operation.handle.result()

    def _waiting_entry(self, handles: Sequence[PeerHandle | Outcome]) -> PeerWait | None:
        with self._lock:
            for operation in self._pending:
                if operation.handle in handles:
                    return operation.wait_entry()
        return None

    def _advance(self) -> bool:
        moved = False
        probing: set[tuple[Any, int, int]] = set()
        for operation in self._pending:
            key = operation.probe_key()
            if key is not None:
                # Receives matching the same messages take them in the order they were posted.
                if key in probing:
                    continue
                probing.add(key)
            moved |= _advance_one(operation)
        if moved:
            self._pending = [op for op in self._pending if not op.handle.settled]
        return moved


def _advance_one(operation: InFlight) -> bool:
    """Take the steps of ``operation`` that need no waiting; whether anything moved. An
    MPI error, or ringtrain shut down meanwhile, completes it with the error."""
    if operation.channels.messages == MPI.COMM_NULL:  # freed by shutdown()
        operation.handle.set_exception(RingtrainError(
            f"{operation.kind} of tensor {operation.handle.name!r}: ringtrain was "
            f"shut down before it completed"))
        return True
    try:
        return operation.advance()
    except MPI.Exception as error:
        operation.handle.set_exception(communication_error(
            operation.kind, operation.handle.name, operation.direction,
            operation.peer_world, operation.tag, error))
        return True


def communication_error(kind: str, name: str | None, direction: str, peer_world: int,
                        tag: int, error: MPI.Exception) -> CommunicationError:
    """The error of a send or receive (``kind``) whose MPI call failed with ``error``."""
    return CommunicationError(f"{kind} of tensor {name!r} {direction} rank {peer_world} "
                              f"(tag {tag}): MPI failed: {error}")


def _wait_until(done: Callable[[], bool], advance: Callable[[], bool],
                entry: Callable[[], PeerWait | None], timeout: float | None = None) -> None:
    """Call ``advance`` until ``done()`` (or ``timeout`` seconds passed); past
    ``YIELD_SECONDS`` without progress the stall inspector learns ``entry()``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    spin = SHARED_SPIN_SECONDS if cores_shared() else SPIN_SECONDS
    idle_since = None
    waiting = None
    try:
        while not done():
            if deadline is not None and time.monotonic() >= deadline:
                return
            if advance():
                idle_since = None
                if waiting is not None:
                    waiting = ACTIVITY.point_to_point = None
                continue
            now = time.monotonic()
            if idle_since is None:
                idle_since = now
            elif waiting is None and now - idle_since > YIELD_SECONDS:
                waiting = entry()
                ACTIVITY.point_to_point = waiting
            # MPI progresses inside the calls, which let other threads take the GIL.
            # Past a short spin, the core goes to whoever needs it (a machine with
            # more ranks than cores: the stage this one waits for), then, while the
            # peer is late, the waits grow.
            idle = now - idle_since
            if idle >= YIELD_SECONDS:
                time.sleep(min(_LONGEST_SLEEP, idle / 100))
            elif idle >= spin:
                time.sleep(0)
    finally:
        if waiting is not None:
            ACTIVITY.point_to_point = None


PROGRESS = Progress()
