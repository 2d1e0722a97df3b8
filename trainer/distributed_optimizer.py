"""``DistributedOptimizer``: one entry point for PyTorch optimizers and optimizers over arrays."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from ..collectives import Average, Compression, Compressor, ProcessSet, ReduceOp
from ..collectives.errors import InvalidArgumentError
from .balance import LoadBalancer


def DistributedOptimizer(optimizer: Any, named_parameters: Iterable[tuple] | None = None,
                         compression: Compressor = Compression.none,
                         backward_passes_per_step: int = 1, op: ReduceOp = Average,
                         gradient_predivide_factor: float = 1.0,
                         process_set: ProcessSet | None = None, *,
                         fusion_threshold: int | None = None,
                         first_bucket_bytes: int = 1 << 20,
                         master_weights: bool = False, balance: LoadBalancer | None = None) -> Any:
    """Wrap ``optimizer`` so that its ``step()`` uses gradients averaged across ranks.

    A ``torch.optim.Optimizer`` gets a
    :class:`~ringtrain.trainer.torch_optimizer.TorchDistributedOptimizer` (gradients
    reduced by autograd hooks while backward runs); any other object with ``step()``
    gets an :class:`~ringtrain.trainer.array_optimizer.ArrayDistributedOptimizer` (numpy
    training loops; see that module for the protocol).

    Args:
        optimizer: the optimizer to wrap.
        named_parameters: for PyTorch, ``model.named_parameters()`` (optional but
            recommended: names in errors, the model's order for the buckets); for
            arrays, ``(name, parameter, gradient)`` triples (required).
        compression: ``Compression.none`` (default), ``.fp16`` or ``.bf16``.
        backward_passes_per_step: local backward passes accumulated per step.
        op: Average (default), Sum, Min, Max or Product.
        gradient_predivide_factor: with Average, the share of the division done before
            the sum.
        process_set: the ranks that share the model (default: all).
        fusion_threshold: bucket size limit in bytes; 0 turns fusion off.
        first_bucket_bytes: the first bucket's limit.
        master_weights: PyTorch only: the wrapped optimizer steps float32 copies of the
            float16 and bfloat16 parameters, rounded into the model after each step
            (see :mod:`~ringtrain.trainer.master_weights`).
        balance: a :class:`~ringtrain.trainer.balance.LoadBalancer`: each rank's
            gradient is weighted by the samples it trained, so that the average is the
            mean over the global batch whatever the shares; the optimizer times its
            steps for the balancer and calls its ``step()`` (op Average or Sum only).

    Returns:
        The wrapped optimizer: ``step()``, ``zero_grad()``, ``synchronize()``,
        ``skip_synchronize()``, ``state_dict()``... as the wrapped one's.

    Raises:
        InvalidArgumentError: bad arguments, duplicate or missing names,
            ``master_weights=True`` for an optimizer that is not PyTorch's, a
            ``balance`` with another op or process set.
        UnsupportedDtypeError: a parameter that cannot be reduced.
    """
    arguments = dict(named_parameters=named_parameters, compression=compression,
                     backward_passes_per_step=backward_passes_per_step, op=op,
                     gradient_predivide_factor=gradient_predivide_factor,
                     process_set=process_set, fusion_threshold=fusion_threshold,
                     first_bucket_bytes=first_bucket_bytes, balance=balance)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(optimizer, torch.optim.Optimizer):
        from .torch_optimizer import TorchDistributedOptimizer
        return TorchDistributedOptimizer(optimizer, **arguments, master_weights=master_weights)
    refuse_master_weights(master_weights, optimizer)
    from .array_optimizer import ArrayDistributedOptimizer
    return ArrayDistributedOptimizer(optimizer, **arguments)


def refuse_master_weights(master_weights: Any, optimizer: Any) -> None:
    """Raise unless ``master_weights`` is False: only a torch optimizer's parameters can be
    replaced by float32 copies.

    Raises:
        InvalidArgumentError: ``master_weights`` other than False.
    """
    if master_weights is not False:
        raise InvalidArgumentError(
            f"master_weights={master_weights!r} needs a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}: an optimizer over arrays steps the arrays it "
            f"was built with; build it over float32 copies of your parameters instead")
