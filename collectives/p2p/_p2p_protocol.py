"""How one point-to-point message travels, checked by the pair: a send and a receive
as state machines.

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
machine: :class:`._p2p_progress.Progress` advances all of this process's operations in
flight whenever any of them is waited for, so sends and receives posted together
complete in any order (no deadlock whatever the order of a batch), and MPI's progress is
driven by the waiting thread (:mod:`._p2p_progress`); the header is
:mod:`._p2p_header`'s. A blocking call moved alone takes its steps in compiled code
where it can (:mod:`._p2p_compiled`), and hands back to these steps whatever it does not
take.
"""

from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI

from ..base._activity import PeerWait
from ..errors import MessageMismatchError
from ..transport._p2p_channels import Channels
from ._p2p_compiled import DONE, HEADER, REFUSED, WAITING, CompiledMessages, compiled_messages, fits
from ._p2p_progress import InFlight, Outcome, PeerHandle
from ._p2p_header import Expectation, Header, encode_header, expected_header, header_template

INLINE_MAX_BYTES = 4 * 1024
"""Largest data that travels in the header's message (the sender decides: the header
says which way the data comes). Up to it, data in the header's message costs the same as
sending it apart, and less below; above it the data moves faster on its own, straight
from the sender's array into the receiver's, than copied into and out of one message
(docs/lab/2026-11-26-point-to-point-data-in-the-header-and-spinning.md)."""

_BYTE = np.dtype(np.uint8)  # a dtype object: numpy converts np.uint8 at every use
_ACCEPTED = b"\x00"
_REFUSED = b"\x01"


def sends_inline(nbytes: int) -> bool:
    """Whether data of ``nbytes`` travels in its header's message."""
    return nbytes <= INLINE_MAX_BYTES


class CompiledSend(NamedTuple):
    """What a send of one kind of tensor needs to take its steps in compiled code.

    Attributes:
        compiled: the group's compiled steps.
        template: the header, with sequence number 0.
        inline: whether the data travels in the header's message.
    """

    compiled: CompiledMessages
    template: np.ndarray
    inline: bool


def compiled_send(channels: Channels, dtype: np.dtype, shape: tuple[int, ...],
                  name: str | None) -> CompiledSend | None:
    """How a send of ``shape`` and ``dtype`` named ``name`` takes its steps in compiled
    code, or None where it cannot (:func:`._p2p_compiled.fits`, compiled calls off)."""
    nbytes = math.prod(shape) * dtype.itemsize
    inline = sends_inline(nbytes)
    template = header_template(inline, dtype, shape, name)
    if not fits(template.size + (nbytes if inline else 0), nbytes):
        return None
    compiled = compiled_messages(channels)
    return None if compiled is None else CompiledSend(compiled, template, inline)


class CompiledReceive(NamedTuple):
    """What a receive into one kind of tensor needs to take its steps in compiled code.

    Attributes:
        compiled: the group's compiled steps.
        expected: the header it accepts (:func:`._p2p_header.expected_header`).
    """

    compiled: CompiledMessages
    expected: np.ndarray


def compiled_receive(channels: Channels, expectation: Expectation) -> CompiledReceive | None:
    """How a receive that knows its shape and dtype takes its steps in compiled code,
    or None where it cannot (its shape or dtype come from the sender,
    :func:`._p2p_compiled.fits`, compiled calls off)."""
    shape, dtype = expectation.shape, expectation.dtype
    if shape is None or dtype is None:
        return None
    nbytes = math.prod(shape) * dtype.itemsize
    compiled = compiled_messages(channels) if fits(0, nbytes) else None
    return None if compiled is None else CompiledReceive(
        compiled, expected_header(sends_inline(nbytes), dtype, shape, expectation.name))


