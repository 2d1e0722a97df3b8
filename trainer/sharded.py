"""``ShardedOptimizer``: one entry point for PyTorch optimizers and numpy training loops."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from ..collectives import Compression, Compressor, ProcessSet
from ._buckets import DEFAULT_FIRST_BUCKET_BYTES
from .balance import LoadBalancer
from .distributed_optimizer import refuse_master_weights


def ShardedOptimizer(optimizer: Any, named_parameters: Iterable[tuple] | None = None,
                     stage: int = 1, process_set: ProcessSet | None = None, *,
                     backward_passes_per_step: int = 1, fusion_threshold: int | None = None,
                     first_bucket_bytes: int = DEFAULT_FIRST_BUCKET_BYTES,
                     compression: Compressor = Compression.none,
                     master_weights: bool = False, balance: LoadBalancer | None = None) -> Any:
    """Shard the optimizer state (stage 1) and the averaged gradients (stage 2) across
    the ranks: gradients are reduce-scattered, each rank steps its shard, the updated
    parameters are allgathered (see docs/sharded.md).

    A ``torch.optim.Optimizer`` gets a
    :class:`~ringtrain.trainer.sharded_optimizer.TorchShardedOptimizer`, which rebuilds its
    ``param_groups`` over this rank's pieces of the parameters. For a numpy training loop,
    ``optimizer`` is instead a callable ``make(parameters, gradients)`` that builds the
    optimizer over this rank's pieces (dicts from parameter names to 1-D arrays; the
    parameter pieces are views of the parameters), and ``named_parameters`` the
    ``(name, parameter, gradient)`` triples of the DistributedOptimizer's numpy protocol:
    an :class:`~ringtrain.trainer.sharded_arrays.ArrayShardedOptimizer`.

    Args:
        optimizer: the torch optimizer to wrap, or the factory (numpy).
        named_parameters: ``model.named_parameters()`` (PyTorch) or the triples (numpy).
        stage: 1 or 2.
        process_set: the ranks that share the model (default: all).
        backward_passes_per_step: local backward passes accumulated per step.
        fusion_threshold: bucket size limit in bytes (0: one bucket per parameter).
        first_bucket_bytes: the first bucket's limit.
        compression: ``Compression.fp16`` or ``Compression.bf16`` reduce-scatter float32
            gradients as 16-bit floats.
        master_weights: PyTorch only: the wrapped optimizer steps float32 copies of this
            rank's pieces of the float16 and bfloat16 parameters.
        balance: a :class:`~ringtrain.trainer.balance.LoadBalancer`: each rank's
            gradients are weighted by the samples it trained, so that the average is the
            mean over the global batch whatever the shares; steps are timed for the
            balancer and its ``step()`` called.

    Raises:
        InvalidArgumentError: a stage other than 1 or 2, duplicate or missing names, a
            parameter that cannot be cut into views, ``master_weights=True`` for an
            optimizer that is not PyTorch's.
        UnsupportedDtypeError: a parameter that is not floating point.
    """
    arguments = dict(named_parameters=named_parameters, stage=stage,
                     process_set=process_set, backward_passes_per_step=backward_passes_per_step,
                     fusion_threshold=fusion_threshold, first_bucket_bytes=first_bucket_bytes,
                     compression=compression, balance=balance)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(optimizer, torch.optim.Optimizer):
        from .sharded_optimizer import TorchShardedOptimizer
        return TorchShardedOptimizer(optimizer, **arguments, master_weights=master_weights)
    refuse_master_weights(master_weights, optimizer)
    from .sharded_arrays import ArrayShardedOptimizer
    return ArrayShardedOptimizer(optimizer, **arguments)
