"""ShardedOptimizer: data parallelism with the optimizer state sharded across ranks
(ZeRO stage 1 and 2) for PyTorch.

Every rank keeps the whole model, but steps only the elements it owns (its shard, see
:mod:`~ringtrain.trainer.sharded_partition`), so the optimizer's state (momentum, Adam's
moments) exists once across the ranks instead of once per rank. A training step:

1. during ``backward()``, a post-accumulate-grad hook on each parameter marks its
   gradient ready; a bucket whose gradients are all ready (and whose predecessors have
   started) is packed into a flat buffer and ``reducescatter_async``-ed (averaged), so
   each rank receives the averaged gradients of the elements it owns while the backward
   pass goes on. With ``stage=2`` the parameters' ``.grad`` are freed (set to None) as
   soon as they are packed;
2. ``step()`` waits for the buckets, hands each owned piece its averaged gradient, steps
   the wrapped optimizer, whose ``param_groups`` hold this rank's pieces (1-D views of
   the parameters' memory, so the optimizer updates the model in place), and
   ``allgather``-s the updated chunks into every rank's parameters.

Reduce-scatter plus allgather move the bytes of one allreduce.

With ``master_weights=True`` the wrapped optimizer steps float32 copies of this rank's
pieces of the float16 and bfloat16 parameters (ZeRO's fp32 master weights: each rank
keeps the copies of its shard only, 4 bytes per owned element): the averaged 16-bit
gradients are upcast into the copies' ``.grad``, and after the step the copies are
rounded into the model's memory, whose 16-bit chunks are then allgathered.

Given gradient masks (:meth:`TorchShardedOptimizer.set_gradient_masks`, which a pruner
calls), a bucket's reduce-scatter and allgather carry its kept elements alone
(:mod:`~ringtrain.trainer.sharded_masks`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..collectives import (Average, Compression, Compressor, ProcessSet, allgather_async,
                           rank, reducescatter_async, size, synchronize)
from ..collectives.errors import InvalidArgumentError, UnsupportedDtypeError, UsageError
from ._buckets import DEFAULT_FIRST_BUCKET_BYTES, GradientSpec
from ._buckets import fusion_threshold as resolve_fusion_threshold
from ._dtypes import numpy_dtype
from ._gradient_masks import kept_elements
from .balance import LoadBalancer
from .gradient_reducer import wire_itemsize
from .master_weights import LOW_PRECISION
from .torch_optimizer import (WrappedOptimizerView, host_masks,
                              named_trainable_parameters)
from .sharded_partition import (BucketSteps, Partition, Piece, ShardBucket, check_arguments,
                                clip_coefficient, wait_for_buckets)
from .sharded_masks import KeptBucket
from .sharded_state import consolidated_state_dict, load_state_dict, shard_state_dict

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TorchShardedOptimizer(BucketSteps, WrappedOptimizerView, torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` so that each rank steps, and keeps optimizer
    state for, only its shard of the parameters (ZeRO stage 1 or 2).

    Args:
        optimizer: any torch optimizer whose update is elementwise (SGD, Adam, AdamW,
            RMSprop, Adagrad, ...), built over the model's parameters (CPU or CUDA;
            float32, float64, float16 or bfloat16; contiguous). Its ``param_groups`` keep
            their hyper-parameters (learning-rate schedulers work on them); their
            ``params`` are replaced by this rank's pieces.
        named_parameters: ``model.named_parameters()``: names in errors and the model's
            order (which decides the buckets and so the partition). Every parameter of
            ``optimizer`` must be named; names must be unique.
        stage: 1 shards the optimizer state; 2 also frees each full gradient once it is
            packed for its reduce-scatter (each rank then keeps only its shard of the
            averaged gradients).
        process_set: the ranks that share the model (default: all).
        backward_passes_per_step: backward passes accumulated locally per step.
        fusion_threshold: bucket size limit in bytes (default: as DistributedOptimizer).
        first_bucket_bytes: the first bucket's limit (default 1 MiB).
        compression: ``Compression.fp16`` or ``Compression.bf16``: float32 gradients are
            reduce-scattered as 16-bit floats (as the DistributedOptimizer's allreduce
            compresses them); the parameters' allgather is not compressed.
        master_weights: the wrapped optimizer steps float32 copies of this rank's pieces
            of the float16 and bfloat16 parameters (see the module's docstring); the
            copies are taken from the model at the first step (so weights broadcast
            after wrapping are kept) and are part of :meth:`state_dict`, under
            ``"master_weights"`` as the DistributedOptimizer saves them.
        balance: a :class:`~ringtrain.trainer.balance.LoadBalancer`: this rank's
            gradients are weighted by the samples it trained (the prescale of its
            reduce-scatters), its steps timed, and ``step()`` calls the balancer's
            ``step()``.

    Raises:
        InvalidArgumentError: a stage other than 1 or 2, duplicate or missing names, a
            non-contiguous parameter, a ``master_weights`` that is not a bool.
        UnsupportedDtypeError: a parameter that is not floating point, or not on the CPU
            or a CUDA device.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 stage: int = 1, process_set: ProcessSet | None = None, *,
                 backward_passes_per_step: int = 1, fusion_threshold: int | None = None,
                 first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                 compression: Compressor = Compression.none,
                 master_weights: bool = False, balance: LoadBalancer | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_arguments(stage, backward_passes_per_step, compression)
        if not isinstance(master_weights, bool):
            raise InvalidArgumentError(
                f"master_weights must be True or False, got {master_weights!r}")
        self.optimizer = optimizer
        self.stage = stage
        self.compression = compression
        self.process_set = process_set
        self.shard_rank = rank() if process_set is None else process_set.rank()
        self.shard_size = size() if process_set is None else process_set.size()
        self.backward_passes_per_step = backward_passes_per_step
        named = named_trainable_parameters(optimizer, named_parameters,
                                           f"rank {self.shard_rank}: ")
        self.parameter_names = [name for name, _ in named]
        self.parameters = [parameter for _, parameter in named]
        self.partition = Partition(
            [_spec(name, p, self.shard_rank) for name, p in named], self.shard_size,
            resolve_fusion_threshold(fusion_threshold), first_bucket_bytes)
        existing = optimizer.state_dict() if optimizer.state else None
        self.group_parameters = [list(group["params"]) for group in optimizer.param_groups]
        self.pieces: list[Piece] = self.partition.pieces(self.shard_rank)
        self.views = [self.parameters[p.parameter].detach().view(-1)[p.start:p.stop]
                      for p in self.pieces]
        self.master_weights = master_weights
        self.shards = [_master_of(view) if master_weights and view.dtype in LOW_PRECISION
                       else view for view in self.views]
        self.masters_taken = False
        self.group_pieces = self._rebuild_groups()
        self._pieces_of_bucket: list[list[int]] = [[] for _ in self.partition.buckets]
        self._pieces_of_parameter: dict[int, list[int]] = {id(p): [] for p in self.parameters}
        for position, piece in enumerate(self.pieces):
            self._pieces_of_bucket[piece.bucket].append(position)
            self._pieces_of_parameter[id(self.parameters[piece.parameter])].append(position)
        self._lock = threading.Lock()
        self._synchronized = False
        self._skip = False
        self._consolidated: dict[str, Any] | None = None
        self._kept: list[KeptBucket | None] = [None] * len(self.partition.buckets)
        self._reset_step()
        self._attach_balance(balance)
        self._hooks = [hook for index, p in enumerate(self.parameters)
                       for hook in self._register_hooks(index, p)]
        if existing is not None:
            load_state_dict(self, existing)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the partition is fixed when the optimizer is wrapped."""
        raise UsageError("add_param_group() on a ShardedOptimizer: add the group to the "
                         "optimizer before wrapping it")

    def state_elements(self) -> int:
        """Elements of the per-element state tensors this rank holds (all keys)."""
        return sum(value.numel() for shard in self.shards
                   for value in self.optimizer.state.get(shard, {}).values()
                   if isinstance(value, torch.Tensor) and value.dim() > 0)

    def set_gradient_masks(self, masks: Iterable[tuple[torch.Tensor, torch.Tensor | None]]
                           ) -> None:
        """Send only the kept elements of masked parameters from the next step on
        (:class:`~ringtrain.pruning.Pruner` calls this when its masks change): their
        gradients are reduce-scattered and their updated values allgathered without the
        pruned elements, which get zero gradients and are zero in the parameters after
        every step. The partition, and so the optimizer state, stays where it is.

        Args:
            masks: ``(parameter, mask)`` pairs (mask nonzero: kept; None: the whole
                parameter); parameters not given travel whole. Every rank must give the
                same masks (a bucket whose masks differ raises a MismatchError on every
                rank at the next step).

        Raises:
            InvalidArgumentError: a parameter this optimizer does not step, a mask of
                another shape, or a masked parameter in GPU memory.
            UsageError: called between ``backward()`` and ``step()``.
        """
        named = list(zip(self.parameter_names, self.parameters))
        elements = [kept_elements(name, tuple(parameter.shape), array)
                    for (name, parameter), array in zip(named, host_masks(masks, named, "steps"))]
        kept = [None if k is None else k.kept for k in elements]
        if self._started:
            raise UsageError(f"rank {self.shard_rank}: set_gradient_masks() was called while "
                             f"gradients are being reduced; call it before backward() or "
                             f"after step()")
        self._kept = [
            None if all(kept[m] is None for m in bucket.members) else
            KeptBucket(bucket, [kept[m] for m in bucket.members],
                       [self.parameters[m].numel() for m in bucket.members], self.shard_rank)
            for bucket in self.partition.buckets]

    @property
    def bytes_per_step(self) -> int:
        """The bytes this rank hands to the reduce-scatters of a step with the current
        masks (float32 counted as 2 bytes under fp16 or bf16 compression)."""
        return sum((bucket.total if kept is None else kept.count) *
                   wire_itemsize(self.compression, bucket.dtype)
                   for bucket, kept in zip(self.partition.buckets, self._kept))

    def mask_elements(self, parameter: torch.Tensor, mask: torch.Tensor) -> None:
        """Multiply the elements of ``parameter`` that this rank owns by ``mask`` (of the
        parameter's shape) wherever the wrapped optimizer keeps them: its per-element
        state (momentum, moments) and, with ``master_weights``, the float32 copies. A
        pruner calls it after zeroing pruned weights, so that their state is zero as it
        would be in an unsharded optimizer's and the weights stay zero.

        Raises:
            InvalidArgumentError: ``parameter`` is not one this optimizer steps.
        """
        positions = self._pieces_of_parameter.get(id(parameter))
        if positions is None:
            raise InvalidArgumentError(
                f"rank {self.shard_rank}: mask_elements: a parameter of shape "
                f"{tuple(parameter.shape)} that this ShardedOptimizer does not step")
        flat = mask.detach().reshape(-1)
        with torch.no_grad():
            for position in positions:
                piece, shard = self.pieces[position], self.shards[position]
                keep = flat[piece.start:piece.stop]
                shard.mul_(keep)
                for value in self.optimizer.state.get(shard, {}).values():
                    if isinstance(value, torch.Tensor) and value.shape == shard.shape:
                        value.mul_(keep)

    # The training step.
    def synchronize(self) -> None:
        """Launch the buckets still waiting (missing gradients count as zeros), wait for
        all of them, and give every owned piece its averaged gradient (``.grad``)."""

        def deliver(bucket_index: int, chunk: torch.Tensor) -> None:
            kept = self._kept[bucket_index]
            if kept is not None:
                chunk = kept.expand(chunk)
            for position in self._pieces_of_bucket[bucket_index]:
                piece = self.pieces[position]
                shard = self.shards[position]
                gradient = chunk[piece.offset:piece.offset + piece.size]
                shard.grad = gradient if gradient.dtype == shard.dtype else \
                    gradient.to(shard.dtype)

        with self._balance.synchronizing():
            with self._lock:
                for bucket in self.partition.buckets[self._next_launch:]:
                    self._missing[bucket.index] = 0
                self._launch_ready_buckets()
                launched = self._launched
                self._reset_step()
            wait_for_buckets(self.partition.buckets, launched, deliver)
        self._synchronized = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Synchronize (unless done already or inside :meth:`skip_synchronize`), step the
        wrapped optimizer on this rank's pieces, then allgather the updated parameters.
        A ``closure`` runs (with gradients enabled) before the synchronization."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synchronized and not self._skip:
            self.synchronize()
        self.take_masters_from_model()
        self.optimizer.step()
        self._synchronized = False
        self._consolidated = None
        self._round_masters_into_model()
        self._gather_parameters()
        self._balance.stepped()
        return loss

    def take_masters_from_model(self) -> None:
        """Set the float32 copies (``master_weights=True``) to the model's parameters,
        unless done already (or loaded from a state dict)."""
        if self.masters_taken:
            return
        with torch.no_grad():
            for shard, view in zip(self.shards, self.views):
                if shard is not view:
                    shard.copy_(view)
        self.masters_taken = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' and the pieces' gradients.

        Raises:
            UsageError: called after ``backward()`` and before ``step()`` or
                ``synchronize()`` (the gradients are being reduced).
        """
        if self._started:
            raise UsageError(
                f"rank {self.shard_rank}: optimizer.zero_grad() was called after "
                f"loss.backward() but before optimizer.step() or optimizer.synchronize(): "
                f"the gradients are being reduced; call zero_grad() before backward() or "
                f"after step()")
        for tensor in [*self.parameters, *self.shards]:
            if tensor.grad is None:
                continue
            if set_to_none:
                tensor.grad = None
            else:
                tensor.grad.detach_()
                tensor.grad.zero_()
        self._synchronized = False
        self._balance.compute_started()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their norm over all ranks' shards is at
        most ``max_norm``; synchronizes first if needed (then call ``step()``).

        Each rank sums ``|g|^p`` over its pieces (each element is owned by exactly one
        rank), one 8-byte allreduce adds the sums (``Max`` for the infinity norm).

        Returns:
            The total norm of the averaged gradients before clipping (a float64 tensor).
        """
        if not self._synchronized:
            self.synchronize()
        gradients = [s.grad for s in self.shards if s.grad is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in gradients if g.numel()), default=0.0)
        else:
            local = sum(float(g.double().abs().pow(norm_type).sum()) for g in gradients)
        total, coefficient = clip_coefficient(local, max_norm, norm_type, self.process_set)
        if coefficient < 1.0:
            for gradient in gradients:
                gradient.mul_(coefficient)
        return torch.tensor(total, dtype=torch.float64)

    # State.
    def state_dict(self, consolidate: bool | None = None,  # type: ignore[override]
                   to_rank: int = 0) -> dict[str, Any] | None:
        """The optimizer's state.

        Args:
            consolidate: True: the whole state, as an unsharded torch optimizer of the
                same parameters would save it, on ``to_rank`` (None on the other ranks);
                collective: every rank of the process set must call it. False: this
                rank's shard (no communication). None (default): the consolidated state
                :meth:`consolidate_state_dict` left on this rank if no step came since,
                else the shard.
            to_rank: the rank (in the process set) that receives the consolidated state.
        """
        if consolidate:
            return consolidated_state_dict(self, self._check_rank(to_rank))
        if consolidate is None and self._consolidated is not None:
            return self._consolidated
        return shard_state_dict(self)

    def consolidate_state_dict(self, to_rank: int = 0) -> None:
        """Gather the whole state onto ``to_rank``, where the next ``state_dict()`` returns
        it until the next ``step()``; collective. Call it on every rank before code that
        calls ``state_dict()`` on one rank only, e.g. ``ringtrain.elastic.State.commit()``."""
        self._consolidated = consolidated_state_dict(self, self._check_rank(to_rank))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a consolidated state (any number of ranks saved it; a plain torch
        optimizer's ``state_dict()`` of the same parameters too) or this rank's shard.

        Raises:
            InvalidArgumentError: another rank's or partition's shard, or a state that
                does not fit the parameters; nothing is loaded.
        """
        load_state_dict(self, state_dict)
        self._consolidated = None

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (the wrapper stops working)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        masters = ", float32 master weights" if self.master_weights else ""
        return (f"TorchShardedOptimizer(stage {self.stage}, rank {self.shard_rank} of "
                f"{self.shard_size}: {self.partition.elements(self.shard_rank)} of "
                f"{self.partition.total} elements in {len(self.pieces)} pieces{masters}, "
                f"{self.optimizer!r})")

    def __getstate__(self) -> Any:
        raise TypeError("a ShardedOptimizer cannot be pickled; save state_dict() instead")

    # Internals.
    def _rebuild_groups(self) -> list[list[int]]:
        """Put this rank's pieces in place of the parameters in the wrapped optimizer's
        groups; returns the piece positions of each group."""
        group_of = {id(p): g for g, params in enumerate(self.group_parameters) for p in params}
        positions: list[list[int]] = [[] for _ in self.group_parameters]
        for position, piece in enumerate(self.pieces):
            positions[group_of[id(self.parameters[piece.parameter])]].append(position)
        for group, owned in zip(self.optimizer.param_groups, positions):
            group["params"] = [self.shards[p] for p in owned]
        self.optimizer.state.clear()
        return positions

    def _register_hooks(self, index: int, parameter: torch.Tensor) -> list[Any]:
        def before_accumulation(gradient: torch.Tensor) -> None:
            if self._passes[index] >= self.backward_passes_per_step:
                raise UsageError(
                    f"rank {self.shard_rank}: gradient {self.parameter_names[index]!r} was "
                    f"computed {self._passes[index] + 1} times before step() or "
                    f"synchronize(), but backward_passes_per_step is "
                    f"{self.backward_passes_per_step}")

        def after_accumulation(parameter: torch.Tensor) -> None:
            self._mark_ready(index)

        return [parameter.register_hook(before_accumulation),
                parameter.register_post_accumulate_grad_hook(after_accumulation)]

    def _mark_ready(self, index: int) -> None:
        with self._lock:
            self._started = True
            self._synchronized = False
            self._passes[index] += 1
            if self._passes[index] < self.backward_passes_per_step:
                return
            bucket = self.partition.bucket_of[index]
            self._missing[bucket] -= 1
            if bucket == self._next_launch and not self._missing[bucket]:
                self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        buckets = self.partition.buckets
        while self._next_launch < len(buckets) and not self._missing[self._next_launch]:
            bucket = buckets[self._next_launch]
            first = self.parameters[bucket.members[0]]
            alone = first.grad if len(bucket.members) == 1 else None
            if alone is not None and alone.is_contiguous():
                # Reduce-scattered where it lies: the collective only reads its input.
                buffer = alone.detach().view(-1)
                if self.stage == 2:
                    first.grad = None
                self._launch(bucket, buffer)
                continue
            buffer = torch.empty(bucket.total, dtype=first.dtype, device=first.device)
            for member, offset in zip(bucket.members, bucket.offsets):
                parameter = self.parameters[member]
                target = buffer[offset:offset + parameter.numel()]
                if parameter.grad is None:
                    target.zero_()
                else:
                    target.copy_(parameter.grad.detach().reshape(-1))
                    if self.stage == 2:
                        parameter.grad = None
            self._launch(bucket, buffer)

    def _launch(self, bucket: ShardBucket, buffer: torch.Tensor) -> None:
        kept = self._kept[bucket.index]
        if kept is not None:
            buffer = kept.pack(buffer)
        handle = reducescatter_async(buffer, op=Average, name=self._name_of(bucket),
                                     prescale_factor=self._launch_prescale(),
                                     process_set=self.process_set,
                                     compression=self.compression,
                                     splits=None if kept is None else kept.splits)
        self._launched.append((bucket.index, handle))
        self._next_launch += 1

    def _name_of(self, bucket: ShardBucket) -> str:
        """The name ``bucket``'s collectives carry (with the digest of its kept elements
        where masks apply)."""
        kept = self._kept[bucket.index]
        return bucket.name if kept is None else kept.name

    def _round_masters_into_model(self) -> None:
        with torch.no_grad():
            for shard, view in zip(self.shards, self.views):
                if shard is not view:
                    view.copy_(shard)

    def _gather_parameters(self) -> None:
        """Allgather every bucket's updated chunks into the parameters, two buckets in
        flight at a time (so at most two buckets' gathered copies exist at once)."""
        buckets = self.partition.buckets
        handles: list[Any] = []

        def launch(index: int) -> None:
            bucket = buckets[index]
            owned = [self.views[p] for p in self._pieces_of_bucket[index]]
            if owned:
                chunk = owned[0] if len(owned) == 1 else torch.cat(owned)
            else:
                first = self.parameters[bucket.members[0]]
                chunk = torch.empty(0, dtype=first.dtype, device=first.device)
            kept = self._kept[index]
            handles.append(allgather_async(chunk if kept is None else kept.own(chunk),
                                           name=f"{self._name_of(bucket)} parameters",
                                           process_set=self.process_set))

        if buckets:
            launch(0)
        for index, bucket in enumerate(buckets):
            if index + 1 < len(buckets):
                launch(index + 1)
            flat = synchronize(handles[index])
            handles[index] = None
            kept = self._kept[index]
            if kept is not None:
                kept.write(flat, [self.parameters[m] for m in bucket.members])
                continue
            for member, offset in zip(bucket.members, bucket.offsets):
                parameter = self.parameters[member]
                parameter.detach().view(-1).copy_(flat[offset:offset + parameter.numel()])


def _master_of(view: torch.Tensor) -> torch.Tensor:
    """A float32 copy of a 16-bit piece (its values are taken at the first step)."""
    return torch.empty(view.shape, dtype=torch.float32, device=view.device)


def _spec(name: str, parameter: torch.Tensor, shard_rank: int) -> GradientSpec:
    """What the partition needs of a parameter, after checking it can be sharded."""
    if parameter.device.type not in ("cpu", "cuda") or parameter.dtype not in _FLOATING:
        raise UnsupportedDtypeError(
            f"rank {shard_rank}: ShardedOptimizer parameter {name!r} is {parameter.dtype} "
            f"on {parameter.device}; it shards float32, float64, float16 and bfloat16 "
            f"parameters on the CPU or a CUDA device")
    if not parameter.is_contiguous():
        raise InvalidArgumentError(
            f"rank {shard_rank}: ShardedOptimizer parameter {name!r} (shape "
            f"{tuple(parameter.shape)}) is not contiguous; its pieces are views of its "
            f"memory")
    return GradientSpec(name, tuple(int(n) for n in parameter.shape),
                        numpy_dtype(parameter.dtype))
