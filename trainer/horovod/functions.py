"""Horovod's state helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``,
``broadcast_object`` and ``allgather_object``, over ringtrain's own.

Tensors travel with ringtrain's :mod:`~ringtrain.trainer.state_broadcast` (each under
its name, so ranks holding different models get a MismatchError naming the tensor);
objects are serialized with cloudpickle when it is installed (as Horovod does: lambdas
and local classes travel too), else with pickle.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ... import collectives
from .. import state_broadcast
from .mpi_ops import ProcessSet, global_process_set

try:
    import cloudpickle as _pickler
except ImportError:  # installed with the 'horovod' extra
    _pickler = pickle


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int,
                         prefix: str | None = None) -> None:
    """Set every rank's tensors to ``root_rank``'s, in place (Horovod's, over ringtrain's
    :func:`~ringtrain.trainer.state_broadcast.broadcast_parameters`).

    Args:
        params: ``model.state_dict()`` (a dict: taken in sorted order),
            ``model.named_parameters()`` or a list of tensors or ``(name, tensor)`` pairs.
        root_rank: the rank whose values every rank receives.
        prefix: put before every tensor's name (names appear in errors).

    Raises:
        ValueError: ``params`` is not one of those (before any communication).
    """
    if isinstance(params, Mapping):
        named = sorted(params.items(), key=lambda item: str(item[0]))
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        named = [item if isinstance(item, tuple) else (None, item) for item in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    named = [(f"{prefix or ''}{f'parameter {i}' if name is None else name}", tensor)
             for i, (name, tensor) in enumerate(named)]
    state_broadcast.broadcast_parameters(named, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              prefix: str | None = None) -> None:
    """Give every rank ``root_rank``'s optimizer state and hyper-parameters (Horovod's, over
    ringtrain's :func:`~ringtrain.trainer.state_broadcast.broadcast_optimizer_state`).

    The root's ``state_dict()`` is loaded on the other ranks, so optimizers that never
    stepped need no initializing step first (Horovod steps them on zero gradients);
    as in Horovod, a trainable parameter without a gradient gets a zero one when this
    rank's optimizer has no state yet. L-BFGS is supported.

    Args:
        optimizer: a ``torch.optim.Optimizer`` or a DistributedOptimizer.
        root_rank: the rank whose state every rank receives.
        model: accepted for Horovod's signature (it names sparse parameters for
            Horovod's initializing step, which is not needed here).
        prefix: accepted for Horovod's signature; tensors are named by their path in the
            state dict (``"state.3.exp_avg"``).
    """
    if not optimizer.state_dict()["state"]:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.requires_grad and parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
    state_broadcast.broadcast_optimizer_state(optimizer, root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank of ``process_set`` (the root gets
    ``obj`` itself); over ringtrain's ``broadcast_object``.

    Raises:
        RuntimeError (MismatchError): on every rank, when the root cannot serialize ``obj``.
    """
    is_root = collectives.rank() == root_rank
    payload = _dumps(obj) if is_root else None
    payload = collectives.broadcast_object(payload, root_rank, name=name,
                                           process_set=process_set)
    _raise_failures("broadcast_object", name, {root_rank: payload})
    return obj if is_root else _pickler.loads(payload)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """Return the list of every rank's ``obj`` (of the ranks of ``process_set``), in rank
    order; over ringtrain's ``allgather_object``.

    Raises:
        RuntimeError (MismatchError): on every rank, when some rank cannot serialize its
            ``obj``.
    """
    payloads = collectives.allgather_object(_dumps(obj), name=name, process_set=process_set)
    _raise_failures("allgather_object", name, dict(zip(process_set.ranks, payloads)))
    return [_pickler.loads(payload) for payload in payloads]


class _SerializationFailure(str):
    """Travels in place of an object that could not be serialized: the error's text."""


def _dumps(obj: Any) -> bytes:
    try:
        return _pickler.dumps(obj)
    except Exception as error:  # every rank must learn of it, whatever it is
        return _SerializationFailure(f"{type(error).__name__}: {error}")


def _raise_failures(collective: str, name: str | None, payloads: dict[int, Any]) -> None:
    """Raise on every rank when a payload (by world rank) is a serialization failure."""
    failed = {rank: str(payload) for rank, payload in payloads.items()
              if isinstance(payload, _SerializationFailure)}
    if failed:
        raise collectives.MismatchError(collective, name, {"serialization": failed})
