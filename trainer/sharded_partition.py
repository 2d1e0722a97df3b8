"""Which rank owns which elements of the parameters: the partition of a ShardedOptimizer.

Parameters are grouped into buckets exactly as the DistributedOptimizer groups its
gradients (:func:`~ringtrain.trainer._buckets.assign_buckets`: one dtype per bucket, the
last layers first, large tensors alone). Each bucket is a flat array (its parameters
flattened and concatenated, no padding) split into N contiguous chunks the way
``reducescatter`` splits axis 0 (``numpy.array_split``: the first ``T mod N`` chunks one
element longer). Rank r owns chunk r of every bucket, so the reduce-scatter of a
bucket's gradients hands every rank exactly the gradients of the elements it owns, and
the allgather of the owned chunks rebuilds the bucket.

A parameter may therefore span several ranks; the part of a parameter in one rank's
chunk is a :class:`Piece`. Every rank owns ``floor(T/N)`` or ``ceil(T/N)`` elements of
every bucket of ``T`` elements: ranks differ by at most one element per bucket, and none
owns more than ``ceil(total/N) + buckets - 1`` elements. The partition depends only on
the parameters' names, shapes and dtypes, the bucket settings and N, so every rank
computes the same one without communicating.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..collectives import Average, Compressor, Max, ProcessSet, Sum, allreduce, synchronize
from ..collectives.errors import InvalidArgumentError
from ._balanced_steps import NO_BALANCE, NoBalance, StepBalance, step_balance
from .balance import LoadBalancer
from ._buckets import GradientSpec, assign_buckets

_NAMES_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class Piece:
    """The elements ``[start, stop)`` of flattened parameter ``parameter`` that one rank
    owns; they lie at ``offset`` in that rank's chunk of bucket ``bucket``."""

    parameter: int
    bucket: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class ShardBucket:
    """Parameters reduced and gathered as one flat array.

    Attributes:
        index: position in launch order.
        name: names the bucket's collectives (the same on every rank for the same model).
        members: parameter indices, in the flat array's order.
        offsets: where each member starts in the flat array.
        total: elements in the flat array.
        bounds: ``bounds[r]:bounds[r + 1]`` is rank r's chunk.
    """

    index: int
    name: str
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    bounds: tuple[int, ...]
    dtype: np.dtype


def chunk_bounds(total: int, size: int) -> tuple[int, ...]:
    """``numpy.array_split``'s bounds of ``total`` elements in ``size`` chunks."""
    base, extra = divmod(total, size)
    return tuple(r * base + min(r, extra) for r in range(size + 1))


class Partition:
    """The buckets of a model's parameters and the pieces each of N ranks owns.

    Args:
        specs: name, shape and dtype of each parameter, in the model's order.
        size: number of ranks sharing the model.
        fusion_threshold: bucket size limit in bytes (0: one bucket per parameter).
        first_bucket_bytes: the first bucket's limit.
    """

    def __init__(self, specs: Sequence[GradientSpec], size: int, fusion_threshold: int,
                 first_bucket_bytes: int):
        self.specs = list(specs)
        self.size = size
        groups = assign_buckets(self.specs, fusion_threshold, first_bucket_bytes)
        self.buckets: list[ShardBucket] = []
        for index, members in enumerate(groups):
            members = sorted(members)
            sizes = [int(np.prod(self.specs[m].shape, dtype=np.int64)) for m in members]
            offsets = tuple(int(o) for o in np.cumsum([0] + sizes[:-1]))
            total = int(sum(sizes))
            names = [self.specs[m].name for m in members]
            more = f", +{len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
            name = (f"sharded bucket {index + 1}/{len(groups)} "
                    f"[{', '.join(names[:_NAMES_SHOWN])}{more}]")
            self.buckets.append(ShardBucket(index, name, tuple(members), offsets, total,
                                            chunk_bounds(total, size),
                                            self.specs[members[0]].dtype))
        self.bucket_of = [0] * len(self.specs)
        for bucket in self.buckets:
            for member in bucket.members:
                self.bucket_of[member] = bucket.index

    @property
    def total(self) -> int:
        """Elements of all parameters."""
        return sum(bucket.total for bucket in self.buckets)

    def pieces(self, rank: int) -> list[Piece]:
        """The pieces rank ``rank`` owns, bucket by bucket, in chunk order."""
        owned = []
        for bucket in self.buckets:
            low, high = bucket.bounds[rank], bucket.bounds[rank + 1]
            for member, offset in zip(bucket.members, bucket.offsets):
                size = int(np.prod(self.specs[member].shape, dtype=np.int64))
                first, last = max(low, offset), min(high, offset + size)
                if first < last:
                    owned.append(Piece(member, bucket.index, first - offset, last - offset,
                                       first - low))
        return owned

    def elements(self, rank: int) -> int:
        """How many elements rank ``rank`` owns."""
        return sum(b.bounds[rank + 1] - b.bounds[rank] for b in self.buckets)

    def __repr__(self) -> str:
        return (f"Partition({len(self.specs)} parameters, {self.total} elements in "
                f"{len(self.buckets)} buckets over {self.size} ranks)")


