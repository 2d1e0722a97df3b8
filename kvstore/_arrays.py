"""The store's view of the arrays it is given: host numpy arrays, summed and written back.

Values are numpy arrays (``ml_dtypes.bfloat16`` included) or torch tensors, CPU or CUDA.
The store keeps host arrays: a torch CPU tensor is read through a numpy view of its
memory (no copy), a CUDA tensor is copied to the host. In the ``device`` modes the values
of one key are summed where they live (on their GPU) before that copy, as MXNet sums on
the devices; in the others each is brought to the host and summed there.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..collectives import InvalidArgumentError, UnsupportedDtypeError
from ..collectives.engine import COPY_DTYPES, is_torch_tensor, torch_from_host, torch_view
from ._keys import Key, label

SUPPORTED_DTYPES = tuple(dtype for dtype in COPY_DTYPES if np.dtype(dtype) != np.bool_)
"""The dtypes a store holds: those the collectives reduce."""


def host_array(value: Any, key: Key, operation: str) -> np.ndarray:
    """``value`` as a host numpy array (a view where it can be), its dtype checked."""
    if is_torch_tensor(value):
        tensor = value.detach()
        array = torch_view(tensor.cpu() if tensor.device.type != "cpu" else tensor,
                           f"kvstore {operation}", str(key))
    elif isinstance(value, np.ndarray):
        array = value
    elif hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
        array = value.get()  # a CuPy array
    else:
        raise InvalidArgumentError(f"kvstore {operation} of {label(key)}: expected a numpy "
                                   f"array or a torch tensor, got {type(value).__name__}")
    if array.dtype not in SUPPORTED_DTYPES:
        raise UnsupportedDtypeError(f"kvstore {operation} of {label(key)}: dtype "
                                    f"{array.dtype} is not supported (supported: "
                                    f"{', '.join(str(d) for d in SUPPORTED_DTYPES)})")
    return array


def summed(values: Sequence[Any], key: Key, operation: str, on_device: bool) -> np.ndarray:
    """The sum of one key's values as a new host array (the value itself when alone).

    Raises:
        InvalidArgumentError: values of different shapes or dtypes.
    """
    hosts = None
    if not on_device or not all(is_torch_tensor(v) for v in values):
        hosts = [host_array(v, key, operation) for v in values]
        described = [(h.shape, h.dtype) for h in hosts]
    else:
        described = [(tuple(v.shape), v.dtype) for v in values]
    if len(set(described)) > 1:
        raise InvalidArgumentError(f"kvstore {operation} of {label(key)}: its values differ "
                                   f"in shape or dtype: {described}")
    if hosts is None:  # torch tensors summed where they are
        total = functools.reduce(operator.add, [v.detach() for v in values])
        return np.array(host_array(total, key, operation))
    total = np.array(hosts[0])
    for other in hosts[1:]:
        total += other
    return total


def write(out: Any, value: np.ndarray, key: Key, operation: str) -> None:
    """Copy host ``value`` into ``out`` (numpy array or torch tensor of its shape)."""
    shape = tuple(out.shape)
    if shape != value.shape:
        raise InvalidArgumentError(f"kvstore {operation} of {label(key)}: out has shape "
                                   f"{list(shape)}, the value {list(value.shape)}")
    if is_torch_tensor(out):
        with _no_grad():
            out.copy_(torch_from_host(np.ascontiguousarray(value)))
    elif isinstance(out, np.ndarray):
        np.copyto(out, value, casting="same_kind" if out.dtype != value.dtype else "no")
    else:
        raise InvalidArgumentError(f"kvstore {operation} of {label(key)}: out must be a numpy "
                                   f"array or a torch tensor, got {type(out).__name__}")


def _no_grad() -> Any:
    import torch
    return torch.no_grad()
