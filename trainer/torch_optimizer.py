"""DistributedOptimizer for PyTorch: averages gradients across ranks while backward runs.

It wraps the user's optimizer by composition: parameter groups, state, state dicts and
step hooks are the wrapped optimizer's own, seen through this object. It derives from
``torch.optim.Optimizer`` only so that code checking ``isinstance(opt, Optimizer)``
(learning-rate schedulers, gradient scalers) accepts it; it never runs the base
class's constructor.

Each parameter gets a post-accumulate-grad hook that hands its finished gradient to a
:class:`~ringtrain.trainer.gradient_reducer.GradientReducer`, so the fusion buckets are
allreduced during the backward pass; ``step()`` waits for them, then calls the wrapped
optimizer's ``step()``. Gradients are reduced in their parameters' dtype: float32,
float64, float16 or bfloat16 (seen by the collectives as ``ml_dtypes.bfloat16``). With
``master_weights=True`` the wrapped optimizer steps float32 copies of the float16 and
bfloat16 parameters (see :mod:`~ringtrain.trainer.master_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..collectives import Average, Compression, Compressor, ProcessSet, ReduceOp
from ..collectives.engine import device_tensor, torch_view
from ..collectives.errors import InvalidArgumentError, UnsupportedDtypeError, UsageError, subject
from ._dtypes import numpy_dtype
from ._names import repeated_names
from ._synchronized import SynchronizedSteps
from .balance import LoadBalancer
from .gradient_reducer import GradientReducer, predivide_factors
from .master_weights import STATE_KEY, MasterWeights


class WrappedOptimizerView:
    """Mixin of a ``torch.optim.Optimizer`` that wraps one (``self.optimizer``): the
    wrapped optimizer's parameter groups (learning rates live there), state, defaults and
    step hooks, seen through the wrapper."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Registers ``hook`` on the wrapped optimizer."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Registers ``hook`` on the wrapped optimizer."""
        return self.optimizer.register_step_post_hook(hook)


class TorchDistributedOptimizer(WrappedOptimizerView, SynchronizedSteps, torch.optim.Optimizer):
    """Wraps a ``torch.optim.Optimizer`` so that ``step()`` uses gradients reduced across ranks.

    Args:
        optimizer: the optimizer to wrap; its parameters on the CPU or on CUDA devices
            (each bucket is packed on the GPU in one kernel launch and reduced through
            pinned host memory), float32, float64, float16 or bfloat16.
        named_parameters: ``model.named_parameters()``: names every parameter in error
            messages, and its order (the model's) decides the fusion buckets. Every
            parameter of ``optimizer`` must be named; names must be unique.
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``.
        backward_passes_per_step: backward passes (each adding to ``.grad``) between
            steps; gradients are reduced once, after the last.
        op: Average (default) or Sum (or Min, Max, Product) across ranks.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        process_set: the ranks that share the model (default: all).
        fusion_threshold: bucket size limit in bytes, 0 for one allreduce per
            parameter (default: ``RINGTRAIN_FUSION_THRESHOLD`` or 8 MiB).
        first_bucket_bytes: the first bucket's limit (default 1 MiB).
        master_weights: the wrapped optimizer steps a float32 copy of each float16 and
            bfloat16 parameter, which takes that parameter's place in its
            ``param_groups``; the averaged gradient is upcast into the copy's ``.grad``
            and the model's parameter set to the rounded copy after each step. The
            copies are part of :meth:`state_dict`. Other parameters are stepped as
            they are.
        balance: a :class:`~ringtrain.trainer.balance.LoadBalancer`: this rank's
            gradient is weighted by the samples it trained (so that the average is the
            mean over the global batch), its steps are timed, and ``step()`` calls the
            balancer's ``step()``. Needs op Average or Sum.

    Raises:
        InvalidArgumentError: duplicate or missing parameter names, bad arguments.
        UnsupportedDtypeError: a parameter dtype that cannot be reduced (e.g. float8),
            naming the rank and the parameter.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: Compressor = Compression.none,
                 backward_passes_per_step: int = 1, op: ReduceOp = Average,
                 gradient_predivide_factor: float = 1.0,
                 process_set: ProcessSet | None = None, *,
                 fusion_threshold: int | None = None,
                 first_bucket_bytes: int = 1 << 20, master_weights: bool = False,
                 balance: LoadBalancer | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(master_weights, bool):
            raise InvalidArgumentError(
                f"master_weights must be True or False, got {master_weights!r}")
        self.optimizer = optimizer
        self._parameters = named_trainable_parameters(optimizer, named_parameters)
        prescale, postscale = predivide_factors(op, gradient_predivide_factor)
        self._reducer = GradientReducer(
            [(name, _numpy_spec(name, p)) for name, p in self._parameters],
            op=op, compression=compression, prescale_factor=prescale,
            postscale_factor=postscale, process_set=process_set,
            fusion_threshold=fusion_threshold, first_bucket_bytes=first_bucket_bytes,
            backward_passes_per_step=backward_passes_per_step, as_array=_array_of)
        self._attach_balance(balance, op, process_set, "DistributedOptimizer")
        self._masters = MasterWeights(optimizer, self._parameters) if master_weights else None
        self._hooks = [hook for i, (_, p) in enumerate(self._parameters)
                       for hook in self._register_hooks(i, p)]

    def master_parameters(self) -> list[torch.Tensor]:
        """The tensors the wrapped optimizer steps, in the model's order: with
        ``master_weights=True`` the float32 copies in place of the float16/bfloat16
        parameters, otherwise (and for the other parameters) the parameters themselves.
        After :meth:`synchronize` their ``.grad`` hold the averaged gradients: clip these."""
        tensors = []
        for index, (_, parameter) in enumerate(self._parameters):
            master = None if self._masters is None else self._masters.master_of(index)
            tensors.append(parameter if master is None else master)
        return tensors

    def gradient_arrays(self) -> list[Any]:
        """The gradients the wrapped optimizer steps with, as arrays (numpy views, CUDA
        tensors; parameters without one get zeros), in order: with master weights, the
        float32 copies' gradients in place of the float16/bfloat16 ones (upcast first
        when they were not yet)."""
        if self._masters is None:
            return [_gradient_array(self._missing(i)) for i in range(len(self._parameters))]
        self._masters.gradients_for_step()
        arrays = []
        for index in range(len(self._parameters)):
            master = self._masters.master_of(index)
            if master is None:
                arrays.append(_gradient_array(self._missing(index)))
                continue
            if master.grad is None:
                master.grad = torch.zeros_like(master)
            arrays.append(_gradient_array(master.grad))
        return arrays

    def set_gradient_masks(self, masks: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
                           ) -> None:
        """Send only the gradients of unpruned elements from the next step on (pruning-aware
        buckets; :class:`~ringtrain.pruning.Pruner` calls this when its masks change).

        Args:
            masks: ``(parameter, mask)`` pairs (mask nonzero: kept; None: the whole
                gradient); parameters not given travel whole. Every rank must give the
                same masks.

        Raises:
            InvalidArgumentError: a parameter this optimizer does not reduce, a mask of
                another shape, or a masked parameter in GPU memory (pruning-aware
                buckets are for host gradients).
            UsageError: called between ``backward()`` and ``step()``.
        """
        arrays = host_masks(masks, self._parameters, "reduces")
        self._reducer.set_masks(arrays)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's ``state_dict()``; with master weights, the float32
        copies too, under ``"master_weights"`` (``{position in param_groups: tensor}``)."""
        state = self.optimizer.state_dict()
        if self._masters is not None:
            state[STATE_KEY] = self._masters.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict()``; with master weights, the float32
        copies are loaded too and rounded into the model's parameters (a state without
        them leaves the copies to be taken from the model's parameters at the next step).

        Raises:
            InvalidArgumentError: float32 copies that do not fit this optimizer's
                parameters (nothing is loaded).
        """
        if self._masters is None:
            self.optimizer.load_state_dict(state_dict)
            return
        state_dict = dict(state_dict)
        saved = state_dict.pop(STATE_KEY, None)
        self._masters.check(saved)
        self.optimizer.load_state_dict(state_dict)
        self._masters.load_state_dict(saved)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: the buckets are fixed when the optimizer is wrapped."""
        raise UsageError("add_param_group() on a DistributedOptimizer: add the group to the "
                         "optimizer before wrapping it")

    # The training step (synchronize and skip_synchronize: SynchronizedSteps).
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Synchronize (unless inside :meth:`skip_synchronize`), then step the wrapped
        optimizer. A ``closure`` that runs backward is synchronized after it runs.

        Parameters that got no gradient this step take part with zeros (their ``.grad``
        is set to zeros first). With master weights, the wrapped optimizer steps the
        float32 copies, which are then rounded into the model's parameters."""
        self._synchronize_for_step(when_idle=closure is None)
        masters = self._masters
        if masters is None:
            if closure is None:
                result = self.optimizer.step()
            else:
                result = self.optimizer.step(self._synchronized_closure(closure))
        else:
            masters.take_from_model()
            if closure is None:
                masters.gradients_for_step()
                result = self.optimizer.step()
            else:
                result = self.optimizer.step(self._synchronized_closure(closure))
            masters.end_step()
        self._balance.stepped()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad()`` (with master weights, the model's
        float16/bfloat16 parameters' gradients too); refused while gradients are in flight.

        Raises:
            UsageError: called after ``backward()`` and before ``step()`` or
                ``synchronize()`` (the reduction may be writing the gradients).
        """
        if self._reducer.in_progress():
            raise UsageError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients are being "
                "reduced in place; call zero_grad() before backward() or after step()")
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._masters is not None:
            self._masters.zero_model_gradients(set_to_none)
        self._balance.compute_started()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters (the wrapper stops working)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __repr__(self) -> str:
        masters = "" if self._masters is None else f", {self._masters!r}"
        return f"TorchDistributedOptimizer({self.optimizer!r}, {self._reducer!r}{masters})"

    def __getstate__(self) -> Any:
        raise TypeError("a DistributedOptimizer cannot be pickled; save state_dict() instead")

    def _register_hooks(self, index: int, parameter: torch.Tensor) -> list[Any]:
        """A hook before accumulation that refuses a pass too many (before ``.grad``
        changes under its reduction), and one after it that hands over the gradient."""
        reducer = self._reducer

        def before_accumulation(gradient: torch.Tensor) -> None:
            reducer.check_accumulation(index)

        def after_accumulation(parameter: torch.Tensor) -> None:
            reducer.mark_ready(index, parameter.grad)

        return [parameter.register_hook(before_accumulation),
                parameter.register_post_accumulate_grad_hook(after_accumulation)]

    def _missing(self, index: int) -> Any:
        parameter = self._parameters[index][1]
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        return parameter.grad

    def _after_synchronize(self) -> None:
        if self._masters is not None:
            self._masters.upcast_gradients()

    def _synchronized_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            if self._masters is not None:
                # The wrapped optimizer may call the closure between changes of the
                # copies (L-BFGS): the model must hold them when it runs.
                self._masters.copy_to_model()
            loss = closure()
            self._wait_for_gradients()
            return loss

        return run


def named_trainable_parameters(
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
        where: str = "",
) -> list[tuple[str, torch.Tensor]]:
    """The optimizer's parameters that need gradients, named, in the model's order.

    Raises:
        InvalidArgumentError: ``named_parameters`` repeats a name or misses a parameter
            of ``optimizer`` (the message starts with ``where``, e.g. ``"rank 2: "``).
    """
    in_optimizer = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        positions = [(g, i) for g, group in enumerate(optimizer.param_groups)
                     for i in range(len(group["params"]))]
        named = [(f"param_groups[{g}][{i}]", p) for (g, i), p in zip(positions, in_optimizer)]
    else:
        named = list(named_parameters)
        names = [name for name, _ in named]
        repeated = sorted(repeated_names(names))
        if repeated:
            raise InvalidArgumentError(
                f"{where}named_parameters repeats the name(s) "
                f"{', '.join(map(repr, repeated))}; every parameter needs a name of its own")
        named_ids = {id(p) for _, p in named}
        unnamed = [p for p in in_optimizer if id(p) not in named_ids]
        if unnamed:
            shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
            raise InvalidArgumentError(
                f"{where}{len(unnamed)} parameter(s) of the optimizer are missing from "
                f"named_parameters (shapes {shapes}{', ...' if len(unnamed) > 5 else ''}); "
                f"pass model.named_parameters() of the model the optimizer trains")
        wanted = {id(p) for p in in_optimizer}
        named = [(name, p) for name, p in named if id(p) in wanted]
    seen: set[int] = set()
    trainable = []
    for name, parameter in named:
        if parameter.requires_grad and id(parameter) not in seen:
            seen.add(id(parameter))
            trainable.append((name, parameter))
    return trainable


def _array_of(gradient: Any) -> Any:
    """What the kernels take: a numpy view of a CPU tensor (``ml_dtypes.bfloat16`` for
    bfloat16), a CUDA tensor detached (bfloat16: its memory as the collectives describe
    it, torch's own interface refusing bfloat16); arrays pass unchanged."""
    if not isinstance(gradient, torch.Tensor):
        return gradient
    gradient = gradient.detach()
    if gradient.device.type == "cpu":
        return torch_view(gradient, "allreduce_", None)
    if gradient.dtype == torch.bfloat16:
        return device_tensor(gradient, "allreduce_", None, in_place=True).memory
    return gradient


def _gradient_array(gradient: torch.Tensor) -> Any:
    """A gradient as :meth:`TorchDistributedOptimizer.gradient_arrays` gives it: a numpy
    view on the CPU, the detached tensor on a GPU."""
    gradient = gradient.detach()
    return torch_view(gradient, "allreduce_", None) if gradient.device.type == "cpu" else gradient


def _numpy_spec(name: str, parameter: torch.Tensor) -> np.ndarray:
    """An empty numpy array of the gradient's shape and dtype (what the reducer sees)."""
    if parameter.device.type not in ("cpu", "cuda"):
        raise UnsupportedDtypeError(
            f"{subject('DistributedOptimizer', name)}: the parameter is on "
            f"{parameter.device}; DistributedOptimizer reduces gradients of CPU and CUDA "
            f"parameters")
    try:
        dtype = numpy_dtype(parameter.dtype)
    except TypeError as error:
        raise UnsupportedDtypeError(
            f"{subject('DistributedOptimizer', name)}: the parameter's dtype "
            f"{parameter.dtype} cannot be reduced ({error}); use float32, float16 or "
            f"bfloat16") from None
    return np.empty(tuple(parameter.shape), dtype)


def host_masks(masks: Iterable[tuple[torch.Tensor, torch.Tensor | None]],
               named: Sequence[tuple[str, torch.Tensor]], verb: str) -> list[Any]:
    """Each of the ``named`` parameters' mask in ``masks`` as a boolean array (kept:
    True), or None where none is given; the masks checked.

    Raises:
        InvalidArgumentError: a parameter that is not one of ``named`` (the optimizer
            does not ``verb`` it), a mask of another shape, or a mask that prunes a
            parameter in GPU memory (pruning-aware buckets are for host memory).
    """
    index_of = {id(p): i for i, (_, p) in enumerate(named)}
    arrays: list[Any] = [None] * len(named)
    for parameter, mask in masks:
        index = index_of.get(id(parameter))
        if index is None:
            raise InvalidArgumentError(
                f"{subject('set_gradient_masks', None)}: a parameter of shape "
                f"{tuple(parameter.shape)} is not one this optimizer {verb}")
        if mask is None:
            continue
        name = named[index][0]
        if tuple(mask.shape) != tuple(parameter.shape):
            raise InvalidArgumentError(
                f"{subject('set_gradient_masks', name)}: the mask has shape "
                f"{tuple(mask.shape)}; the parameter has {tuple(parameter.shape)}")
        array = (mask.detach() != 0).cpu().numpy()
        if parameter.device.type != "cpu" and not array.all():
            raise InvalidArgumentError(
                f"{subject('set_gradient_masks', name)}: the parameter is on "
                f"{parameter.device}; pruning-aware buckets are for host memory")
        arrays[index] = array
    return arrays
