"""Pipeline-parallel training for PyTorch, with data parallelism across pipelines.

With ``np = stages × replicas`` ranks, consecutive ranks form a pipeline (rank ``r`` is
stage ``r % stages`` of pipeline ``r // stages``), and the ranks holding the same stage
in every pipeline form its data-parallel group. Each rank builds only its own stage.
A training step splits the rank's batch into micro-batches, runs them through the
stages with the GPipe or 1F1B schedule (:mod:`.pipeline_schedule`), passing activations
forward and gradients backward as point-to-point tensors within the pipeline's process
set, computes the loss on the last stage and accumulates the gradients over the
micro-batches. With replicas, each stage's gradients are averaged across its group by a
:func:`~ringtrain.DistributedOptimizer` (its buckets are reduced while the last
micro-batch's backward still runs), then every stage's optimizer steps.

The step's loss is the mean over the micro-batches, weighted by their sizes (the loss
function returns a micro-batch's mean), averaged over the replicas: with equal batches
per replica, the loss of the global batch, and the gradients are its gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..collectives import (ProcessSet, Sum, add_process_set, allgather_object, allreduce,
                           global_process_set, irecv, isend, rank, size, synchronize)
from ..collectives.errors import InvalidArgumentError, UsageError
from .distributed_optimizer import DistributedOptimizer
from .pipeline_schedule import FORWARD, SCHEDULES, schedule
from .pipeline_split import automatic_split, check_split_points
from .state_broadcast import broadcast_parameters

ACTIVATION_TAG, GRADIENT_TAG = 0, 1

StageSpec = torch.nn.Module | Callable[[], torch.nn.Module]


class PipelineLayout:
    """Which stage and pipeline this rank is in, and the process sets of both.

    Attributes:
        stages, replicas: the pipeline's depth and the number of pipelines.
        stage, replica: this rank's stage and pipeline.
        pipeline_ranks: the world ranks of this rank's pipeline, stage by stage.
        replica_ranks: the world ranks holding this rank's stage, pipeline by pipeline.
        pipeline: the process set of ``pipeline_ranks`` (messages travel in it).
        replica_set: the process set of ``replica_ranks`` (gradients are averaged in it).
    """

    def __init__(self, stages: int):
        world = size()
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 \
                or world % stages:
            raise InvalidArgumentError(
                f"pipeline: {stages!r} stages do not divide the {world} ranks (np must be "
                f"stages × replicas)")
        self.stages, self.replicas = stages, world // stages
        me = rank()
        self.stage, self.replica = me % stages, me // stages
        self.pipeline_ranks = [self.replica * stages + s for s in range(stages)]
        self.replica_ranks = [r * stages + self.stage for r in range(self.replicas)]
        # Every rank registers every set, in the same order (process sets are collective).
        pipelines = [_process_set([r * stages + s for s in range(stages)])
                     for r in range(self.replicas)]
        groups = [_process_set([r * stages + s for r in range(self.replicas)])
                  for s in range(stages)]
        self.pipeline = pipelines[self.replica]
        self.replica_set = groups[self.stage]

    @property
    def first(self) -> bool:
        """Whether this rank is its pipeline's first stage."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank is its pipeline's last stage."""
        return self.stage == self.stages - 1


_PROCESS_SETS: dict[tuple[int, ...], ProcessSet] = {}
"""The process sets of the layouts made so far, by ranks: trainers built one after the
other reuse them instead of building new communicators each time."""


def _process_set(ranks: list[int]) -> ProcessSet:
    if len(ranks) == size():
        return global_process_set
    known = _PROCESS_SETS.setdefault(tuple(ranks), ProcessSet(ranks))
    return add_process_set(known)  # builds its communicator again after a new init


class PipelineTrainer:
    """Trains a model split into stages across the ranks of a pipeline (and replicas).

    Args:
        model: the stages, as a list of ``nn.Module``\\ s or of functions building one
            (only this rank's is called); or an ``nn.Sequential`` split at
            ``split_points`` (or automatically) into ``stages`` stages.
        optimizer: builds a stage's optimizer from its parameters, e.g.
            ``lambda params: torch.optim.SGD(params, lr=0.1)``.
        loss_fn: ``loss_fn(output, target)``: the mean loss of a micro-batch.
        stages: the number of stages for an ``nn.Sequential`` (default: all ranks).
        split_points: for an ``nn.Sequential``, the index of the first layer of stages 1
            to ``stages - 1``; None splits it automatically, balancing the layers'
            forward+backward time measured on ``sample`` (one micro-batch's input), or
            their parameter counts without one; the same split on every rank.
        microbatches: micro-batches per step (a rank's batch is split along its first
            dimension, sizes differing by at most one).
        schedule: ``"1f1b"`` (default: at most ``stages`` micro-batches' activations
            held) or ``"gpipe"`` (all forwards, then all backwards).
        sample: see ``split_points``.
        device: where this rank's stage runs (default: where its parameters are).
        fusion_threshold: the replicas' gradient bucket size (see DistributedOptimizer).

    Attributes:
        layout: this rank's place (:class:`PipelineLayout`).
        module: this rank's stage.
        optimizer: its optimizer (a DistributedOptimizer with replicas; None for a stage
            without parameters).
        split_points: the split of an ``nn.Sequential`` (None for a list of stages).
        peak_activations: the most micro-batches whose activations this stage held at
            once during the last step.

    Raises:
        InvalidArgumentError: stages that do not divide the ranks, a model that cannot
            be split as asked, an unknown schedule.
    """

    def __init__(self, model: Sequence[StageSpec] | torch.nn.Sequential,
                 optimizer: Callable[[Any], torch.optim.Optimizer],
                 loss_fn: Callable[[torch.Tensor, Any], torch.Tensor], *,
                 stages: int | None = None, split_points: Sequence[int] | None = None,
                 microbatches: int = 4, schedule: str = "1f1b", sample: Any = None,
                 device: Any = None, fusion_threshold: int | None = None):
        if schedule not in SCHEDULES:
            raise InvalidArgumentError(
                f"pipeline: unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) \
                or microbatches < 1:
            raise InvalidArgumentError(
                f"pipeline: microbatches must be a positive int, got {microbatches!r}")
        self.schedule, self.microbatches, self.loss_fn = schedule, microbatches, loss_fn
        self.split_points: list[int] | None = None
        if isinstance(model, torch.nn.Sequential):
            self.layout = PipelineLayout(size() if stages is None else stages)
            module = self._own_layers(model, split_points, sample)
        else:
            if split_points is not None:
                raise InvalidArgumentError(
                    "pipeline: split_points split an nn.Sequential; a list of stages is "
                    "split already")
            specs = list(model)
            if stages is not None and stages != len(specs):
                raise InvalidArgumentError(
                    f"pipeline: stages={stages} but {len(specs)} stages were given")
            self.layout = PipelineLayout(len(specs))
            own = specs[self.layout.stage]
            module = own if isinstance(own, torch.nn.Module) else own()
        if device is not None:
            module = module.to(device)
        self.module = module
        self.device = device if device is not None else _device_of(module)
        self._like = torch.empty(0, device=self.device)
        self.optimizer = self._optimizer(optimizer, fusion_threshold)
        self.peak_activations = 0
        self._output_shape: tuple[int, ...] | None = None

    def _own_layers(self, model: torch.nn.Sequential, split_points: Sequence[int] | None,
                    sample: Any) -> torch.nn.Module:
        layers = list(model)
        stages = self.layout.stages
        if split_points is None:
            chunk = None if sample is None else torch.tensor_split(
                sample, self.microbatches)[0]
            points = automatic_split(layers, stages, chunk)
        else:
            points = check_split_points(split_points, len(layers), stages)
        self.split_points = points
        bounds = [0, *points, len(layers)]
        return torch.nn.Sequential(*layers[bounds[self.layout.stage]:
                                           bounds[self.layout.stage + 1]])

    def _optimizer(self, build: Callable[[Any], torch.optim.Optimizer],
                   fusion_threshold: int | None) -> Any:
        named = list(self.module.named_parameters())
        layout = self.layout
        if layout.replicas > 1:
            broadcast_parameters(self.module.state_dict(), root_rank=layout.replica_ranks[0],
                                 process_set=layout.replica_set)
        if not named:
            return None
        optimizer = build([parameter for _, parameter in named])
        if layout.replicas == 1:
            return optimizer
        return DistributedOptimizer(optimizer, named_parameters=named,
                                    backward_passes_per_step=self.microbatches,
                                    process_set=layout.replica_set,
                                    fusion_threshold=fusion_threshold)

    # ------------------------------------------------------------------ steps

    def train_step(self, batch: Any, target: Any) -> float:
        """One step: forward and backward of every micro-batch, then each stage's
        optimizer step. Called on every rank (``batch`` is used by the first stage,
        ``target`` by the last; others may pass None).

        Returns:
            The step's loss (the mean over this pipeline's batch, averaged over the
            replicas), on every rank.

        Raises:
            UsageError: a stage's output shape changed between micro-batches (on every
                rank; no parameter was changed).
        """
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        passes = schedule(self.schedule, self.layout.stage, self.layout.stages,
                          self.microbatches)
        self.peak_activations = 0
        loss, problem = self._run(passes, batch, target, train=True)
        loss = self._agree(loss, problem)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss

    def eval(self, batch: Any, target: Any = None) -> Any:
        """Forward passes only (no gradients).

        Returns:
            With ``target``, the loss as :meth:`train_step` computes it, on every rank;
            without, the outputs of the micro-batches concatenated on the last stage
            (None on the other stages).
        """
        passes = [(FORWARD, m) for m in range(self.microbatches)]
        with torch.no_grad():
            outputs, problem = self._run(passes, batch, target, train=False)
        if target is not None:
            return self._agree(outputs, problem)
        self._agree(0.0, problem)
        return outputs

    # ------------------------------------------------------------------ the schedule

    def _run(self, passes: list[tuple[str, int]], batch: Any, target: Any,
             train: bool) -> tuple[Any, str | None]:
        layout = self.layout
        inputs = self._split(batch, "batch") if layout.first else None
        targets = self._split(target, "target") if layout.last and target is not None \
            else None
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        outputs: list[torch.Tensor] = []
        sends: list[Any] = []
        loss = 0.0
        problem: str | None = None
        for kind, m in passes:
            if kind == FORWARD:
                x = inputs[m].to(self.device) if layout.first else \
                    self._receive(layout.stage - 1, ACTIVATION_TAG, "activation")
                if train and not layout.first and x.is_floating_point():
                    x.requires_grad_(True)
                y = self.module(x)
                y, problem = self._checked(y, m, problem)
                if layout.last:
                    if targets is not None:
                        share = targets[m].shape[0] / sum(t.shape[0] for t in targets)
                        micro_loss = self.loss_fn(y, targets[m].to(self.device)) * share
                        loss += float(micro_loss.detach())
                        y = micro_loss
                    if not train:
                        outputs.append(y)
                else:
                    sends.append(self._send(y.detach(), layout.stage + 1, ACTIVATION_TAG,
                                            "activation"))
                if train:
                    held[m] = (x, y)
                    self.peak_activations = max(self.peak_activations, len(held))
            else:
                x, y = held.pop(m)
                gradient = None if layout.last else \
                    self._receive(layout.stage + 1, GRADIENT_TAG, "gradient")
                if y.requires_grad:  # not so in a stage without parameters or inputs to learn
                    y.backward(gradient)
                if not layout.first:
                    grad = x.grad if x.grad is not None else torch.zeros_like(x)
                    sends.append(self._send(grad, layout.stage - 1, GRADIENT_TAG, "gradient"))
        for handle in sends:
            synchronize(handle)
        if not train and target is None:
            return (torch.cat(outputs) if layout.last else None), problem
        return loss, problem

    def _split(self, tensor: Any, what: str) -> list[torch.Tensor]:
        if tensor is None or not hasattr(tensor, "shape") or len(tensor.shape) == 0 \
                or tensor.shape[0] < self.microbatches:
            raise InvalidArgumentError(
                f"pipeline: stage {self.layout.stage} needs a {what} tensor with at least "
                f"{self.microbatches} rows (one per micro-batch), got "
                f"{getattr(tensor, 'shape', tensor)!r}")
        return list(torch.tensor_split(tensor, self.microbatches))

    def _checked(self, y: Any, m: int, problem: str | None) -> tuple[torch.Tensor, str | None]:
        """The stage's output, checked against its first one's shape past the batch
        dimension; a changed one is replaced by zeros of the known shape (the next stage
        must not fail or wait), and the problem is reported at the end of the step."""
        if not isinstance(y, torch.Tensor):
            raise UsageError(f"pipeline: stage {self.layout.stage} returned a "
                             f"{type(y).__name__}; a stage must return one tensor")
        shape = tuple(y.shape[1:])
        if self._output_shape is None:
            self._output_shape = shape
        elif shape != self._output_shape:
            problem = problem or (
                f"pipeline: stage {self.layout.stage} (rank {rank()}) output shape changed "
                f"between micro-batches: (batch, {', '.join(map(str, self._output_shape))})"
                f" before, {tuple(y.shape)} at micro-batch {m}")
            y = torch.zeros((y.shape[0] if y.dim() else 1, *self._output_shape),
                            dtype=y.dtype, device=y.device, requires_grad=y.requires_grad)
        return y, problem

    def _send(self, tensor: torch.Tensor, stage: int, tag: int, name: str) -> Any:
        return isend(tensor.contiguous(), self.layout.pipeline_ranks[stage], tag=tag,
                     name=name, process_set=self.layout.pipeline)

    def _receive(self, stage: int, tag: int, name: str) -> torch.Tensor:
        return synchronize(irecv(None, self.layout.pipeline_ranks[stage], tag=tag, name=name,
                                 process_set=self.layout.pipeline, like=self._like))

    def _agree(self, loss: float, problem: str | None) -> float:
        """The loss averaged over the replicas' last stages, on every rank; raises on
        every rank when a stage reported a problem (its gradients are dropped)."""
        layout = self.layout
        mine = [loss if layout.last else 0.0, 0.0 if problem is None else 1.0]
        total = allreduce(torch.tensor(mine, dtype=torch.float64), op=Sum,
                          name="pipeline step")
        if total[1] > 0:
            if self.optimizer is not None:
                if layout.replicas > 1:
                    self.optimizer.synchronize()
                self.optimizer.zero_grad()
            problems = [p for p in allgather_object(problem) if p is not None]
            raise UsageError("; ".join(problems))
        return float(total[0]) / layout.replicas


def _device_of(module: torch.nn.Module) -> torch.device:
    for parameter in module.parameters():
        return parameter.device
    return torch.device("cpu")

