"""Horovod's ``DistributedOptimizer`` on ringtrain's trainer.

The returned optimizer is ringtrain's
:class:`~ringtrain.trainer.torch_optimizer.TorchDistributedOptimizer` (gradients
reduced in fusion buckets while backward runs) with Horovod's arguments translated,
Horovod's error types and warning text, and Horovod's attributes (``_parameter_names``,
``op``, ...). Like Horovod's, its class derives from the wrapped optimizer's class, so
``isinstance(optimizer, torch.optim.SGD)`` still holds.

What differs from Horovod (see docs/horovod.md):

* ``groups``/``num_groups`` are checked and accepted, but ringtrain forms its fusion
  buckets by size, whatever the grouping.
* Sparse gradients travel densified in their bucket, with or without
  ``sparse_as_dense``, and come back sparse (the rows that are non-zero after the
  reduction).
* ``op=Adasum`` steps the wrapped optimizer locally and combines the ranks' parameter
  changes with ringtrain's Adasum allreduce, one grouped allreduce for all parameters
  (each parameter with its own coefficients, as Horovod's per-parameter allreduces).
* A custom compressor must say which ringtrain compressor its buckets use, in a
  ``wire`` attribute.
* ``balance=`` (not Horovod's) takes a :class:`~ringtrain.trainer.balance.LoadBalancer`:
  each rank's gradient is weighted by the samples it trained, as ringtrain's own
  DistributedOptimizer does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ... import collectives
from ...collectives.errors import UsageError
from ...kernels.compression import Compressor as WireCompressor
from .._names import repeated_names
from ..balance import LoadBalancer
from ..torch_optimizer import TorchDistributedOptimizer
from ._adasum import check_adasum
from ._operations import grouped_allreduce_now
from .compression import Compression, Compressor
from .mpi_ops import Adasum, Average, ProcessSet, global_process_set

_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). The gradients are already reduced and are used as they are; "
    "use 'with optimizer.skip_synchronize(): optimizer.step()' after synchronize()")


class HorovodAssertionError(UsageError, AssertionError):
    """An API used in an order that cannot work; an AssertionError, as in Horovod."""


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | list[list[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         balance: LoadBalancer | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients reduced across ranks (Horovod's
    ``hvd.DistributedOptimizer``, on ringtrain's ``DistributedOptimizer``).

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap.
        named_parameters: ``model.named_parameters()``; names must be unique and cover
            every parameter of ``optimizer`` (default: ``allreduce.noname.<group>.<i>``).
        compression: ``Compression.none`` or ``Compression.fp16``.
        backward_passes_per_step: backward passes accumulated locally per step.
        op: ``Average``, ``Sum`` (or ``Min``, ``Max``, ``Product``), or ``Adasum``.
        gradient_predivide_factor: with Average, divide by this before the sum and by
            ``size / factor`` after it.
        num_groups: deprecated spelling of an integer ``groups``.
        groups: Horovod's explicit fusion groups (an int, or lists of parameters):
            checked, then left to ringtrain's size-based buckets.
        sparse_as_dense: accepted; sparse gradients always travel densified.
        process_set: the ranks that share the model; on other ranks ``step()`` is local.
        balance: ringtrain's :class:`~ringtrain.trainer.balance.LoadBalancer` (not a
            Horovod argument): each rank's gradient is weighted by the samples it
            trained, so that the average is the mean over the global batch whatever the
            shares; steps are timed for the balancer and its ``step()`` called.

    Returns:
        The wrapping optimizer, an instance of ``type(optimizer)``.

    Raises:
        ValueError: bad arguments, duplicate or missing parameter names, a custom
            compressor without a ``wire`` attribute, ``balance`` with ``op=Adasum``.
    """
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in v0.23.0.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    _check_groups(groups)
    if balance is not None and op is Adasum:
        raise ValueError("balance= weights each rank's gradient by its samples before a "
                         "sum; Adasum combines parameter changes: use op=Average")
    named = _horovod_names(optimizer, named_parameters)
    if op is Adasum and collectives.size() > 1:
        check_adasum([p for _, p in named])
    base = _AdasumOptimizer if op is Adasum else _HorovodOptimizer
    cls = _subclass_of(base, type(optimizer))
    return cls(optimizer, named, compression, backward_passes_per_step, op,
               gradient_predivide_factor, sparse_as_dense, process_set, balance)


