"""How one point-to-point message travels, checked by the pair, and the engine that
moves every message in flight.

A send starts with a header: magic, whether the data follows in the same message,
the dtype, the shape, the sender's sequence number and the tensor's name. The receiver
takes it with a matched probe (``Improbe`` then ``Mrecv``), so it learns the message's
size before receiving it and a message larger than expected is never truncated. It
compares the header with what it expected (shape, dtype, name) and replies:

    small (data <= INLINE_MAX_BYTES)     large
    A --header+data--> B                 A --header--> B
    A <----reply------ B                 A ----data--> B   (tagged by sequence number)
                                         A <---reply-- B

So the check costs no extra message before the data: the reply travels back while the
data is already there (in a ping-pong it rides just before the answer). A large
tensor's data is posted right behind its header, and the receiver, having read the
header, posts its receive straight into the target (MPI's own rendezvous then moves it
without a copy). A reply that refuses the message carries the differences, and both
ranks raise the same :class:`~ringtrain.errors.MessageMismatchError`; the receiver
drains a refused large message's data into a scratch buffer, so nothing is written
and nothing is left in flight, and the library stays usable.

A send completes when the receiver has accepted it (like ``MPI_Ssend``): ``send``
returns then, and an ``isend``'s handle is done. Every operation is a small state
machine: :class:`Engine` advances all of this process's operations in flight whenever
any of them is waited for, so sends and receives posted together complete in any order
(no deadlock whatever the order of a batch), and MPI's progress is driven by the
waiting thread. While it waits, the stall inspector knows what for (``ACTIVITY``).
"""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ._activity import ACTIVITY, PeerWait
from ._executor import Handle
from ._ops import COPY_DTYPES
from ._p2p_channels import Channels
from ._world import world
from .errors import CommunicationError, MessageMismatchError, RingtrainError

INLINE_MAX_BYTES = 64 * 1024
"""Largest data that travels in the header's message (the sender decides: the header
says which way the data comes)."""

_MAGIC = 0x52545032  # "RTP2"
_FIXED = 6  # magic, inline, dtype index, ndim, sequence, name length
_NO_NAME = -1
_ACCEPTED = b"\x00"
_REFUSED = b"\x01"
SPIN_SECONDS = 50e-6
"""How long a wait polls without giving up its core (a near peer answers within it)."""
YIELD_SECONDS = 2e-3
"""How long it then offers its core to other processes at each poll (``sleep(0)``)
before sleeping between polls."""
_LONGEST_SLEEP = 1e-3


def dtype_index(dtype: np.dtype) -> int:
    """The header's code of ``dtype`` (one of :data:`COPY_DTYPES`)."""
    return COPY_DTYPES.index(dtype)


def encode_header(inline: bool, dtype: np.dtype, shape: tuple[int, ...], sequence: int,
                  name: str | None) -> bytes:
    """The header of a message: int64 fields, then the name in UTF-8 padded to 8 bytes."""
    encoded = b"" if name is None else name.encode()
    fields = [_MAGIC, int(inline), dtype_index(dtype), len(shape), sequence,
              _NO_NAME if name is None else len(encoded), *shape]
    padding = -len(encoded) % 8
    return np.array(fields, np.int64).tobytes() + encoded + b"\x00" * padding


class Header:
    """A received header.

    Attributes:
        inline: whether the data followed in the same message.
        dtype, shape, sequence, name: what the sender sent.
        length: the header's bytes (the data starts there in an inline message).
    """

    def __init__(self, message: np.ndarray):
        fixed = message[:_FIXED * 8].view(np.int64)
        if fixed[0] != _MAGIC:
            raise CommunicationError("a point-to-point message without ringtrain's header "
                                     "arrived on ringtrain's point-to-point communicator")
        self.inline = bool(fixed[1])
        self.dtype = COPY_DTYPES[int(fixed[2])]
        ndim, self.sequence, name_length = int(fixed[3]), int(fixed[4]), int(fixed[5])
        end = (_FIXED + ndim) * 8
        self.shape = tuple(int(n) for n in message[_FIXED * 8:end].view(np.int64))
        self.name = None if name_length == _NO_NAME else \
            bytes(message[end:end + name_length]).decode()
        self.length = end + (0 if name_length == _NO_NAME else
                             name_length + (-name_length % 8))

    @property
    def nbytes(self) -> int:
        """Bytes of the data."""
        return math.prod(self.shape) * self.dtype.itemsize


