"""Blocking sends and receives of numpy arrays, kept as plans.

A blocking ``send`` or ``recv`` of a C-contiguous numpy array is checked and set up
once for each kind of call (peer, tag, name, process set, dtype and shape): its route,
its header or the header it expects, and its compiled steps (:mod:`._p2p_compiled`).
A later call like it finds the plan and makes one compiled call; when that call
completes the message (a peer that was ready), nothing else runs. Otherwise the
operation is built in the state that call left, and the progress loop waits for it as for any
blocking call (:meth:`._p2p_progress.Progress.wait_alone`): refusals, errors and what the
stall inspector sees are the same either way.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..base._group import Group
from ..config import Settings
from ..transport._p2p_channels import Channels
from ..world._world import cores_shared
from ._p2p_compiled import DONE, FIRST_POLLS, POLLS
from ._p2p_progress import PROGRESS, Outcome, communication_error
from ._p2p_header import Expectation
from ._p2p_protocol import ReceiveOperation, SendOperation, compiled_receive, compiled_send

Route = tuple[Channels, int, int, int, int]
"""A message's channels, the peer's group and world ranks, this rank's world rank and
the tag (checked)."""

_BYTE = np.dtype(np.uint8)


class SendPlan:
    """Blocking sends of arrays of one shape and dtype, over one route.

    Attributes:
        group, settings: what the plan was made for (:class:`._plan_cache.PlanCache`).
        route: where the message goes.
        name: the tensor's name, or None.
    """

    __slots__ = ("group", "settings", "route", "name", "_steps", "_send", "_work", "_sent")

    def __init__(self, group: Group, settings: Settings, route: Route, name: str | None,
                 array: np.ndarray):
        self.group, self.settings, self.route, self.name = group, settings, route, name
        self._steps = steps = compiled_send(route[0], array.dtype, array.shape, name)
        if steps is not None:
            self._send = steps.compiled.planned_send(
                steps.template, steps.inline, route[1], route[4], _first_polls(),
                route[0].sequences)
            self._work = steps.compiled.work
            self._sent = route[0].sent[route[1]]
        else:
            self._send = None

    def run(self, array: np.ndarray) -> None:
        """Send C-contiguous ``array`` (of the plan's shape and dtype).

        Raises:
            MessageMismatchError: the receive expected another shape, dtype or name.
            CommunicationError: an MPI call failed.
        """
        if self._send is None or not PROGRESS.moves_alone():
            PROGRESS.complete(self._operation(array))
            return
        work = self._work()
        count = next(self._sent)
        code = self._send(work, np.frombuffer(array, _BYTE), count)
        if code < 0:
            raise communication_error("send", self.name, "to", self.route[2], self.route[4],
                                      MPI.Exception(-code))
        if code != DONE:
            operation = self._operation(array)
            operation.resume(self._steps, count % self.route[0].sequences, work, code)
            PROGRESS.wait_alone(operation)

    def _operation(self, array: np.ndarray) -> SendOperation:
        return SendOperation(Outcome("send", self.name), *self.route, array)


class ReceivePlan:
    """Blocking receives into arrays of one shape and dtype, over one route.

    Attributes:
        group, settings: what the plan was made for (:class:`._plan_cache.PlanCache`).
        route: where the message comes from.
        name: the name the sender must have given, or None (any).
    """

    __slots__ = ("group", "settings", "route", "name", "_expectation", "_steps", "_receive",
                 "_work")

    def __init__(self, group: Group, settings: Settings, route: Route, name: str | None,
                 array: np.ndarray):
        self.group, self.settings, self.route, self.name = group, settings, route, name
        self._expectation = Expectation(array.shape, array.dtype, name)
        self._steps = steps = compiled_receive(route[0], self._expectation)
        if steps is not None:
            self._receive = steps.compiled.planned_receive(
                steps.expected, route[1], route[4], _first_polls())
            self._work = steps.compiled.work
        else:
            self._receive = None

    def run(self, array: np.ndarray) -> np.ndarray:
        """Receive into C-contiguous, writable ``array`` (of the plan's shape and
        dtype); return it.

        Raises:
            MessageMismatchError: the sender sent another shape, dtype or name
                (``array`` is untouched).
            CommunicationError: an MPI call failed.
        """
        if self._receive is None or not PROGRESS.moves_alone():
            return PROGRESS.complete(self._operation(array))
        work = self._work()
        code = self._receive(work, np.frombuffer(array, _BYTE))
        if code < 0:
            raise communication_error("recv", self.name, "from", self.route[2],
                                      self.route[4], MPI.Exception(-code))
        if code != DONE:
            operation = self._operation(array)
            operation.resume(self._steps, work, code)
            PROGRESS.wait_alone(operation)
        return array

    def _operation(self, array: np.ndarray) -> ReceiveOperation:
        return ReceiveOperation(Outcome("recv", self.name), *self.route, self._expectation,
                                lambda _: array, lambda _: array)


def _first_polls() -> int:
    """How many times a plan's call polls: long enough for a ready peer, unless the
    node runs more ranks than cores (then the peer may need this core)."""
    return POLLS if cores_shared() else FIRST_POLLS