class _HorovodOptimizer(TorchDistributedOptimizer):
    """ringtrain's TorchDistributedOptimizer with Horovod's behaviour on top."""

    _step_after_synchronize = _STEP_AFTER_SYNCHRONIZE

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: list[tuple[str, torch.Tensor]],
                 compression: Any, backward_passes_per_step: int, op: Any,
                 gradient_predivide_factor: float, sparse_as_dense: bool,
                 process_set: ProcessSet, balance: LoadBalancer | None = None):
        self._included = process_set is None or process_set.included()
        self._parameter_names = {p: name for name, p in named_parameters}
        self._compression = compression
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._densified: dict[int, tuple[torch.Tensor, int]] = {}
        # A rank outside the process set never communicates: its reducer (unused) is
        # planned over all ranks, which needs no communication.
        super().__init__(optimizer, named_parameters, _wire(compression),
                         backward_passes_per_step, _ringtrain_op(op), gradient_predivide_factor,
                         process_set if self._included else None, balance=balance)

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes accumulated locally before gradients are reduced."""
        return self._reducer.backward_passes_per_step

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes: int) -> None:
        self.set_backward_passes_per_step(passes)

    def synchronize(self) -> None:
        """Wait until every gradient holds the value reduced across ranks."""
        if not self._included:
            self._synchronized = True
            return
        try:
            super().synchronize()
        finally:
            self._restore_sparse()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad()``.

        Raises:
            HorovodAssertionError: called after ``backward()`` and before ``step()`` or
                ``synchronize()``.
        """
        try:
            super().zero_grad(set_to_none)
        except UsageError as error:
            raise HorovodAssertionError(str(error)) from None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict()``."""
        self._synchronized = False
        super().load_state_dict(state_dict)

    def _register_hooks(self, index: int, parameter: torch.Tensor) -> list[Any]:
        if not self._included:
            return []
        reducer = self._reducer

        def before_accumulation(gradient: torch.Tensor) -> None:
            try:
                reducer.check_accumulation(index)
            except UsageError as error:
                raise HorovodAssertionError(str(error)) from None

        def after_accumulation(parameter: torch.Tensor) -> None:
            reducer.mark_ready(index, self._dense(index, parameter.grad))

        return [parameter.register_hook(before_accumulation),
                parameter.register_post_accumulate_grad_hook(after_accumulation)]

    def _missing(self, index: int) -> Any:
        gradient = self._parameters[index][1].grad
        if gradient is not None and gradient.is_sparse:
            return self._dense(index, gradient)
        return super()._missing(index)

    def _synchronized_closure(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        run = super()._synchronized_closure(closure)

        def run_and_restore() -> Any:
            try:
                return run()
            finally:
                self._restore_sparse()

        return run_and_restore

    def _dense(self, index: int, gradient: torch.Tensor) -> torch.Tensor:
        """The gradient the bucket reduces: a sparse one as a dense copy, kept to be
        turned back after the reduction."""
        if not gradient.is_sparse:
            return gradient
        dense = gradient.to_dense()
        self._densified[index] = (dense, gradient.sparse_dim())
        return dense

    def _restore_sparse(self) -> None:
        """Give the parameters whose gradient was sparse their reduced gradient, sparse."""
        for index, (dense, sparse_dim) in self._densified.items():
            self._parameters[index][1].grad = dense.to_sparse(sparse_dim)
        self._densified.clear()


class _AdasumOptimizer(_HorovodOptimizer):
    """``op=Adasum``: each rank steps the wrapped optimizer with its own gradients; the
    parameter changes are then combined across ranks with Adasum and applied everywhere.

    Gradients are not reduced (no hooks); ``synchronize()`` does nothing.
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: list[tuple[str, torch.Tensor]],
                 compression: Any, backward_passes_per_step: int, op: Any,
                 gradient_predivide_factor: float, sparse_as_dense: bool,
                 process_set: ProcessSet, balance: LoadBalancer | None = None):
        super().__init__(optimizer, named_parameters, Compression.none,
                         backward_passes_per_step, Average, gradient_predivide_factor,
                         sparse_as_dense, process_set)
        self._compression = compression
        self.op = op

    def synchronize(self) -> None:
        """Nothing to wait for: Adasum combines parameter changes in ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Not supported with Adasum.

        Raises:
            HorovodAssertionError: always.
        """
        raise HorovodAssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (if any), step the wrapped optimizer on this rank's gradients,
        then replace each parameter's change by the Adasum of all ranks' changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        parameters = [p for _, p in self._parameters]
        with torch.no_grad():
            starts = [p.detach().clone() for p in parameters]
            self.optimizer.step()
            if self._included:
                deltas = [p - start for p, start in zip(parameters, starts)]
                for p, start, delta in zip(parameters, starts, self._adasum(deltas)):
                    p.copy_(start + delta)
        return loss

    def _register_hooks(self, index: int, parameter: torch.Tensor) -> list[Any]:
        return []

    def _adasum(self, deltas: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's ``deltas`` combined per tensor with Adasum (compressed as
        Horovod's Adasum optimizer does), in one grouped allreduce."""
        if not deltas:
            return []
        wires, contexts = zip(*[self._compression.compress(d) for d in deltas])
        combined = grouped_allreduce_now(list(wires), "adasum.deltas", Adasum, 1.0, 1.0,
                                         self.process_set)
        return [self._compression.decompress(c, context).to(d)
                for c, context, d in zip(combined, contexts, deltas)]


def _horovod_names(optimizer: torch.optim.Optimizer,
                   named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                   ) -> list[tuple[str, torch.Tensor]]:
    """``named_parameters`` as a list, checked as Horovod does; Horovod's default names
    without it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    if named_parameters is None:
        return [(f"allreduce.noname.{g}.{i}", p)
                for g, group in enumerate(optimizer.param_groups)
                for i, p in enumerate(group["params"])]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    # Checked before anything needs ringtrain initialized, as Horovod does.
    names = [name for name, _ in named]
    repeated = sorted(repeated_names(names))
    if repeated:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(repeated)}")
    named_ids = {id(p) for _, p in named}
    unnamed = [p for group in optimizer.param_groups for p in group["params"]
               if id(p) not in named_ids]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} parameter(s) "
                         f"of the optimizer were not named (shapes "
                         f"{', '.join(str(tuple(p.shape)) for p in unnamed[:5])})")
    return named


def _check_groups(groups: int | list[list[torch.Tensor]] | None) -> None:
    if groups is None:
        return
    if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         "torch.Tensor.")
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for parameter in group:
                if not isinstance(parameter, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(parameter) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(parameter))


def _wire(compression: Any) -> WireCompressor:
    """The ringtrain compressor for Horovod's ``compression`` (a ringtrain one passes)."""
    if isinstance(compression, WireCompressor):
        return compression
    cls = compression if isinstance(compression, type) else type(compression)
    wire = getattr(cls, "wire", None)
    builtin = cls in (Compression.none, Compression.fp16, Compressor)
    if isinstance(wire, WireCompressor) and (builtin or "wire" in vars(cls)):
        return wire
    raise ValueError(
        f"compression={cls.__name__}: DistributedOptimizer "
        f"reduces gradients in fusion buckets with ringtrain's compressors; use "
        f"Compression.none or Compression.fp16, or give the class a 'wire' attribute naming "
        f"the ringtrain compressor to use (e.g. ringtrain.Compression.bf16)")


def _ringtrain_op(op: Any) -> Any:
    """ringtrain's reduction for Horovod's op constant."""
    if isinstance(op, collectives.ReduceOp):
        return op
    for candidate in collectives.ReduceOp:
        if getattr(op, "name", op) == candidate.name or op == candidate.value:
            return candidate
    raise ValueError(f"op must be Average, Sum, Min, Max, Product or Adasum, got {op!r}")


def _subclass_of(base: type, optimizer_class: type) -> type:
    """A class deriving from ``base`` and the wrapped optimizer's class (named after it)."""
    try:
        return type(optimizer_class.__name__, (base, optimizer_class),
                    {"__module__": base.__module__, "__doc__": base.__doc__})
    except TypeError:  # a layout or metaclass conflict: fall back to the plain wrapper
        return base
