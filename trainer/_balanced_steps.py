"""What an optimizer given ``balance=`` does for its LoadBalancer in each step.

- **Weight** (once per step, when the first bucket is launched): take the step's
  batches off the balancer's ledger and scale this rank's gradient by ``N × (its
  samples) / (the global batches' samples)``, the prescale of every bucket of the step.
- **Measure**: the compute time from ``zero_grad()`` (or the end of the last
  synchronization) to the start of the next one, over the samples the step trained.
- **Count**: :meth:`~ringtrain.trainer.balance.LoadBalancer.step` at the end of every
  ``step()``, which agrees on new shares every ``interval`` steps.

An optimizer without a balancer holds :data:`NO_BALANCE`, whose calls do nothing and
whose weight is 1.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

from ..collectives import Average, ProcessSet, Sum, size
from ..collectives.errors import InvalidArgumentError
from .balance import LoadBalancer


class StepBalance:
    """One optimizer's bookkeeping for its balancer.

    Args:
        balancer: the :class:`~ringtrain.trainer.balance.LoadBalancer`.
        op: the optimizer's reduction (Average or Sum: a weighted sum).
        process_set: the optimizer's process set (the balancer's ranks).
        owner: the optimizer's name, for errors.
        passes: the optimizer's current backward passes per step.

    Raises:
        InvalidArgumentError: not a LoadBalancer, an op other than Average or Sum, or a
            process set other than the balancer's.
    """

    def __init__(self, balancer: LoadBalancer, op: Any, process_set: ProcessSet | None,
                 owner: str, passes: Callable[[], int]):
        if not isinstance(balancer, LoadBalancer):
            raise InvalidArgumentError(
                f"{owner}: balance must be a LoadBalancer, got {type(balancer).__name__}")
        if op is not Average and op is not Sum:
            raise InvalidArgumentError(
                f"{owner}: balance= weights each rank's gradient by its samples, which "
                f"needs op=Average or op=Sum, got {op}")
        if _ranks(process_set) != _ranks(balancer.process_set):
            raise InvalidArgumentError(
                f"{owner}: the optimizer reduces over ranks {_ranks(process_set)}, its "
                f"LoadBalancer shares over ranks {_ranks(balancer.process_set)}")
        self.balancer = balancer
        self._passes = passes
        self._lock = threading.Lock()
        self._taken: tuple[int, int] | None = None
        self._start = time.perf_counter()

    def weight(self) -> float:
        """This step's factor on this rank's gradient (the step's batches are taken off
        the ledger at the first call of the step)."""
        with self._lock:
            if self._taken is None:
                passes = self._passes()
                self.balancer.batches_per_step = passes
                self._taken = self.balancer.take_batches(passes)
            mine, total = self._taken
        return self.balancer.size * mine / total if total else 0.0

    def compute_started(self) -> None:
        """``zero_grad()``: the step's compute starts now."""
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def synchronizing(self) -> Iterator[None]:
        """Around the wait for the step's reductions: the step's compute ended when it
        began; once the gradients are reduced, record it and start the next step's. A
        wait that raises (an error, or ``join``'s end) records nothing."""
        end = time.perf_counter()
        try:
            yield
            self.weight()  # a step whose buckets all waited for synchronize() takes its batches
            samples = self._taken[0] if self._taken else 0
            if self.balancer.measure_steps:
                self.balancer.record(end - self._start, samples)
        finally:
            self._taken = None
            self._start = time.perf_counter()

    def stepped(self) -> None:
        """The optimizer stepped: count it (every ``interval`` steps, agree on shares)."""
        self.balancer.step()


class NoBalance:
    """The balancer of an optimizer without one: weight 1, nothing measured or counted."""

    balancer = None

    def weight(self) -> float:
        return 1.0

    def compute_started(self) -> None:
        pass

    def synchronizing(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def stepped(self) -> None:
        pass


NO_BALANCE = NoBalance()


def step_balance(balancer: LoadBalancer | None, op: Any, process_set: ProcessSet | None,
                 owner: str, passes: Callable[[], int]) -> StepBalance | NoBalance:
    """A :class:`StepBalance` for ``balancer``, or :data:`NO_BALANCE` when it is None."""
    if balancer is None:
        return NO_BALANCE
    return StepBalance(balancer, op, process_set, owner, passes)


def _ranks(process_set: ProcessSet | None) -> list[int]:
    return list(range(size())) if process_set is None else process_set.ranks