class Expectation:
    """What a receive accepts: a shape and dtype (None: any) and a name (None: any).

    Attributes:
        shape, dtype, name: as given.
    """

    def __init__(self, shape: tuple[int, ...] | None, dtype: np.dtype | None,
                 name: str | None):
        self.shape, self.dtype, self.name = shape, dtype, name

    def differences(self, header: Header) -> dict[str, dict[str, str]]:
        """``{field: {"sent": value, "expected": value}}`` for each field that differs,
        as the error message shows them."""
        found = {}
        for field, expected, sent in (("shape", self.shape, header.shape),
                                      ("dtype", self.dtype, header.dtype),
                                      ("name", self.name, header.name)):
            if expected is not None and expected != sent:
                show = str if field == "dtype" else repr
                found[field] = {"sent": show(sent), "expected": show(expected)}
        return found


class PeerHandle(Handle):
    """The handle of a point-to-point call in flight: a :class:`concurrent.futures.Future`
    completed by :func:`ringtrain.synchronize` (or ``wait``/``result``), which move every
    message this process has in flight until this one is done; :func:`ringtrain.poll`
    moves them once and says whether it is."""

    def __init__(self, operation: str, name: str | None):
        super().__init__(None, (), operation, name)
        self.engine: Engine | None = None

    def result(self, timeout: float | None = None) -> Any:
        """Wait (moving the messages in flight) and return the result or raise its error."""
        if not super().done():
            ENGINE.wait([self], timeout)
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait (moving the messages in flight) and return the error, if any."""
        if not super().done():
            ENGINE.wait([self], timeout)
        return super().exception(0)

    def done(self) -> bool:
        """Move the messages in flight once; whether this call has completed."""
        if not super().done():
            ENGINE.advance_all()
        return super().done()


class Operation:
    """One send or receive in flight.

    Attributes:
        handle: completed when the operation is.
        channels: the group's point-to-point communicators.
        peer: the other rank, in the group.
        peer_world: the other rank, in ringtrain's world (for messages).
        me_world: this rank, in ringtrain's world.
        tag: the user's tag.
    """

    kind = "?"
    direction = "?"

    def __init__(self, handle: PeerHandle, channels: Channels, peer: int, peer_world: int,
                 me_world: int, tag: int):
        self.handle = handle
        self.channels, self.peer, self.tag = channels, peer, tag
        self.peer_world, self.me_world = peer_world, me_world
        self._requests: list[MPI.Request] = []
        self._kept: list[Any] = []  # buffers MPI still reads or writes

    def start(self) -> None:
        """Post the first message(s)."""

    def advance(self) -> bool:
        """Take every step that needs no waiting; whether anything moved."""
        raise NotImplementedError

    def probe_key(self) -> tuple[Any, int, int] | None:
        """For a receive still looking for its header: what MPI matches it by."""
        return None

    def wait_entry(self) -> PeerWait:
        """What this operation waits for, for the stall inspector."""
        return PeerWait(0, self.kind, self.handle.name, (self.me_world, self.peer_world),
                        {"tag": self.tag, "peer": self.peer_world,
                         "direction": self.direction}, time.monotonic())

    def _requests_done(self) -> bool:
        if self._requests and not MPI.Request.Testall(self._requests):
            return False
        self._requests.clear()
        self._kept.clear()
        return True

    def _reply_tag(self, sequence: int) -> int:
        return 2 * sequence

    def _data_tag(self, sequence: int) -> int:
        return 2 * sequence + 1


class SendOperation(Operation):
    """A send: header (with the data when small), the receiver's reply, then the data
    (when large)."""

    kind, direction = "send", "to"

    def __init__(self, handle: PeerHandle, channels: Channels, peer: int, peer_world: int,
                 me_world: int, tag: int, data: np.ndarray):
        super().__init__(handle, channels, peer, peer_world, me_world, tag)
        self._data = data.reshape(-1).view(np.uint8) if data.size else \
            np.empty(0, np.uint8)
        self._dtype, self._shape = data.dtype, tuple(data.shape)
        self._inline = self._data.nbytes <= INLINE_MAX_BYTES
        self._sequence = -1
        self._state = "reply"

    def start(self) -> None:
        self._sequence = self.channels.next_sequence(self.peer)
        header = encode_header(self._inline, self._dtype, self._shape, self._sequence,
                               self.handle.name)
        message = np.frombuffer(header, np.uint8)
        if self._inline and self._data.nbytes:
            message = np.concatenate([message, self._data])
        self._kept.append(message)
        self._requests.append(self.channels.messages.Isend(message, self.peer, self.tag))
        if not self._inline:
            self._requests.append(self.channels.transfers.Isend(
                self._data, self.peer, self._data_tag(self._sequence)))

    def advance(self) -> bool:
        if self._state == "reply":
            status = MPI.Status()
            message = self.channels.transfers.Improbe(
                self.peer, self._reply_tag(self._sequence), status)
            if message is None:
                return False
            reply = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            message.Recv(reply)
            if bytes(reply[:1]) == _REFUSED:
                self._state = "refused"
                self._refusal = pickle.loads(bytes(reply[1:]))
            else:
                self._state = "sent"
            self._finish_if_done()
            return True
        return self._finish_if_done()

    def _finish_if_done(self) -> bool:
        if not self._requests_done():
            return False
        if self._state == "refused":
            self.handle.set_exception(MessageMismatchError(
                self.me_world, self.peer_world, self.tag, self.handle.name, self._refusal))
        else:
            self.handle.set_result(None)
        return True


class ReceiveOperation(Operation):
    """A receive: probe for the header, check it, reply, then take the data.

    ``target(header)`` gives the host array the data goes into (shape and dtype of the
    header); ``finish(array)`` turns it into the caller's result.
    """

    kind, direction = "recv", "from"

    def __init__(self, handle: PeerHandle, channels: Channels, peer: int, peer_world: int,
                 me_world: int, tag: int, expectation: Expectation,
                 target: Callable[[Header], np.ndarray], finish: Callable[[np.ndarray], Any]):
        super().__init__(handle, channels, peer, peer_world, me_world, tag)
        self._expectation = expectation
        self._target, self._finish = target, finish
        self._state = "probe"
        self._array: np.ndarray | None = None
        self._error: BaseException | None = None

    def probe_key(self) -> tuple[Any, int, int] | None:
        return (id(self.channels), self.peer, self.tag) if self._state == "probe" \
            else None

    def advance(self) -> bool:
        if self._state == "probe":
            status = MPI.Status()
            message = self.channels.messages.Improbe(self.peer, self.tag, status)
            if message is None:
                return False
            buffer = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            message.Recv(buffer)
            self._take(Header(buffer), buffer)
            self._complete_if_done()
            return True
        return self._complete_if_done()

    def _take(self, header: Header, buffer: np.ndarray) -> None:
        differences = self._expectation.differences(header)
        reply_tag = self._reply_tag(header.sequence)
        if differences:
            self._drain(header)
            self._reply(_REFUSED + pickle.dumps(differences), reply_tag)
            self._error = MessageMismatchError(self.peer_world, self.me_world, self.tag,
                                               header.name, differences)
            self._state = "refused"
            return
        try:
            array = self._target(header)
        except BaseException as error:  # refuse the message: the sender must not hang
            self._drain(header)
            self._reply(_REFUSED + pickle.dumps({"data": {
                "sent": f"of {header.nbytes} bytes",
                "expected": f"none ({type(error).__name__}: {error})"}}), reply_tag)
            self._error, self._state = error, "refused"
            return
        self._array = array
        if header.inline:
            if header.nbytes:
                array.reshape(-1).view(np.uint8)[:] = buffer[header.length:]
        else:
            self._receive_data(array.reshape(-1).view(np.uint8), header)
        self._reply(_ACCEPTED, reply_tag)
        self._state = "receiving"

    def _receive_data(self, target: np.ndarray, header: Header) -> None:
        self._requests.append(self.channels.transfers.Irecv(
            target, self.peer, self._data_tag(header.sequence)))

    def _drain(self, header: Header) -> None:
        """Take a refused large message's data, which the sender posted behind its header."""
        if not header.inline:
            scratch = np.empty(header.nbytes, np.uint8)
            self._kept.append(scratch)
            self._receive_data(scratch, header)

    def _reply(self, reply: bytes, tag: int) -> None:
        message = np.frombuffer(reply, np.uint8)
        self._kept.append(message)
        self._requests.append(self.channels.transfers.Isend(message, self.peer, tag))

    def _complete_if_done(self) -> bool:
        if not self._requests_done():
            return False
        if self._error is not None:
            self.handle.set_exception(self._error)
            return True
        try:
            result = self._finish(self._array)
        except BaseException as error:  # handed to the caller's handle
            self.handle.set_exception(error)
        else:
            self.handle.set_result(result)
        return True


