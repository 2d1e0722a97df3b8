"""What both DistributedOptimizer front ends share: the reducer, synchronize/step rules."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from ._balanced_steps import NO_BALANCE, NoBalance, StepBalance, step_balance
from .balance import LoadBalancer
from .gradient_reducer import GradientReducer

_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called after optimizer.synchronize() outside "
    "optimizer.skip_synchronize(): the gradients were already reduced and are used as they "
    "are; use 'with optimizer.skip_synchronize(): optimizer.step()' after synchronize()")


class SynchronizedSteps:
    """Mixin: ``synchronize()``, ``skip_synchronize()`` and the rule ``step()`` follows.

    A front end sets ``self._reducer`` and implements :meth:`_missing` (the array of a
    gradient that was not marked ready this step); :meth:`_after_synchronize` runs once
    the gradients hold the reduced values. With a load balancer it calls
    :meth:`_attach_balance` once, and its ``zero_grad()`` and ``step()`` tell
    ``self._balance`` (``compute_started()``, ``stepped()``).
    """

    _reducer: GradientReducer
    _balance: StepBalance | NoBalance = NO_BALANCE
    _should_synchronize = True
    _synchronized = False
    _step_after_synchronize = _STEP_AFTER_SYNCHRONIZE

    @property
    def reducer(self) -> GradientReducer:
        """The gradient reducer (its buckets show how gradients travel)."""
        return self._reducer

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before gradients are reduced."""
        return self._reducer.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change ``backward_passes_per_step`` (between steps)."""
        self._reducer.backward_passes_per_step = passes

    @property
    def balancer(self) -> LoadBalancer | None:
        """The :class:`~ringtrain.trainer.balance.LoadBalancer` given as ``balance=``, or None."""
        return self._balance.balancer

    def synchronize(self) -> None:
        """Wait until every gradient holds the value reduced across ranks.

        Gradients that were not computed this step take part with zeros, so ranks never
        wait for each other's unused parameters.
        """
        self._wait_for_gradients()
        self._synchronized = True

    def _wait_for_gradients(self) -> None:
        """Wait for the step's reductions, then let the front end finish the gradients."""
        with self._balance.synchronizing():
            self._reducer.wait(missing=self._missing)
        self._after_synchronize()

    def _attach_balance(self, balancer: LoadBalancer | None, op: Any, process_set: Any,
                        owner: str) -> None:
        """Weight this rank's gradients by its samples and report steps to ``balancer``
        (None: nothing to do)."""
        self._balance = step_balance(balancer, op, process_set, owner,
                                     lambda: self._reducer.backward_passes_per_step)
        if balancer is not None:
            self._reducer.step_weight = self._balance.weight

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context ``step()`` does not synchronize: call :meth:`synchronize`
        yourself first (e.g. to clip the reduced gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _synchronize_for_step(self, when_idle: bool = True) -> None:
        """What ``step()`` does first: synchronize, unless told not to or already done
        (then warn); ``when_idle=False`` skips it when no gradient is in flight."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(self._step_after_synchronize, UserWarning, stacklevel=3)
            elif when_idle or self._reducer.in_progress():
                self.synchronize()
        self._synchronized = False

    def _missing(self, index: int) -> Any:
        raise NotImplementedError

    def _after_synchronize(self) -> None:
        """What a front end does with the reduced gradients before anyone reads them."""
