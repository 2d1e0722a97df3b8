"""Data sharding: which indices of a dataset each rank reads in an epoch.

:class:`DistributedSampler` shuffles the indices ``0 .. n-1`` with a permutation that
depends only on ``seed + epoch``, so every rank computes the same order without
communicating, and rank ``r`` of ``R`` takes positions ``r, r+R, r+2R, ...`` of it. Its
``mode`` says what happens when ``n`` is not a multiple of ``R``:

``"pad"`` (default)
    The order is extended by repeating it from its start until its length is a multiple
    of ``R``; every rank gets ``ceil(n/R)`` indices, a few of them seen twice in the
    epoch. Use it for training with ``DistributedOptimizer``: every rank runs the same
    number of steps, so every allreduce of the gradients has all ranks taking part.
``"drop"``
    The order is cut to ``floor(n/R)*R``; every rank gets ``floor(n/R)`` indices, and up
    to ``R-1`` samples are left out of the epoch (a different few each epoch when
    shuffling). Use it for training when a sample must not be seen twice in an epoch.
``"exact"``
    Every index exactly once across the ranks; the first ``n % R`` ranks get one index
    more than the others. Use it for evaluation, and sum the metric's totals and counts
    over the ranks, e.g. ``allreduce(np.array([correct, seen]), op=Sum)``, so the result
    is that of the whole dataset. When training on exact shards, ranks run different
    numbers of batches: a rank that runs out must call ``ringtrain.trainer.join`` so the
    others' allreduces still complete.

The sampler is a ``sampler=`` for a ``torch.utils.data.DataLoader`` (it yields Python
ints and has a length) and works as well in a plain loop over numpy arrays::

    sampler = DistributedSampler(len(images), mode="pad", seed=42)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for index in sampler:
            ...

Importing this module imports neither mpi4py nor torch; the collectives are imported
only when the rank or the number of ranks is taken from the running job.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import numpy as np

MODES = ("pad", "drop", "exact")


class DistributedSampler:
    """This rank's indices of a dataset, for one epoch at a time.

    The dataset's length is read once, when the sampler is made.

    Args:
        dataset: the dataset's length, or an object with ``__len__``.
        num_replicas: the number of ranks sharing the dataset (default:
            ``ringtrain.collectives.size()``).
        rank: this rank, in ``[0, num_replicas)`` (default: ``ringtrain.collectives.rank()``).
        shuffle: permute the indices each epoch; when false, the natural order is dealt out.
        seed: must be the same on every rank; with the epoch it picks the permutation.
        mode: ``"pad"``, ``"drop"`` or ``"exact"`` (see the module's description).

    Raises:
        InvalidArgumentError: a negative length, ``num_replicas`` below 1, ``rank`` outside
            ``[0, num_replicas)``, a negative seed or an unknown mode.
        NotInitializedError: ``num_replicas`` or ``rank`` is left out before ``init()``.
    """

    def __init__(self, dataset: int | Sized, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True, seed: int = 0,
                 mode: str = "pad"):
        length = dataset_length("DistributedSampler", dataset)
        check_mode("DistributedSampler", mode)
        if num_replicas is None:
            from ..collectives import size
            num_replicas = size()
        if rank is None:
            from ..collectives import rank as world_rank
            rank = world_rank()
        check_int("DistributedSampler", "num_replicas", num_replicas)
        check_int("DistributedSampler", "rank", rank)
        check_seed("DistributedSampler", seed)
        if num_replicas < 1:
            raise invalid_argument(f"DistributedSampler: num_replicas must be at least 1, "
                                   f"got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise invalid_argument(f"DistributedSampler: rank must be in [0, {num_replicas}) for "
                                   f"num_replicas={num_replicas}, got {rank}")
        self._length = length
        self._num_replicas = int(num_replicas)
        self._rank = int(rank)
        self._shuffle = bool(shuffle)
        self._seed = int(seed)
        self._mode = mode
        self._epoch = 0

    @property
    def num_replicas(self) -> int:
        """The number of ranks sharing the dataset."""
        return self._num_replicas

    @property
    def rank(self) -> int:
        """This sampler's rank."""
        return self._rank

    @property
    def mode(self) -> str:
        """``"pad"``, ``"drop"`` or ``"exact"``."""
        return self._mode

    @property
    def epoch(self) -> int:
        """The epoch whose permutation is used, as given to :meth:`set_epoch`."""
        return self._epoch

    @property
    def total_size(self) -> int:
        """The number of indices dealt out over all ranks (``n`` in exact mode)."""
        n, replicas = self._length, self._num_replicas
        if self._mode == "pad":
            return math.ceil(n / replicas) * replicas
        if self._mode == "drop":
            return n // replicas * replicas
        return n

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch; call it on every rank before iterating, with the same value.

        Args:
            epoch: a number >= 0; the shuffle is the permutation drawn from
                ``numpy.random.Generator(numpy.random.PCG64(seed + epoch))``.

        Raises:
            InvalidArgumentError: ``epoch`` is negative or not an integer.
        """
        check_int("DistributedSampler", "epoch", epoch)
        if epoch < 0:
            raise invalid_argument(f"DistributedSampler: epoch must be >= 0, got {epoch}")
        self._epoch = int(epoch)

    def __len__(self) -> int:
        if self._mode == "exact":
            quotient, remainder = divmod(self._length, self._num_replicas)
            return quotient + (self._rank < remainder)
        return self.total_size // self._num_replicas

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self._length, self._seed, self._epoch, self._shuffle)
        # np.resize repeats the array from its start to fill (pad) or cuts it (drop).
        order = np.resize(order, self.total_size)
        return iter(order[self._rank::self._num_replicas].tolist())

    def __repr__(self) -> str:
        return (f"DistributedSampler(length={self._length}, num_replicas={self._num_replicas}, "
                f"rank={self._rank}, mode={self._mode!r}, shuffle={self._shuffle}, "
                f"seed={self._seed}, epoch={self._epoch}, len={len(self)})")


# What the samplers share (the BalancedBatchSampler too).

def epoch_order(length: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The indices ``0 .. length-1`` in an epoch's order: the permutation drawn from
    ``numpy.random.Generator(numpy.random.PCG64(seed + epoch))``, or the natural order."""
    if shuffle:
        return np.random.Generator(np.random.PCG64(seed + epoch)).permutation(length)
    return np.arange(length)


def dataset_length(owner: str, dataset: int | Sized) -> int:
    """``dataset`` if it is an int, else its ``len()``; checked to be >= 0.

    Raises:
        InvalidArgumentError: neither an int nor sized, or a negative length.
    """
    if isinstance(dataset, (int, np.integer)) and not isinstance(dataset, bool):
        length = int(dataset)
    elif hasattr(dataset, "__len__"):
        length = len(dataset)
    else:
        raise invalid_argument(f"{owner}: dataset must be an int (its length) or have "
                               f"__len__, got {type(dataset).__name__}")
    if length < 0:
        raise invalid_argument(f"{owner}: the dataset's length must be >= 0, got {length}")
    return length


def check_mode(owner: str, mode: str) -> None:
    """Refuse a ``mode`` that is not one of :data:`MODES`, naming ``owner``."""
    if mode not in MODES:
        raise invalid_argument(f"{owner}: mode must be one of "
                               f"{', '.join(map(repr, MODES))}, got {mode!r}")


def check_seed(owner: str, seed: object) -> None:
    """Refuse a ``seed`` that is not an integer >= 0, naming ``owner``."""
    check_int(owner, "seed", seed)
    if seed < 0:
        raise invalid_argument(f"{owner}: seed must be >= 0, got {seed}")


def check_int(owner: str, name: str, value: object) -> None:
    """Raise InvalidArgumentError unless ``value`` is an int (numpy's too, not a bool)."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise invalid_argument(f"{owner}: {name} must be an int, got "
                               f"{type(value).__name__} {value!r}")


def invalid_argument(message: str) -> Exception:
    """An InvalidArgumentError (imported here: importing the collectives imports mpi4py)."""
    from ..collectives.errors import InvalidArgumentError
    return InvalidArgumentError(message)
