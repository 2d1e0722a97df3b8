"""Gradual pruning of a PyTorch model in data-parallel training: the same masks on every rank.

A :class:`Pruner` puts ``torch.nn.utils.prune``'s reparametrization on the weights it
prunes when it is built (``weight_orig``, the ``weight_mask`` buffer, the forward
pre-hook), with masks of ones, so a pruned model looks the same to user code, to torch
tools and to ``state_dict()`` from the first step to the last, on every rank. Called
once per training step, after ``optimizer.step()``, it recomputes the masks when its
:class:`~ringtrain.trainer.pruning_schedule.GradualSchedule` says so::

    import ringtrain as rt
    from ringtrain import pruning

    optimizer = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9),
                                        named_parameters=model.named_parameters())
    pruner = pruning.Pruner(model, pruning.GradualSchedule(0.8, begin_step=100,
                                                           end_step=1000, frequency=50),
                            optimizer=optimizer)
    rt.broadcast_parameters(model.state_dict(), root_rank=0)   # masks included
    for x, y in batches:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        pruner.step()

Every rank computes its masks from its own weights, which data parallelism keeps
bit-identical; the ranks then compare a digest of each mask (one ``allgather_object``),
and masks that differ raise a :class:`~ringtrain.MismatchError` on every rank naming the
first layer that differs, before any mask changes. Pruned weights are zeroed in
``weight_orig`` and in every optimizer state tensor of the weight's shape (momentum,
Adam's moments; with a ShardedOptimizer, in the state and float32 copies of this rank's
pieces), after every optimizer step too, so they stay exactly zero. Handed a
``DistributedOptimizer`` or a ``ShardedOptimizer``, the pruner gives it the masks, and its
buckets carry only the gradients (and, sharded, the updated parameters) of the weights
left (see :meth:`~ringtrain.trainer.gradient_reducer.GradientReducer.set_masks` and
:meth:`~ringtrain.trainer.sharded_optimizer.TorchShardedOptimizer.set_gradient_masks`).

The masks are buffers of the model, so ``broadcast_parameters(model.state_dict())`` and
checkpoints of ``model.state_dict()`` carry them; after loading or broadcasting them,
:meth:`Pruner.refresh` hands them on (or :meth:`Pruner.broadcast` does both, step count
included). In a ``ringtrain.elastic.State``, put the pruner next to the model: its own
``state_dict()`` holds the masks and the step count, and restoring it refreshes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch.nn.utils import prune

from ..collectives import ProcessSet, allgather_object, broadcast_object
from ..collectives.errors import InvalidArgumentError, MismatchError
from .pruning_masks import check_method, compute_masks
from .pruning_schedule import GradualSchedule
from .state_broadcast import broadcast_parameters

PRUNABLE_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
"""The layers whose ``weight`` a :class:`Pruner` prunes unless told which parameters."""

_COLLECTIVE = "prune"


class Pruner:
    """Prunes a model's weights on a schedule, with masks agreed across ranks.

    Args:
        model: the ``torch.nn.Module`` to prune (the same on every rank).
        schedule: when and how far to prune; None for :meth:`prune` calls only.
        method: ``"magnitude"`` (L1, unstructured), ``"group_l2"`` (runs of
            ``group_size`` elements along the last dimension) or ``"structured"``
            (filters / output rows, by their L``norm`` norm); see
            :mod:`~ringtrain.trainer.pruning_masks`.
        scope: ``"global"`` (one ranking over all pruned weights) or ``"layer"`` (each
            weight reaches the target sparsity on its own).
        parameters: ``(module, name)`` pairs to prune; default: the ``weight`` of every
            ``Linear`` and ``ConvNd`` in ``model``.
        group_size: the run length of ``"group_l2"``.
        norm: the p of ``"structured"`` (2 by default).
        optimizer: the (Distributed or Sharded) optimizer stepping the model: its state
            is zeroed where weights are pruned, after each of its steps too.
        process_set: the ranks that share the model (default: all).
        shrink_communication: hand the masks to a ``DistributedOptimizer`` or a
            ``ShardedOptimizer`` so that its buckets carry only the elements of unpruned
            weights (default True).

    Raises:
        InvalidArgumentError: bad arguments, parameters that are not in ``model``.
    """

    def __init__(self, model: torch.nn.Module, schedule: GradualSchedule | None = None,
                 method: str = "magnitude", scope: str = "global",
                 parameters: Iterable[tuple[torch.nn.Module, str]] | None = None, *,
                 group_size: int = 4, norm: float = 2.0, optimizer: Any = None,
                 process_set: ProcessSet | None = None, shrink_communication: bool = True):
        check_method(method, scope, group_size, norm)
        if schedule is not None and not isinstance(schedule, GradualSchedule):
            raise InvalidArgumentError(
                f"schedule must be a GradualSchedule or None, got {type(schedule).__name__}")
        self.schedule = schedule
        self.method, self.scope, self.group_size, self.norm = method, scope, group_size, norm
        self.process_set = process_set
        self.optimizer = optimizer
        self.shrink_communication = shrink_communication
        self.step_count = 0
        self._targets = _named_targets(model, parameters)
        if shrink_communication and hasattr(optimizer, "set_gradient_masks"):
            elsewhere = [path for path, module, name in self._targets
                         if getattr(module, name).device.type != "cpu"]
            if elsewhere:
                raise InvalidArgumentError(
                    f"{', '.join(elsewhere)} are not on the CPU: pruning-aware buckets reduce "
                    f"host gradients; pass shrink_communication=False")
        for _, module, name in self._targets:
            if not hasattr(module, f"{name}_mask"):
                prune.identity(module, name)
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self._zero_pruned())
        self.refresh()

    @property
    def names(self) -> list[str]:
        """The pruned weights' names, as in ``model.named_parameters()`` before pruning."""
        return [name for name, _, _ in self._targets]

    def masks(self) -> dict[str, torch.Tensor]:
        """Each pruned weight's mask (the module's ``<name>_mask`` buffer; 1: kept)."""
        return {path: getattr(module, f"{name}_mask") for path, module, name in self._targets}

    def sparsity(self) -> float:
        """The share of pruned elements over all the weights this pruner prunes."""
        masks = list(self.masks().values())
        total = sum(m.numel() for m in masks)
        kept = sum(int(torch.count_nonzero(m)) for m in masks)
        return 1.0 - kept / total if total else 0.0

    def step(self) -> bool:
        """End a training step (call after ``optimizer.step()``): prune to the schedule's
        sparsity when the schedule says so. Returns whether the masks were recomputed.

        Raises:
            MismatchError: the ranks computed different masks (see :meth:`prune`).
        """
        due = self.schedule is not None and self.schedule.prunes_at(self.step_count)
        if due:
            self.prune(self.schedule.sparsity_at(self.step_count))
        self.step_count += 1
        return due

    def prune(self, sparsity: float) -> None:
        """Recompute the masks for ``sparsity`` (pruned weights stay pruned), check on every
        rank that all ranks computed the same, then apply them.

        Raises:
            InvalidArgumentError: ``sparsity`` outside [0, 1).
            MismatchError: on every rank, when some rank's masks differ (its weights
                differed); names the first such layer and what each rank computed. No
                mask has changed then.
        """
        if not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            raise InvalidArgumentError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
        weights, previous = [], []
        for _, module, name in self._targets:
            weights.append(_numpy(getattr(module, f"{name}_orig")))
            previous.append(_numpy(getattr(module, f"{name}_mask")).astype(bool))
        masks = compute_masks(weights, previous, sparsity, self.method, self.scope,
                              self.group_size, self.norm)
        self._agree(masks)
        for (_, module, name), mask in zip(self._targets, masks):
            buffer = getattr(module, f"{name}_mask")
            buffer.copy_(torch.from_numpy(mask))
        self.refresh()

    def refresh(self) -> None:
        """Take the masks as the modules hold them now: zero the pruned weights and their
        optimizer state, and hand the masks to the DistributedOptimizer. Call it after
        loading or broadcasting masks (``broadcast_parameters(model.state_dict())``,
        ``model.load_state_dict``); :meth:`prune` and :meth:`load_state_dict` call it."""
        self._zero_pruned()
        for _, module, name in self._targets:
            # What prune's forward pre-hook computes, so that module.weight is right
            # before the next forward too.
            setattr(module, name, getattr(module, f"{name}_orig") * getattr(module, f"{name}_mask"))
        handler = getattr(self.optimizer, "set_gradient_masks", None)
        if self.shrink_communication and handler is not None:
            handler([(getattr(module, f"{name}_orig"), getattr(module, f"{name}_mask"))
                     for _, module, name in self._targets])

    def broadcast(self, root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s masks and step count (then :meth:`refresh`),
        e.g. after loading a checkpoint on the root only; every rank must call it.
        ``broadcast_parameters(model.state_dict())`` carries the masks too (they are
        buffers of the model), but not the step count.

        Raises:
            MismatchError: on every rank, when the ranks prune different weights.
        """
        self.step_count = broadcast_object(self.step_count, root_rank, name="pruning step",
                                           process_set=self.process_set)
        broadcast_parameters(self.masks(), root_rank, self.process_set)
        self.refresh()

    def state_dict(self) -> dict[str, Any]:
        """The step count and the masks (for ``ringtrain.elastic.State`` and checkpoints)."""
        return {"step_count": self.step_count,
                "masks": {path: mask.detach().cpu().clone()
                          for path, mask in self.masks().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a :meth:`state_dict`: the step count, and the masks copied into the
        modules' buffers (then :meth:`refresh`).

        Raises:
            InvalidArgumentError: masks for other weights or of other shapes.
        """
        masks = self.masks()
        saved = state["masks"]
        if set(saved) != set(masks):
            raise InvalidArgumentError(
                f"the saved masks are for {sorted(saved)}; this pruner prunes {sorted(masks)}")
        for path, mask in masks.items():
            if tuple(saved[path].shape) != tuple(mask.shape):
                raise InvalidArgumentError(
                    f"the saved mask of {path!r} has shape {tuple(saved[path].shape)}; the "
                    f"weight has {tuple(mask.shape)}")
        for path, mask in masks.items():
            mask.copy_(saved[path])
        self.step_count = int(state["step_count"])
        self.refresh()

    def _agree(self, masks: list[np.ndarray]) -> None:
        """Raise MismatchError on every rank when some rank's masks differ."""
        mine = [_describe(mask) for mask in masks]
        everyone = allgather_object(mine, name="pruning masks", process_set=self.process_set)
        ranks = range(len(everyone)) if self.process_set is None else self.process_set.ranks
        for index, (path, _, _) in enumerate(self._targets):
            seen = {rank: theirs[index] for rank, theirs in zip(ranks, everyone)}
            if len(set(seen.values())) > 1:
                others = [p for k, (p, _, _) in enumerate(self._targets)
                          if k > index and len({t[k] for t in everyone}) > 1]
                more = f" (masks of {', '.join(others)} differ too)" if others else ""
                raise MismatchError(
                    _COLLECTIVE, path, {"mask": seen},
                    hint=f"The masks were computed from weights that differ across "
                         f"ranks{more}; broadcast_parameters(model.state_dict()) before "
                         f"training keeps them equal")

    def _zero_pruned(self) -> None:
        """Zero the pruned elements of each ``weight_orig`` and of every optimizer state
        tensor of its shape (momentum, moments), or of this rank's shards of them for an
        optimizer that keeps its state in pieces (``mask_elements``: the
        ShardedOptimizer): they stay zero through later steps."""
        state = getattr(self.optimizer, "state", None) or {}
        mask_elements = getattr(self.optimizer, "mask_elements", None)
        with torch.no_grad():
            for _, module, name in self._targets:
                original = getattr(module, f"{name}_orig")
                mask = getattr(module, f"{name}_mask")
                original.mul_(mask)
                if mask_elements is not None:
                    mask_elements(original, mask)
                    continue
                for value in state.get(original, {}).values():
                    if isinstance(value, torch.Tensor) and value.shape == original.shape:
                        value.mul_(mask)

    def __repr__(self) -> str:
        return (f"Pruner({len(self._targets)} weights, method={self.method!r}, "
                f"scope={self.scope!r}, sparsity {self.sparsity():.3f}, {self.schedule})")


def _named_targets(model: torch.nn.Module,
                   parameters: Iterable[tuple[torch.nn.Module, str]] | None,
                   ) -> list[tuple[str, torch.nn.Module, str]]:
    """``(path, module, name)`` of each weight to prune, in the model's order."""
    paths = {id(module): path for path, module in model.named_modules()}
    if parameters is None:
        parameters = [(module, "weight") for module in model.modules()
                      if isinstance(module, PRUNABLE_LAYERS)]
    targets = []
    for module, name in parameters:
        if id(module) not in paths:
            raise InvalidArgumentError(
                f"a {type(module).__name__} to prune is not a module of the model")
        if not isinstance(getattr(module, f"{name}_orig", getattr(module, name, None)),
                          torch.nn.Parameter):
            raise InvalidArgumentError(
                f"{paths[id(module)] or type(module).__name__} has no parameter {name!r}")
        path = f"{paths[id(module)]}.{name}" if paths[id(module)] else name
        targets.append((path, module, name))
    if not targets:
        raise InvalidArgumentError("nothing to prune: the model has no Linear or Conv layer; "
                                   "name the weights with parameters=[(module, name), ...]")
    return targets


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A float64 (or bool) numpy copy of a tensor, wherever it lives."""
    tensor = tensor.detach()
    if tensor.dtype != torch.bool:
        tensor = tensor.to(torch.float64)
    return tensor.cpu().numpy()


def _describe(mask: np.ndarray) -> str:
    """How ranks compare a mask: pruned count and a digest of its bits."""
    digest = hashlib.blake2b(np.packbits(mask).tobytes(), digest_size=8).hexdigest()
    return f"{int(mask.size - np.count_nonzero(mask))} of {mask.size} pruned ({digest})"


__all__ = ["Pruner", "PRUNABLE_LAYERS"]
