"""Training-loop integration: DistributedOptimizer, gradient buckets, state broadcast,
data sharding, load balancing, uneven inputs, loss scaling, elastic restarts and
pipeline parallelism.

Names are imported on first use, so ``import ringtrain.trainer`` neither imports
mpi4py nor torch; the PyTorch parts import torch only when given a torch optimizer.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "DistributedOptimizer": "distributed_optimizer",
    "ArrayDistributedOptimizer": "array_optimizer",
    "GradientReducer": "gradient_reducer",
    "broadcast_parameters": "state_broadcast",
    "broadcast_optimizer_state": "state_broadcast",
    "DistributedSampler": "distributed_sampler",
    "LoadBalancer": "balance",
    "BalancedBatchSampler": "balanced_sampler",
    "join": "uneven",
    "JoinResult": "uneven",
    "DynamicLossScaler": "loss_scaling",
    "ShardedOptimizer": "sharded",
    "PipelineTrainer": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ringtrain.trainer' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