def check_arguments(stage: Any, backward_passes_per_step: Any, compression: Any) -> None:
    """Raise InvalidArgumentError unless the ShardedOptimizers' common arguments are valid:
    ``stage`` 1 or 2, ``backward_passes_per_step`` an integer >= 1, ``compression`` a
    :class:`~ringtrain.Compressor`."""
    if stage not in (1, 2) or isinstance(stage, bool):
        raise InvalidArgumentError(f"stage must be 1 or 2, got {stage!r}")
    if not isinstance(backward_passes_per_step, int) or \
            isinstance(backward_passes_per_step, bool) or backward_passes_per_step < 1:
        raise InvalidArgumentError(f"backward_passes_per_step must be an integer >= 1, "
                                   f"got {backward_passes_per_step!r}")
    if not isinstance(compression, Compressor):
        raise InvalidArgumentError(f"compression must be Compression.none, .fp16, .bf16 or "
                                   f"another Compressor, got {compression!r}")


def clip_coefficient(local: float, max_norm: float, norm_type: float,
                     process_set: ProcessSet | None) -> tuple[float, float]:
    """The total gradient norm over all ranks' shards, and the factor that brings it to
    ``max_norm`` (1 when it is below): ``local`` is this rank's ``sum |g|^p`` over the
    elements it owns (each element is owned by one rank), or its largest ``|g|`` for the
    infinity norm; one 8-byte allreduce combines them."""
    infinite = norm_type == float("inf")
    combined = float(allreduce(np.array([local]), op=Max if infinite else Sum,
                               name="sharded gradient norm", process_set=process_set)[0])
    total = combined if infinite else combined ** (1.0 / norm_type)
    return total, min(1.0, float(max_norm) / (total + 1e-6))


def wait_for_buckets(buckets: Sequence[ShardBucket], launched: Sequence[tuple[int, Any]],
                     deliver: Callable[[int, Any], None]) -> None:
    """Wait for every launched reduce-scatter (``(bucket index, handle)`` pairs) and hand
    each bucket's chunk to ``deliver(bucket index, chunk)``.

    All of them are waited for, also after one failed, so that no bucket is left in
    flight; then the first failure is raised, noting its bucket.
    """
    failure = None
    for bucket_index, handle in launched:
        try:
            chunk = synchronize(handle)
        except BaseException as error:  # the other buckets must still finish
            if failure is None:
                error.add_note(f"while reducing {buckets[bucket_index].name}")
                failure = error
            continue
        deliver(bucket_index, chunk)
    if failure is not None:
        raise failure


class BucketSteps:
    """Mixin of the ShardedOptimizers: one step's bucket bookkeeping, the load
    balancer's calls, and :meth:`skip_synchronize`. A class using it sets ``partition``,
    ``parameters``, ``shard_rank``, ``shard_size``, ``process_set`` and
    ``backward_passes_per_step``."""

    partition: Partition
    parameters: Sequence[Any]
    shard_rank: int
    shard_size: int
    process_set: ProcessSet | None
    backward_passes_per_step: int
    _skip = False
    _balance: StepBalance | NoBalance = NO_BALANCE

    @property
    def balancer(self) -> LoadBalancer | None:
        """The :class:`~ringtrain.trainer.balance.LoadBalancer` given as ``balance=``, or None."""
        return self._balance.balancer

    def _attach_balance(self, balancer: LoadBalancer | None) -> None:
        """Weight this rank's gradients by its samples and report steps to ``balancer``
        (None: nothing to do)."""
        self._balance = step_balance(balancer, Average, self.process_set, "ShardedOptimizer",
                                     lambda: self.backward_passes_per_step)

    def _launch_prescale(self) -> float:
        """The prescale of the bucket launched next: the step's weight of this rank's
        gradients, taken when the step's first bucket is launched."""
        if self._next_launch == 0:
            self._step_prescale = self._balance.weight()
        return self._step_prescale

    def _check_rank(self, to_rank: int) -> int:
        """``to_rank`` if it is a rank of the process set, else InvalidArgumentError."""
        if not isinstance(to_rank, int) or not 0 <= to_rank < self.shard_size:
            raise InvalidArgumentError(
                f"rank {self.shard_rank}: to_rank must be a rank in 0..{self.shard_size - 1}, "
                f"got {to_rank!r}")
        return to_rank

    def _reset_step(self) -> None:
        """Nothing marked ready, launched or accumulated yet."""
        self._started = False
        self._next_launch = 0
        self._step_prescale = 1.0
        self._launched: list[tuple[int, Any]] = []
        self._passes = [0] * len(self.parameters)
        self._missing = [len(bucket.members) for bucket in self.partition.buckets]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize (after ``synchronize()``)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False
