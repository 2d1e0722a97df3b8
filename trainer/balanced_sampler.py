"""``BalancedBatchSampler``: this rank's share of each global batch, as a batch sampler.

Each epoch's order is the permutation of ``0 .. n-1`` drawn from ``seed + epoch`` (as
:class:`~ringtrain.trainer.distributed_sampler.DistributedSampler` draws it), cut into global
batches of ``B`` consecutive positions: global batch ``g`` is positions ``[g·B,
(g+1)·B)``, whatever the number of ranks or their shares. Within a global batch the
ranks take consecutive runs in rank order, rank ``r`` the ``shares[r]`` positions after
those of ranks ``0 .. r-1``, with the shares that hold for that batch (see
:mod:`~ringtrain.trainer.balance_schedule`). So every rank computes its indices without
communicating, and the ranks together deal each global batch exactly once.

``mode`` says what happens when ``n`` is not a multiple of ``B``, as for the
DistributedSampler:

``"pad"`` (default)
    The order is extended by repeating it from its start to a multiple of ``B``: every
    global batch is whole, and every rank gets a batch in every step.
``"drop"``
    The last, partial global batch is left out of the epoch.
``"exact"``
    Every index exactly once per epoch: the last global batch has ``n mod B`` samples,
    split in proportion to the shares (at least one per rank when there are enough). A
    rank may get none of it, and then has one batch fewer than the others: train inside
    ``ringtrain.trainer.join`` so the others' last step completes.

Use it as a ``DataLoader``'s ``batch_sampler`` (it yields lists of indices whose length
changes with the shares)::

    loader = DataLoader(dataset, batch_sampler=BalancedBatchSampler(len(dataset), balancer))

It may run ahead of training (a loader's workers prefetch), but every rank must iterate
it alike: the same epochs, from the same first batch, on the thread that trains or one
that it waits for (the ``DataLoader`` iterates it on the training thread).

Importing this module imports neither mpi4py nor torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

from .balance_shares import split_batch
from .distributed_sampler import (check_int, check_mode, check_seed, dataset_length, epoch_order,
                                  invalid_argument)

_OWNER = "BalancedBatchSampler"


class BalancedBatchSampler:
    """This rank's share of each global batch of a dataset, one epoch at a time.

    Args:
        dataset: the dataset's length, or an object with ``__len__`` (read once).
        balancer: the :class:`~ringtrain.trainer.balance.LoadBalancer` whose shares
            split the global batches (its ``global_batch_size`` is the global batch).
        shuffle: permute the indices each epoch; when false, the natural order is dealt.
        seed: the same on every rank; with the epoch it picks the permutation.
        mode: ``"pad"``, ``"drop"`` or ``"exact"`` (see the module's description).

    Raises:
        InvalidArgumentError: a negative length, a negative seed or an unknown mode.
    """

    def __init__(self, dataset: int | Sized, balancer: Any, shuffle: bool = True,
                 seed: int = 0, mode: str = "pad"):
        length = dataset_length(_OWNER, dataset)
        check_mode(_OWNER, mode)
        check_seed(_OWNER, seed)
        self._length = length
        self._balancer = balancer
        self._batch = int(balancer.global_batch_size)
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._mode = mode
        self._epoch = 0
        self._first_batch = 0

    @property
    def mode(self) -> str:
        """``"pad"``, ``"drop"`` or ``"exact"``."""
        return self._mode

    @property
    def epoch(self) -> int:
        """The epoch whose permutation is used, as given to :meth:`set_epoch`."""
        return self._epoch

    @property
    def global_batches(self) -> int:
        """Global batches per epoch."""
        if self._mode == "drop":
            return self._length // self._batch
        return math.ceil(self._length / self._batch)

    def set_epoch(self, epoch: int, first_batch: int = 0) -> None:
        """Choose the epoch, and the global batch to start from; call it on every rank
        before iterating, with the same values.

        Args:
            epoch: a number >= 0 (the permutation is drawn from ``seed + epoch``).
            first_batch: the first global batch to deal, e.g. to resume an epoch after
                an elastic restart: global batches are the same whatever the number of
                ranks and the shares, so the samples left are exactly those not yet seen.

        Raises:
            InvalidArgumentError: a negative epoch, or a first batch outside
                ``[0, global_batches]``.
        """
        check_int(_OWNER, "epoch", epoch)
        check_int(_OWNER, "first_batch", first_batch)
        if epoch < 0:
            raise invalid_argument(f"{_OWNER}: epoch must be >= 0, got {epoch}")
        if not 0 <= first_batch <= self.global_batches:
            raise invalid_argument(f"{_OWNER}: first_batch must be in "
                                   f"[0, {self.global_batches}], got {first_batch}")
        self._epoch = int(epoch)
        self._first_batch = int(first_batch)

    def __len__(self) -> int:
        """The batches of the epoch from the first batch on (in exact mode, this rank
        may get one fewer: none of a small last batch)."""
        return self.global_batches - self._first_batch

    def __iter__(self) -> Iterator[list[int]]:
        return self._batches()

    def _batches(self) -> Iterator[list[int]]:
        schedule = self._balancer.schedule
        rank, batch_size = schedule.rank, self._batch
        positions = self.global_batches * batch_size if self._mode != "exact" else \
            self._length
        # np.resize repeats the order from its start to fill (pad) or cuts it (drop).
        order = np.resize(epoch_order(self._length, self._seed, self._epoch, self._shuffle),
                          positions)
        iteration = schedule.begin_iteration(self._first_batch)
        for batch in range(self._first_batch, self.global_batches):
            start = batch * batch_size
            samples = min(batch_size, positions - start)
            counts = schedule.draw(iteration, batch,
                                   lambda shares, n=samples: split_batch(n, shares))
            begin = start + sum(counts[:rank])
            if counts[rank]:
                yield order[begin:begin + counts[rank]].tolist()

    def __repr__(self) -> str:
        return (f"BalancedBatchSampler(length={self._length}, global batch {self._batch}, "
                f"mode={self._mode!r}, shuffle={self._shuffle}, seed={self._seed}, "
                f"epoch={self._epoch}, first_batch={self._first_batch})")
