"""Which shares hold for which global batch, and which batches this rank has drawn.

A :class:`~ringtrain.trainer.balanced_sampler.BalancedBatchSampler` may run ahead of
training (a ``DataLoader`` with workers prefetches batches), so the ranks cannot switch
to new shares "now": a rank whose sampler has dealt batch 40 under the old shares must
train it under the old shares, and so must every other rank. The schedule therefore ties
shares to **positions**, ``(iteration, batch)``: the sampler's iterations (epochs) are
numbered in the order they begin on this rank, the same on every rank, and ``batch`` is
the global batch's index in its epoch. New shares take effect from a position that no
rank has drawn yet (the ranks tell each other how far they have drawn when they agree),
so every rank deals every global batch with the same shares.

The schedule also keeps a **ledger** of the batches this rank has drawn and not yet
trained (its sample count and the global batch's), oldest first: the optimizer takes a
step's entries to weight this rank's gradient by the samples it trained.

Importing this module imports neither mpi4py nor numpy.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Callable, Sequence

Position = tuple[int, int]
"""``(iteration, batch)``: iteration 1 is the first a sampler began on this rank (0:
before any), batch the global batch's index in its epoch."""

BEFORE_ANY: Position = (0, 0)


class ShareSchedule:
    """Shares by position, and this rank's ledger of drawn batches. Thread-safe: hold
    :attr:`lock` to change shares while no sampler can draw.

    Args:
        shares: the shares from the first position on.
        rank: this rank's index in the shares.
    """

    def __init__(self, shares: Sequence[int], rank: int):
        self.rank = rank
        self.lock = threading.RLock()
        self._starts: list[Position] = [BEFORE_ANY]
        self._shares: list[tuple[int, ...]] = [tuple(shares)]
        self._iteration = 0
        self._first_batch = 0
        self._drawn: Position = BEFORE_ANY
        self._next_batch = 0
        self._ledger: collections.deque[tuple[int, int]] = collections.deque()

    @property
    def size(self) -> int:
        """The number of ranks sharing."""
        return len(self._shares[-1])

    @property
    def latest(self) -> tuple[int, ...]:
        """The shares decided last (those of every position not drawn yet)."""
        return self._shares[-1]

    @property
    def drawn(self) -> tuple[int, int, int]:
        """How far this rank has drawn: ``(iteration, next batch, first batch of that
        iteration)``; ``(0, 0, 0)`` before any draw."""
        with self.lock:
            return self._iteration, self._next_batch, self._first_batch

    def shares_at(self, position: Position) -> tuple[int, ...]:
        """The shares that hold for the global batch at ``position``."""
        with self.lock:
            return self._shares[bisect.bisect_right(self._starts, position) - 1]

    def change(self, shares: Sequence[int], start: Position) -> None:
        """Let ``shares`` hold from ``start`` on (a position no rank has drawn).

        Raises:
            ValueError: ``start`` is before the start of the shares decided last, or
                before a position this rank has drawn.
        """
        with self.lock:
            if start < self._starts[-1] or (self._iteration and start <= self._drawn):
                raise ValueError(f"shares cannot change from {start}: position "
                                 f"{max(self._starts[-1], self._drawn)} is decided")
            if start == self._starts[-1]:
                self._shares[-1] = tuple(shares)
            else:
                self._starts.append(start)
                self._shares.append(tuple(shares))

    def begin_iteration(self, first_batch: int) -> int:
        """Start an iteration (an epoch) at global batch ``first_batch``; the entries of
        the earlier iterations left in the ledger (batches never trained) are dropped.

        Returns:
            The new iteration's number.
        """
        with self.lock:
            self._iteration += 1
            self._first_batch = first_batch
            self._next_batch = first_batch
            self._ledger.clear()
            # Earlier iterations are never drawn again: keep only the shares in force.
            keep = bisect.bisect_right(self._starts, (self._iteration, 0)) - 1
            del self._starts[:keep], self._shares[:keep]
            return self._iteration

    def draw(self, iteration: int, batch: int,
             split: Callable[[tuple[int, ...]], Sequence[int]]) -> Sequence[int]:
        """Deal global batch ``batch`` of ``iteration``: the shares that hold there are
        given to ``split(shares)``, which returns every rank's sample count; this rank's
        is noted in the ledger (with the batch's total), and the counts returned."""
        with self.lock:
            counts = split(self.shares_at((iteration, batch)))
            position = (iteration, batch)
            if position > self._drawn:
                self._drawn = position
                if iteration == self._iteration:
                    self._next_batch = batch + 1
            if iteration == self._iteration:
                self._ledger.append((counts[self.rank], sum(counts)))
            return counts

    def take(self, batches: int) -> tuple[int, int, int]:
        """Take the oldest ``batches`` entries of the ledger (fewer when it holds fewer).

        Returns:
            ``(this rank's samples, the global batches' samples, entries taken)``.
        """
        with self.lock:
            mine = total = taken = 0
            while taken < batches and self._ledger:
                count, whole = self._ledger.popleft()
                mine, total, taken = mine + count, total + whole, taken + 1
            return mine, total, taken

    def __repr__(self) -> str:
        return (f"ShareSchedule(rank {self.rank}, shares {list(self.latest)} from "
                f"{self._starts[-1]}, drawn up to {self._drawn}, {len(self._ledger)} "
                f"batches not yet trained)")