class Operation(InFlight):
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
    alone = False
    """Whether a blocking call moves this operation alone (then it takes its steps in
    compiled code where it can)."""

    def __init__(self, handle: PeerHandle | Outcome, channels: Channels, peer: int,
                 peer_world: int, me_world: int, tag: int):
        self.handle = handle
        self.channels, self.peer, self.tag = channels, peer, tag
        self.peer_world, self.me_world = peer_world, me_world
        self._requests: list[MPI.Request] = []
        self._kept: list[Any] = []  # buffers MPI still reads or writes
        self._compiled: CompiledMessages | None = None

    def wait_entry(self) -> PeerWait:
        """What this operation waits for, for the stall inspector."""
        return PeerWait(0, (self.me_world, self.peer_world),
                        {"collective": self.kind, "name": self.handle.name, "tag": self.tag,
                         "peer": self.peer_world, "direction": self.direction},
                        time.monotonic())

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

    def __init__(self, handle: PeerHandle | Outcome, channels: Channels, peer: int,
                 peer_world: int, me_world: int, tag: int, data: np.ndarray):
        super().__init__(handle, channels, peer, peer_world, me_world, tag)
        self._data = np.frombuffer(data, _BYTE)
        self._dtype, self._shape = data.dtype, tuple(data.shape)
        self._inline = sends_inline(self._data.nbytes)
        self._sequence = -1
        self._state = "reply"

    def start(self) -> None:
        self._sequence = self.channels.next_sequence(self.peer)
        if self.alone and self._take_compiled_steps():
            self._work = self._compiled.begin()
            return
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
        if self._compiled is not None:
            return self._advance_compiled()
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

    def resume(self, steps: CompiledSend, sequence: int, work: np.ndarray,
               code: int) -> None:
        """Take over a send whose first compiled call was made without this object
        (:mod:`._p2p_plans`): by ``steps``, with ``sequence``, in this thread's
        ``work``, returning ``code``."""
        self.alone = True
        self._sequence, self._work = sequence, work
        self._set_compiled(steps)
        self._compiled_code(code)

    def _take_compiled_steps(self) -> bool:
        steps = compiled_send(self.channels, self._dtype, self._shape, self.handle.name)
        if steps is None:
            return False
        self._set_compiled(steps)
        return True

    def _set_compiled(self, steps: CompiledSend) -> None:
        self._compiled, self._template = steps.compiled, steps.template

    def _advance_compiled(self) -> bool:
        return self._compiled_code(self._compiled.send_steps(
            self._work, self._template, self._data, self._inline, self.peer, self.tag,
            self._sequence))

    def _compiled_code(self, code: int) -> bool:
        if code == DONE:
            self.handle.set_result(None)
        elif code == REFUSED:  # the messages are out; the Python steps take the reply
            self._compiled = None
        return code != WAITING

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
    header, or of the expectation when the compiled steps take a receive that knows
    them); ``finish(array)`` turns it into the caller's result.
    """

    kind, direction = "recv", "from"

    def __init__(self, handle: PeerHandle | Outcome, channels: Channels, peer: int,
                 peer_world: int, me_world: int, tag: int, expectation: Expectation,
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

    def start(self) -> None:
        if self.alone and self.peer != MPI.ANY_SOURCE and self._take_compiled_steps():
            self._work = self._compiled.begin()

    def wait_entry(self) -> PeerWait:
        """What this receive waits for; one from any rank waits for none in particular."""
        if self.peer != MPI.ANY_SOURCE:
            return super().wait_entry()
        return PeerWait(0, (self.me_world,),
                        {"collective": self.kind, "name": self.handle.name, "tag": self.tag,
                         "peer": "any", "direction": self.direction}, time.monotonic())

    def resume(self, steps: CompiledReceive, work: np.ndarray, code: int) -> None:
        """Take over a receive whose first compiled call was made without this object
        (:mod:`._p2p_plans`): by ``steps``, in this thread's ``work``, returning
        ``code``."""
        self.alone = True
        self._work = work
        self._set_compiled(steps)
        self._compiled_code(code)

    def _take_compiled_steps(self) -> bool:
        steps = compiled_receive(self.channels, self._expectation)
        if steps is None:
            return False  # e.g. the target is made from the header: the Python steps
        self._set_compiled(steps)
        return True

    def _set_compiled(self, steps: CompiledReceive) -> None:
        self._compiled, self._expected = steps
        self._array = self._target(self._expectation)
        self._bytes = np.frombuffer(self._array, _BYTE)

    def advance(self) -> bool:
        if self._compiled is not None:
            return self._advance_compiled()
        if self._state == "probe":
            status = MPI.Status()
            message = self.channels.messages.Improbe(self.peer, self.tag, status)
            if message is None:
                return False
            buffer = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            message.Recv(buffer)
            if self.peer == MPI.ANY_SOURCE:  # from now on, a receive from that rank
                self.peer = status.Get_source()
                self.peer_world = self.handle.source = self.channels.world_ranks[self.peer]
            self._take(Header(buffer), buffer)
            self._complete_if_done()
            return True
        return self._complete_if_done()

    def _advance_compiled(self) -> bool:
        return self._compiled_code(self._compiled.receive_steps(
            self._work, self._expected, self._bytes, self.peer, self.tag))

    def _compiled_code(self, code: int) -> bool:
        if code == DONE:
            self._state = "receiving"
            return self._complete_if_done()
        if code == HEADER:  # to be refused, explained by the Python steps
            received = self._compiled.received(self._work)
            self._compiled = None
            self._take(Header(received), received)
            self._complete_if_done()
        return code != WAITING

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
