"""Uneven inputs: ranks that run out of batches keep the others' steps going until all are done.

Inside ``with join(optimizer):`` every step of the DistributedOptimizer starts with a
small exchange (on the collectives thread, ahead of the first gradient bucket) that
says which ranks still have data. When a rank leaves the block, it shadows the others'
steps: it reduces zero gradients with them and steps its optimizer with the reduced
result, so its parameters stay identical to theirs; when no rank is left with data,
every rank returns from the block together. Averages keep dividing by the number of
ranks, so a joined rank's zeros count as a contribution (as in Horovod and PyTorch
DDP).

The cost is one 16-byte allreduce per step, and only inside the block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..collectives import Compression, Max
from ..collectives.engine import allreduce_plan, reduce_planned, resolve_group
from ..collectives.errors import UsageError

_NAME = "join: ranks with data"


class _AllJoined(Exception):
    """Raised by the exchange when no rank has data left: ends the shadow steps."""


class JoinResult:
    """What :func:`join` leaves behind once every rank has joined.

    Attributes:
        last_rank: the highest world rank among those that had data in the last step
            any rank took (-1 when no rank ever stepped inside the block).
        shadow_steps: steps this rank took with zero gradients after it ran out of data.
    """

    def __init__(self) -> None:
        self.last_rank = -1
        self.shadow_steps = 0

    def __repr__(self) -> str:
        return f"JoinResult(last_rank={self.last_rank}, shadow_steps={self.shadow_steps})"


class _Exchange:
    """The per-step exchange: [any rank active, highest active world rank], max-combined."""

    def __init__(self, reducer: Any, result: JoinResult):
        group = resolve_group(reducer.process_set, "join", _NAME)
        self._world_rank = group.world_rank
        self._flags = np.empty(2, np.int64)
        self._plan = allreduce_plan(self._flags, Max, _NAME, 1.0, 1.0, reducer.process_set,
                                    None, Compression.none, "allreduce")
        self._result = result
        self.active = True

    def __call__(self) -> None:
        self._flags[0] = int(self.active)
        self._flags[1] = self._world_rank if self.active else -1
        reduce_planned(self._plan, "allreduce", _NAME, self._flags, self._flags, 1.0, 1.0)
        if not self._flags[0]:
            raise _AllJoined()
        self._result.last_rank = int(self._flags[1])


@contextlib.contextmanager
def join(optimizer: Any) -> Iterator[JoinResult]:
    """Run a training loop whose ranks may have different numbers of batches.

    Args:
        optimizer: a DistributedOptimizer (PyTorch or arrays).

    Yields:
        A :class:`JoinResult`, filled in when the block ends.

    Raises:
        UsageError: nested in another ``join`` of the same optimizer, or entered in
            the middle of a step.

    Example::

        with ringtrain.trainer.join(optimizer) as joined:
            for batch in my_shard:          # fewer batches on some ranks
                optimizer.zero_grad()
                loss(batch).backward()
                optimizer.step()
        ringtrain.broadcast_parameters(model.state_dict(), root_rank=joined.last_rank)
    """
    reducer = optimizer.reducer
    if reducer.step_prologue is not None:
        raise UsageError("join() of an optimizer that is already inside join()")
    if reducer.in_progress():
        raise UsageError("join() entered between backward() and step(): enter it before "
                         "the training loop")
    result = JoinResult()
    exchange = _Exchange(reducer, result)
    reducer.step_prologue = exchange
    try:
        yield result
        exchange.active = False
        while True:
            optimizer.zero_grad()
            try:
                optimizer.synchronize()
            except _AllJoined:
                break
            with optimizer.skip_synchronize():
                optimizer.step()
            result.shadow_steps += 1
    finally:
        reducer.step_prologue = None