class Engine:
    """Every point-to-point operation of this process in flight, advanced together.

    One thread advances them at a time (a lock); any thread may wait.
    """

    def __init__(self) -> None:
        self._pending: list[Operation] = []
        self._lock = threading.Lock()

    def post(self, operations: Sequence[Operation]) -> None:
        """Start ``operations`` (their first messages leave now) and keep them in flight."""
        self._in_turn(self._post, operations)

    def _post(self, operations: Sequence[Operation]) -> bool:
        with self._lock:
            for operation in operations:
                operation.handle.set_running_or_notify_cancel()
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

    def wait(self, handles: Sequence[PeerHandle], timeout: float | None = None) -> None:
        """Advance until every one of ``handles`` is done (or ``timeout`` seconds passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        idle_since = None
        waiting = None
        try:
            while not all(Handle.done(handle) for handle in handles):
                if deadline is not None and time.monotonic() >= deadline:
                    return
                if self.advance_all():
                    idle_since = None
                    if waiting is not None:
                        waiting = ACTIVITY.point_to_point = None
                    continue
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                elif waiting is None and now - idle_since > YIELD_SECONDS:
                    waiting = self._waiting_entry(handles)
                    ACTIVITY.point_to_point = waiting
                # MPI progresses inside the calls, which let other threads take the GIL.
                # Past a short spin, the core goes to whoever needs it (a machine with
                # more ranks than cores: the stage this one waits for), then, while the
                # peer is late, the waits grow.
                idle = now - idle_since
                if idle >= YIELD_SECONDS:
                    time.sleep(min(_LONGEST_SLEEP, idle / 100))
                elif idle >= SPIN_SECONDS:
                    time.sleep(0)
        finally:
            if waiting is not None:
                ACTIVITY.point_to_point = None

    def _waiting_entry(self, handles: Sequence[PeerHandle]) -> PeerWait | None:
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
            if operation.channels.messages == MPI.COMM_NULL:  # freed by shutdown()
                operation.handle.set_exception(RingtrainError(
                    f"{operation.kind} of tensor {operation.handle.name!r}: ringtrain was "
                    f"shut down before it completed"))
                moved = True
                continue
            try:
                moved |= operation.advance()
            except MPI.Exception as error:
                operation.handle.set_exception(CommunicationError(
                    f"{operation.kind} of tensor {operation.handle.name!r} "
                    f"{operation.direction} rank {operation.peer_world} (tag "
                    f"{operation.tag}): MPI failed: {error}"))
                moved = True
        if moved:
            self._pending = [op for op in self._pending if not Handle.done(op.handle)]
        return moved


ENGINE = Engine()
