"""The caller's arrays and the collectives' buffers: numpy arrays, and torch CPU tensors.

The collectives work on numpy arrays. A torch CPU tensor is used through a numpy view
of its memory (no copy); results come back as torch tensors over the collectives' numpy
results (no copy either), and an in-place call returns the caller's own tensor. torch
is never imported here: a tensor can only exist once the caller has imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .errors import UnsupportedDtypeError, subject

Restore = Callable[[Any], Any]


def is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (torch already imported by the caller)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def torch_view(tensor: Any, collective: str, name: str | None) -> np.ndarray:
    """A numpy array over a torch CPU tensor's memory.

    Raises:
        UnsupportedDtypeError: a tensor on a GPU, or of a dtype numpy lacks (bfloat16).
    """
    if tensor.device.type != "cpu":
        raise UnsupportedDtypeError(
            f"{subject(collective, name)}: the tensor is on {tensor.device}; the "
            f"collectives take CPU tensors (DistributedOptimizer reduces CUDA gradients "
            f"through host memory)")
    try:
        return tensor.detach().numpy()
    except TypeError:
        raise UnsupportedDtypeError(
            f"{subject(collective, name)}: dtype {tensor.dtype} is not supported") from None


def results_like(tensor: Any) -> Restore | None:
    """How an out-of-place call returns its results to a caller who passed ``tensor``
    (or a list of them): None for numpy, torch tensors for torch."""
    first = tensor[0] if isinstance(tensor, Sequence) and len(tensor) else tensor
    return _as_torch if is_torch_tensor(first) else None


def returns_itself(tensor: Any) -> Restore | None:
    """How an in-place call returns: the caller's own tensor (or list of them)."""
    first = tensor[0] if isinstance(tensor, Sequence) and len(tensor) else tensor
    if not is_torch_tensor(first):
        return None
    same = list(tensor) if isinstance(tensor, Sequence) else tensor
    return lambda _: same


def _as_torch(result: Any) -> Any:
    if isinstance(result, np.ndarray):
        return sys.modules["torch"].from_numpy(result)
    if isinstance(result, (list, tuple)):
        return type(result)(_as_torch(item) for item in result)
    return result
