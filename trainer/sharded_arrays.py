"""ShardedOptimizer for numpy training loops.

The DistributedOptimizer's numpy protocol (``(name, parameter, gradient)`` triples, the
training code writing each step's gradients into the gradient arrays, optional
``mark_ready(name)`` calls as each is final), with the optimizer state sharded: the
optimizer is built by a factory over this rank's pieces only::

    def make(parameters, gradients):            # {name: 1-D array} of this rank's pieces
        return MySGD(parameters, gradients, lr=0.1)

    optimizer = rt.ShardedOptimizer(make, [(n, params[n], grads[n]) for n in names])
    for x, y in batches:
        optimizer.zero_grad()
        backward(x, y, ready=optimizer.mark_ready)
        optimizer.step()

The parameter pieces are views of the parameters' memory, so the optimizer updates the
owned elements in place; ``step()`` then allgathers them into every rank's parameters.
The gradient pieces are arrays of this rank's averaged gradients, rewritten every step.
A rank owns at most one piece of each parameter, so the dicts are keyed by the
parameters' names (the ones this rank owns part of). The gradient arrays belong to the
training code, so stage 2 frees nothing here; it is accepted for symmetry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..collectives import (Average, Compression, Compressor, ProcessSet, allgather_async,
                           rank, reducescatter_async, size, synchronize)
from ..collectives.errors import InvalidArgumentError, UnsupportedDtypeError, UsageError
from ..kernels import BFLOAT16
from ._buckets import DEFAULT_FIRST_BUCKET_BYTES, GradientSpec
from ._buckets import fusion_threshold as resolve_fusion_threshold
from ._names import repeated_names
from .balance import LoadBalancer
from .sharded_array_state import consolidated_state_dict, local_from_consolidated
from .sharded_partition import (BucketSteps, Partition, check_arguments, clip_coefficient,
                                wait_for_buckets)

SHARD_KEY = "ringtrain_shard"
_Arrays = dict[str, np.ndarray]
_FLOATING = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
             np.dtype(BFLOAT16))


class ArrayShardedOptimizer(BucketSteps):
    """Steps an optimizer over this rank's pieces of numpy parameters, with gradients
    reduce-scattered and parameters allgathered (see the module's docstring).

    Args:
        make_optimizer: ``make(parameters, gradients)`` returns the optimizer (any object
            with ``step()``; ``state_dict()`` / ``load_state_dict()`` used when present)
            over this rank's pieces, given as ``{name: 1-D array}`` dicts.
        named_parameters: ``(name, parameter, gradient)`` triples in the model's order:
            host numpy arrays, contiguous, floating point, gradients writable and of
            their parameter's shape and dtype.
        stage, process_set, backward_passes_per_step, fusion_threshold,
            first_bucket_bytes, compression, balance: as for the PyTorch
            ShardedOptimizer.

    Raises:
        InvalidArgumentError: a factory that is not callable, malformed triples,
            duplicate names, a stage other than 1 or 2.
        UnsupportedDtypeError: a parameter that is not floating point.
    """

    def __init__(self, make_optimizer: Callable[[_Arrays, _Arrays], Any],
                 named_parameters: Iterable[tuple[str, np.ndarray, np.ndarray]] | None,
                 stage: int = 1, process_set: ProcessSet | None = None, *,
                 backward_passes_per_step: int = 1, fusion_threshold: int | None = None,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 compression: Compressor = Compression.none, balance: LoadBalancer | None = None):
        self.shard_rank = rank() if process_set is None else process_set.rank()
        self.shard_size = size() if process_set is None else process_set.size()
        if not callable(make_optimizer):
            raise InvalidArgumentError(
                f"rank {self.shard_rank}: ShardedOptimizer takes a torch.optim.Optimizer or, "
                f"for numpy training loops, a callable make(parameters, gradients) that "
                f"builds the optimizer over this rank's pieces; got "
                f"{type(make_optimizer).__name__}")
        check_arguments(stage, backward_passes_per_step, compression)
        if named_parameters is None:
            raise InvalidArgumentError(
                f"rank {self.shard_rank}: named_parameters is required for numpy training "
                f"loops: (name, parameter, gradient) triples in the model's order")
        self.stage = stage
        self.compression = compression
        self.process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        triples = _checked_triples(named_parameters, self.shard_rank)
        self.parameter_names = [name for name, _, _ in triples]
        self.parameters = [parameter for _, parameter, _ in triples]
        self.gradients = [gradient for _, _, gradient in triples]
        self._index = {name: i for i, name in enumerate(self.parameter_names)}
        self.partition = Partition(
            [GradientSpec(name, tuple(p.shape), p.dtype) for name, p, _ in triples],
            self.shard_size, resolve_fusion_threshold(fusion_threshold), first_bucket_bytes)
        self.pieces = self.partition.pieces(self.shard_rank)
        self.shard_parameters = {self.parameter_names[p.parameter]:
                                 self.parameters[p.parameter].reshape(-1)[p.start:p.stop]
                                 for p in self.pieces}
        self.shard_gradients = {self.parameter_names[p.parameter]:
                                np.zeros(p.size, self.parameters[p.parameter].dtype)
                                for p in self.pieces}
        self._pieces_of_bucket: list[list[int]] = [[] for _ in self.partition.buckets]
        for position, piece in enumerate(self.pieces):
            self._pieces_of_bucket[piece.bucket].append(position)
        self.optimizer = make_optimizer(self.shard_parameters, self.shard_gradients)
        if not callable(getattr(self.optimizer, "step", None)):
            raise InvalidArgumentError(
                f"rank {self.shard_rank}: the optimizer made by make_optimizer has no "
                f"step() method ({type(self.optimizer).__name__})")
        self._synchronized = False
        self._consolidated: Any = None
        self._reset_step()
        self._attach_balance(balance)

    def mark_ready(self, name: str) -> None:
        """Say that gradient ``name`` is final for this backward pass; its bucket's
        reduce-scatter starts once all its gradients are (and its predecessors started).

        Raises:
            InvalidArgumentError: no parameter has that name.
            UsageError: marked more often than ``backward_passes_per_step`` in a step.
        """
        index = self._index.get(name)
        if index is None:
            raise InvalidArgumentError(f"rank {self.shard_rank}: no parameter is called {name!r}")
        if self._passes[index] >= self.backward_passes_per_step:
            raise UsageError(
                f"rank {self.shard_rank}: gradient {name!r} was marked ready "
                f"{self._passes[index] + 1} times before step() or synchronize(), but "
                f"backward_passes_per_step is {self.backward_passes_per_step}")
        self._started = True
        self._synchronized = False
        self._passes[index] += 1
        if self._passes[index] < self.backward_passes_per_step:
            return
        bucket = self.partition.bucket_of[index]
        self._missing[bucket] -= 1
        self._launch_ready_buckets()

    def synchronize(self) -> None:
        """Reduce-scatter what is left, wait, and write this rank's averaged gradients
        into the gradient pieces."""

        def deliver(bucket_index: int, chunk: np.ndarray) -> None:
            for position in self._pieces_of_bucket[bucket_index]:
                piece = self.pieces[position]
                name = self.parameter_names[piece.parameter]
                self.shard_gradients[name][...] = chunk[piece.offset:piece.offset + piece.size]

        with self._balance.synchronizing():
            for bucket in self.partition.buckets[self._next_launch:]:
                self._missing[bucket.index] = 0
            self._launch_ready_buckets()
            launched = self._launched
            self._reset_step()
            wait_for_buckets(self.partition.buckets, launched, deliver)
        self._synchronized = True

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Synchronize (unless done already or inside :meth:`skip_synchronize`), call the
        optimizer's ``step(*args, **kwargs)``, allgather the parameters; its result."""
        if not self._synchronized and not self._skip:
            self.synchronize()
        result = self.optimizer.step(*args, **kwargs)
        self._synchronized = False
        self._consolidated = None
        self._gather_parameters()
        self._balance.stepped()
        return result

    def zero_grad(self) -> None:
        """Zero the gradient arrays (and the optimizer's, if it has ``zero_grad()``).

        Raises:
            UsageError: called after gradients were marked ready, before ``step()``.
        """
        if self._started:
            raise UsageError(
                f"rank {self.shard_rank}: optimizer.zero_grad() was called after gradients "
                f"were marked ready and before optimizer.step() or optimizer.synchronize()")
        for gradient in self.gradients:
            gradient[...] = 0
        zero_grad = getattr(self.optimizer, "zero_grad", None)
        if callable(zero_grad):
            zero_grad()
        self._synchronized = False
        self._balance.compute_started()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale the averaged gradient pieces so that their norm over all ranks' shards is
        at most ``max_norm``; synchronizes first if needed (then call ``step()``).

        Returns:
            The total norm of the averaged gradients before clipping.
        """
        if not self._synchronized:
            self.synchronize()
        gradients = [g for g in self.shard_gradients.values() if g.size]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((float(np.abs(g).max()) for g in gradients), default=0.0)
        else:
            local = sum(float((np.abs(g.astype(np.float64)) ** norm_type).sum())
                        for g in gradients)
        total, coefficient = clip_coefficient(local, max_norm, norm_type, self.process_set)
        if coefficient < 1.0:
            for gradient in gradients:
                gradient *= gradient.dtype.type(coefficient)
        return total

    def state_dict(self, consolidate: bool | None = None, to_rank: int = 0) -> Any:
        """The optimizer's state.

        Args:
            consolidate: True: on ``to_rank``, the state the same optimizer over the whole
                parameters would hold, when it keeps per-element state in dicts keyed by
                parameter name (see :mod:`~ringtrain.trainer.sharded_array_state`); None
                on the other ranks; collective. False: this rank's shard (the optimizer's
                ``state_dict()`` and the partition it belongs to; no communication).
                None (default): what :meth:`consolidate_state_dict` left on this rank if
                no step came since, else the shard.
            to_rank: the rank (in the process set) that receives the consolidated state.
        """
        if consolidate:
            return consolidated_state_dict(self, self._check_rank(to_rank))
        if consolidate is None and self._consolidated is not None:
            return self._consolidated
        return {SHARD_KEY: self._signature(), "optimizer": self.optimizer.state_dict()}

    def consolidate_state_dict(self, to_rank: int = 0) -> None:
        """Gather the whole state onto ``to_rank``, where the next ``state_dict()`` returns
        it until the next ``step()``; collective (``ringtrain.elastic.State.commit()``
        calls it)."""
        self._consolidated = consolidated_state_dict(self, self._check_rank(to_rank))

    def load_state_dict(self, state_dict: Any) -> None:
        """Load this rank's shard, or a consolidated state (saved with any number of
        ranks, or by the same optimizer over the whole parameters), of which this rank
        takes its pieces.

        Raises:
            InvalidArgumentError: another rank's or another partition's shard, or
                per-element state that does not fit the parameters.
        """
        self._consolidated = None
        signature = state_dict.get(SHARD_KEY) if isinstance(state_dict, dict) else None
        if signature is None:
            self.optimizer.load_state_dict(local_from_consolidated(self, state_dict))
            return
        if signature != self._signature():
            found = "not a ShardedOptimizer state" if not isinstance(signature, dict) else \
                f"the shard of rank {signature.get('rank')} of {signature.get('size')}"
            raise InvalidArgumentError(
                f"rank {self.shard_rank}: this state_dict is not this rank's shard "
                f"({self.shard_rank} of {self.shard_size}) but {found}: save "
                f"state_dict(consolidate=True) to load it on other ranks")
        self.optimizer.load_state_dict(state_dict["optimizer"])


    def _signature(self) -> dict[str, Any]:
        return {"rank": self.shard_rank, "size": self.shard_size,
                "pieces": [(self.parameter_names[p.parameter], p.start, p.stop)
                           for p in self.pieces]}

    def _launch_ready_buckets(self) -> None:
        buckets = self.partition.buckets
        while self._next_launch < len(buckets) and not self._missing[self._next_launch]:
            bucket = buckets[self._next_launch]
            buffer = np.empty(bucket.total, bucket.dtype)
            for member, offset in zip(bucket.members, bucket.offsets):
                gradient = self.gradients[member]
                buffer[offset:offset + gradient.size] = gradient.reshape(-1)
            handle = reducescatter_async(buffer, op=Average, name=bucket.name,
                                         prescale_factor=self._launch_prescale(),
                                         process_set=self.process_set,
                                         compression=self.compression)
            self._launched.append((bucket.index, handle))
            self._next_launch += 1

    def _gather_parameters(self) -> None:
        handles = []
        for index, bucket in enumerate(self.partition.buckets):
            owned = [self.shard_parameters[self.parameter_names[self.pieces[p].parameter]]
                     for p in self._pieces_of_bucket[index]]
            chunk = np.concatenate(owned) if owned else np.empty(0, bucket.dtype)
            handles.append(allgather_async(chunk, name=f"{bucket.name} parameters",
                                           process_set=self.process_set))
        for bucket, handle in zip(self.partition.buckets, handles):
            flat = synchronize(handle)
            for member, offset in zip(bucket.members, bucket.offsets):
                parameter = self.parameters[member]
                parameter.reshape(-1)[...] = flat[offset:offset + parameter.size]

    def __repr__(self) -> str:
        return (f"ArrayShardedOptimizer(rank {self.shard_rank} of {self.shard_size}: "
                f"{self.partition.elements(self.shard_rank)} of {self.partition.total} "
                f"elements, {self.optimizer!r})")


def _checked_triples(named_parameters: Iterable[tuple[str, Any, Any]],
                     shard_rank: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    triples = []
    for position, entry in enumerate(named_parameters):
        try:
            name, parameter, gradient = entry
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"rank {shard_rank}: named_parameters[{position}]: expected a (name, "
                f"parameter, gradient) triple, got {type(entry).__name__}") from None
        if not isinstance(parameter, np.ndarray) or not isinstance(gradient, np.ndarray):
            raise InvalidArgumentError(
                f"rank {shard_rank}: parameter {name!r}: the numpy ShardedOptimizer takes "
                f"numpy arrays, got {type(parameter).__name__} and {type(gradient).__name__}")
        if parameter.dtype not in _FLOATING:
            raise UnsupportedDtypeError(
                f"rank {shard_rank}: parameter {name!r} has dtype {parameter.dtype}; "
                f"ShardedOptimizer shards float16, bfloat16, float32 and float64 parameters")
        if not parameter.flags.c_contiguous or not parameter.flags.writeable:
            raise InvalidArgumentError(
                f"rank {shard_rank}: parameter {name!r} must be a contiguous, writable "
                f"array (its pieces are views of its memory)")
        if gradient.shape != parameter.shape or gradient.dtype != parameter.dtype:
            raise InvalidArgumentError(
                f"rank {shard_rank}: gradient of {name!r} is {gradient.shape} "
                f"{gradient.dtype}, its parameter {parameter.shape} {parameter.dtype}")
        triples.append((name, parameter, gradient))
    repeated = repeated_names(name for name, _, _ in triples)
    if repeated:
        raise InvalidArgumentError(
            f"rank {shard_rank}: named_parameters repeats the name(s) "
            f"{', '.join(map(repr, repeated))}; every parameter needs a name of its own")
    return triples
