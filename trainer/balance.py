"""Load balancing: each rank takes a share of the global batch that follows its speed.

Synchronous data parallelism runs at the pace of its slowest rank. A
:class:`LoadBalancer` measures each rank's compute time per sample and, every
``interval`` steps, has the ranks agree on new integer shares of a fixed global batch,
so that a rank twice as fast gets about twice the samples and no rank waits for the
others (the rule, with its hysteresis: :mod:`~ringtrain.trainer.balance_shares`)::

    balancer = rt.LoadBalancer(global_batch_size=256)
    sampler = rt.BalancedBatchSampler(len(dataset), balancer, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    optimizer = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        balance=balancer)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:                    # this rank's share of a global batch
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()    # the mean over this rank's samples
            optimizer.step()                   # the mean over the global batch

**Measuring.** An optimizer given ``balance=`` times each step's compute on its rank:
from ``zero_grad()`` (or the end of the last synchronization) to the start of the next
``synchronize()`` (which ``step()`` calls), i.e. forward and backward, not the wait for
the other ranks; it divides by the samples the rank trained in the step. Loops without
such an optimizer measure with :meth:`LoadBalancer.timed` or :meth:`LoadBalancer.record`
and call :meth:`LoadBalancer.step` once per step. Each agreement uses the median of
the steps measured since the last one, smoothed over agreements.

**Agreeing.** Every ``interval`` steps each rank contributes one record to an allreduce
(its seconds per sample, its cap, how far its sampler has dealt batches, whether a
measurement failed): every rank then holds every rank's numbers and computes the same
shares. New shares take effect from the first global batch no rank has dealt yet (see
:mod:`~ringtrain.trainer.balance_schedule`), at a step boundary when steps accumulate
several batches. A change is logged at INFO (``RINGTRAIN_LOG_LEVEL=INFO``) and every
agreement is a ``shares`` event on the timeline's ``load balancer`` row.

**Exact gradients.** With uneven shares the average of the ranks' mean gradients is not
the mean over the global batch. The optimizers given ``balance=`` multiply each rank's
gradient by ``N × (its samples) / (the global batch's samples)`` before the sum (the
prescale of the reduction: no extra message), so the average is the global mean.
:func:`scale_loss` does the same to a loss for any other data-parallel wrapper
(``torch.nn.parallel.DistributedDataParallel``).
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..collectives import ProcessSet, Sum, allreduce, rank, size, timeline
from ..collectives.errors import InvalidArgumentError, RingtrainError, format_ranks
from ..collectives.logs import LOGGER
from .balance_schedule import BEFORE_ANY, Position, ShareSchedule
from .balance_shares import balanced_shares, predicted_step_seconds, proportional_shares

__all__ = ["BalanceError", "LoadBalancer", "scale_loss"]

_ROW = "load balancer"
_NOISE_MEMORY = 6
"""The agreements whose changes of the relative speeds make the noise (the largest)."""
_NOISE_KNOWN = 3
"""The changes seen before the noise counts as known (one or two are too often small)."""

# Each rank's record in the agreement, in this order.
_SECONDS, _FAILED, _CAP, _ITERATION, _NEXT_BATCH, _FIRST_BATCH, _BATCHES_PER_STEP = range(7)
_FIELDS = 7


class BalanceError(RingtrainError, RuntimeError):
    """The ranks could not agree on new shares: raised on every rank alike, the shares
    unchanged; the balancer goes on working."""


class LoadBalancer:
    """Shares of a global batch that follow each rank's measured speed.

    Collective: every rank of the process set makes its balancer at the same point (one
    small allreduce agrees on the caps and checks that the ranks agree on the global
    batch and the rule's parameters). Until the first agreement the shares are even
    (within the caps). One optimizer at most may be given it as ``balance=``.

    Args:
        global_batch_size: samples per step over all ranks (the same on every rank).
        interval: steps between agreements on new shares.
        hysteresis: the fraction by which the predicted step time must fall for the
            shares to change.
        noise_margin: the predicted fall must also exceed this many times twice the
            measurements' noise: how much the ranks' speeds relative to each other changed
            from one agreement to the next (the largest relative change of a rank's
            seconds per sample over the median rank's, over the last 6 agreements; a
            change common to all ranks, such as a busier machine, is not noise here).
            With a margin the shares first move at the fourth agreement with
            measurements (the noise is not known before); 0 ignores the noise.
        correction: the fraction of the way to the proportional shares that a change
            moves (1: all the way at once).
        smoothing: the weight of the newest measurement in the smoothed seconds per
            sample (1: the newest alone).
        max_share: the most samples this rank may take per batch (its memory's limit);
            may differ between ranks. None: no cap. It may be changed later
            (:attr:`max_share`).
        min_share: the least samples any rank takes (1 or more).
        measure_steps: an optimizer given this balancer times its steps; False leaves
            measuring to :meth:`timed` and :meth:`record`.
        process_set: the ranks sharing the batch (default: all).

    Attributes:
        rank, size: this rank and the number of ranks, in the process set.
        measured: every rank's smoothed seconds per sample at the last agreement (0:
            none), the same on every rank.
        schedule: the :class:`~ringtrain.trainer.balance_schedule.ShareSchedule` of
            shares by position, and this rank's ledger of dealt batches.
        batches_per_step: batches a step trains (an optimizer given ``balance=`` sets
            it from its ``backward_passes_per_step``); shares change between steps.

    Raises:
        InvalidArgumentError: an argument out of range.
        BalanceError: caps that cannot hold the global batch (on every rank).
        MismatchError: ranks that disagree on the global batch size, the least share,
            the hysteresis, the noise margin or the correction (on every rank).
    """

    def __init__(self, global_batch_size: int, *, interval: int = 20,
                 hysteresis: float = 0.05, noise_margin: float = 1.0,
                 correction: float = 0.5, smoothing: float = 0.5,
                 max_share: int | None = None, min_share: int = 1,
                 measure_steps: bool = True, process_set: ProcessSet | None = None):
        _check_int("global_batch_size", global_batch_size, 1)
        _check_int("interval", interval, 1)
        _check_int("min_share", min_share, 1)
        if max_share is not None:
            _check_int("max_share", max_share, min_share)
        self._max_share = max_share
        if not (isinstance(hysteresis, (int, float)) and 0 <= hysteresis < 1):
            raise InvalidArgumentError(f"LoadBalancer: hysteresis must be in [0, 1), got "
                                       f"{hysteresis!r}")
        for name, value in (("smoothing", smoothing), ("correction", correction)):
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise InvalidArgumentError(f"LoadBalancer: {name} must be in (0, 1], got "
                                           f"{value!r}")
        if not (isinstance(noise_margin, (int, float)) and 0 <= noise_margin < math.inf):
            raise InvalidArgumentError(f"LoadBalancer: noise_margin must be a number >= 0, "
                                       f"got {noise_margin!r}")
        self.process_set = process_set
        self.rank = rank() if process_set is None else process_set.rank()
        self.size = size() if process_set is None else process_set.size()
        if global_batch_size < self.size * min_share:
            raise InvalidArgumentError(
                f"LoadBalancer: a global batch of {global_batch_size} cannot give "
                f"{self.size} ranks at least {min_share} sample(s) each")
        self.global_batch_size = global_batch_size
        self.interval = interval
        self.hysteresis = float(hysteresis)
        self.noise_margin = float(noise_margin)
        self.correction = float(correction)
        self.smoothing = float(smoothing)
        self.min_share = min_share
        self.measure_steps = bool(measure_steps)
        self.batches_per_step = 1
        self._name = (f"load balance: global batch {global_batch_size}, least share "
                      f"{min_share}, hysteresis {self.hysteresis:g}, noise margin "
                      f"{self.noise_margin:g}, correction {self.correction:g}")
        self._window: list[float] = []
        self._smoothed: float | None = None
        self._relative: tuple[float, ...] | None = None
        self._changes: collections.deque[float] = collections.deque(maxlen=_NOISE_MEMORY)
        self._failed = False
        self._steps = 0
        self.measured: tuple[float, ...] = (0.0,) * self.size
        self._caps = self._checked_caps(self._exchange(drawn=(0, 0, 0)))
        self.schedule = ShareSchedule(self._even_shares(), self.rank)

    # What the ranks hold now.
    @property
    def shares(self) -> tuple[int, ...]:
        """Every rank's share of the global batches not dealt yet (identical on every rank)."""
        return self.schedule.latest

    @property
    def share(self) -> int:
        """This rank's share of the global batches not dealt yet."""
        return self.schedule.latest[self.rank]

    @property
    def max_share(self) -> int | None:
        """This rank's cap on its share (None: none); each agreement reads it, so it may
        be lowered while training (a share below the least share fails the next
        agreement on every rank)."""
        return self._max_share

    @max_share.setter
    def max_share(self, cap: int | None) -> None:
        if cap is not None:
            _check_int("max_share", cap, 1)
        self._max_share = cap

    @property
    def seconds_per_sample(self) -> float | None:
        """This rank's smoothed compute time per sample at the last agreement (None
        before it measured anything)."""
        return self._smoothed

    # Measuring.
    def record(self, seconds: float, samples: int) -> None:
        """Add one step's measurement: ``samples`` computed in ``seconds``.

        Raises:
            InvalidArgumentError: a negative or non-finite time, or a negative count.
        """
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise InvalidArgumentError(
                f"LoadBalancer.record: seconds must be a finite number >= 0, got {seconds!r}")
        _check_int("samples", samples, 0)
        if samples and seconds > 0:
            self._window.append(seconds / samples)

    @contextlib.contextmanager
    def timed(self, samples: int) -> Iterator[None]:
        """Measure the block as the compute of ``samples`` samples (forward and backward;
        leave out waiting for other ranks). A block that raises records nothing and
        makes the next agreement raise :class:`BalanceError` on every rank."""
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self._failed = True
            raise
        self.record(time.perf_counter() - start, samples)

    # Agreeing.
    def step(self) -> bool:
        """End a training step; every ``interval`` steps, agree on new shares
        (collective: every rank calls it after every step). Optimizers given
        ``balance=`` call it at the end of their ``step()``.

        Returns:
            Whether the shares changed.

        Raises:
            BalanceError: as :meth:`rebalance`.
        """
        self._steps += 1
        if self._steps % self.interval:
            return False
        return self.rebalance()

    def rebalance(self) -> bool:
        """Agree on new shares now (collective: every rank of the process set calls it).

        Returns:
            Whether the shares changed.

        Raises:
            BalanceError: on every rank, when a rank's measured block raised since the
                last agreement, or when the caps cannot hold the global batch; the
                shares stay.
        """
        self._fold_window()
        with self.schedule.lock:  # no batch is dealt between reporting and changing
            records = self._exchange(self.schedule.drawn)
            failed = [r for r in range(self.size) if records[r, _FAILED]]
            self._failed = False
            if failed:
                raise BalanceError(
                    f"{self._subject()}: {self._ranks_named(failed)} reported a failed "
                    f"measurement (an exception inside LoadBalancer.timed()) since the last "
                    f"agreement; the shares stay {list(self.shares)}")
            self._caps = self._checked_caps(records)
            self.measured = tuple(float(t) for t in records[:, _SECONDS])
            current = self.shares
            self._follow_noise()
            least_gain = self.hysteresis
            if self.noise_margin:
                least_gain = math.inf if len(self._changes) < _NOISE_KNOWN else \
                    max(least_gain, 2 * self.noise_margin * max(self._changes))
            new = balanced_shares(self.measured, current, self.global_batch_size,
                                  min_share=self.min_share, caps=self._caps,
                                  hysteresis=least_gain, correction=self.correction)
            if new != current:
                self.schedule.change(new, _first_undealt(records))
        self._report(current, new)
        return new != current

    def take_batches(self, batches: int = 1) -> tuple[int, int]:
        """Take this rank's next ``batches`` trained batches off the ledger of dealt ones
        (the optimizers do, once per step; :func:`scale_loss` once per batch).

        Returns:
            ``(this rank's samples, the samples of those global batches)``: ``(0, 0)``
            when a sampler deals the batches and none is left (a rank that ran out of
            data, inside ``join``); from the shares in force when no sampler ever dealt
            any (a loop slicing its data by :attr:`share` itself).
        """
        mine, total, taken = self.schedule.take(batches)
        if taken == 0 and self.schedule.drawn[0] == 0:
            return self.share * batches, self.global_batch_size * batches
        return mine, total

    # Internals.
    def _exchange(self, drawn: tuple[int, int, int]) -> np.ndarray:
        """Every rank's record (rows by rank in the process set), by one allreduce;
        ``drawn`` is how far this rank's sampler has dealt (see ShareSchedule.drawn)."""
        records = np.zeros((self.size, _FIELDS), np.float64)
        mine = records[self.rank]
        mine[_SECONDS] = self._smoothed or 0.0
        mine[_FAILED] = float(self._failed)
        mine[_CAP] = 0 if self._max_share is None else self._max_share + 1
        mine[_ITERATION], mine[_NEXT_BATCH], mine[_FIRST_BATCH] = drawn
        mine[_BATCHES_PER_STEP] = self.batches_per_step
        # One rank writes each row, so the sum is exact: every rank gets every record.
        return allreduce(records, op=Sum, name=self._name, process_set=self.process_set)

    def _checked_caps(self, records: np.ndarray) -> list[int | None]:
        caps = [int(c) - 1 if c else None for c in records[:, _CAP]]
        small = [r for r, c in enumerate(caps) if c is not None and c < self.min_share]
        if small:
            raise BalanceError(
                f"{self._subject()}: the max_share of {self._ranks_named(small)} "
                f"({', '.join(str(caps[r]) for r in small)}) is below the least share "
                f"{self.min_share}")
        if all(c is not None for c in caps) and sum(caps) < self.global_batch_size:
            raise BalanceError(
                f"{self._subject()}: the ranks' max_share {caps} sum to {sum(caps)}, less "
                f"than the global batch of {self.global_batch_size}")
        return caps

    def _even_shares(self) -> tuple[int, ...]:
        return proportional_shares([1.0] * self.size, self.global_batch_size,
                                   min_share=self.min_share, caps=self._caps)

    def _fold_window(self) -> None:
        """Smooth the median of the steps measured since the last agreement in."""
        if not self._window:
            return
        newest = statistics.median(self._window)
        self._window = []
        self._smoothed = newest if self._smoothed is None else \
            self.smoothing * newest + (1.0 - self.smoothing) * self._smoothed

    def _follow_noise(self) -> None:
        """Note how far the ranks' speeds relative to each other moved since the last
        agreement (from the agreed numbers: the same on every rank)."""
        relative = _relative_to_median(self.measured)
        if relative is None:
            return
        before, self._relative = self._relative, relative
        if before is None:
            return
        changes = [abs(now - then) / then for now, then in zip(relative, before)
                   if now > 0 and then > 0]
        if not changes:
            return
        self._changes.append(max(changes))

    def _report(self, before: tuple[int, ...], after: tuple[int, ...]) -> None:
        line = timeline.ACTIVE
        if line is not None:
            line.instant(_ROW, "shares", shares=list(after), changed=after != before,
                         seconds_per_sample=list(self.measured))
        if after != before and self.rank == 0:
            known = [t for t in self.measured if t > 0]
            typical = statistics.median(known) if known else 1.0
            seconds = [t if t > 0 else typical for t in self.measured]
            LOGGER.info(
                "load balance: shares of the global batch of %d changed from %s to %s "
                "(ms per sample %s; predicted step %.3g -> %.3g ms)",
                self.global_batch_size, list(before), list(after),
                ", ".join(f"{1e3 * t:.3g}" for t in self.measured),
                1e3 * predicted_step_seconds(before, seconds),
                1e3 * predicted_step_seconds(after, seconds))

    def _subject(self) -> str:
        return f"rank {self.rank}: load balance of a global batch of {self.global_batch_size}"

    def _ranks_named(self, ranks: list[int]) -> str:
        if self.process_set is None:
            return format_ranks(ranks)
        world = self.process_set.ranks
        return f"{format_ranks(ranks)} of the process set (world " \
               f"{format_ranks([world[r] for r in ranks])})"

    def __repr__(self) -> str:
        return (f"LoadBalancer(global batch {self.global_batch_size} over {self.size} ranks, "
                f"shares {list(self.shares)}, every {self.interval} steps)")


def scale_loss(loss: Any, balancer: LoadBalancer) -> Any:
    """``loss`` times this rank's weight for its next batch, for a data-parallel wrapper
    that averages gradients over the ranks (``torch.nn.parallel.DistributedDataParallel``
    with any backend): ``N × (this rank's samples) / (the global batch's samples)``. The
    average of the ranks' gradients of the scaled mean losses is then the mean over the
    global batch. Call it once per batch trained (it takes the batch off the ledger).

    Args:
        loss: this rank's mean loss over its batch (a tensor or a number).
        balancer: the balancer whose shares dealt the batch.

    Returns:
        The scaled loss.
    """
    mine, total = balancer.take_batches(1)
    return loss * (balancer.size * mine / total if total else 0.0)


def _relative_to_median(seconds: tuple[float, ...]) -> tuple[float, ...] | None:
    """Each rank's seconds per sample over the median measured rank's (0 where none),
    or None when no rank measured anything."""
    known = [t for t in seconds if t > 0]
    if not known:
        return None
    typical = statistics.median(known)
    return tuple(t / typical for t in seconds)


def _first_undealt(records: np.ndarray) -> Position:
    """The first global batch no rank has dealt, at a step boundary: after the furthest
    rank's position, counting whole steps from the start of its iteration."""
    furthest = max(range(len(records)), key=lambda r: (records[r, _ITERATION],
                                                      records[r, _NEXT_BATCH], -r))
    iteration = int(records[furthest, _ITERATION])
    if iteration == 0:
        return BEFORE_ANY
    next_batch = int(records[furthest, _NEXT_BATCH])
    first = int(records[furthest, _FIRST_BATCH])
    per_step = max(1, int(records[:, _BATCHES_PER_STEP].max()))
    return iteration, first + -(-(next_batch - first) // per_step) * per_step


def _check_int(name: str, value: Any, least: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
        raise InvalidArgumentError(f"LoadBalancer: {name} must be an integer >= {least}, "
                                   f"got {value!r}")
