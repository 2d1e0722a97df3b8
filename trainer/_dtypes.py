"""torch CPU tensors as numpy arrays and back, bfloat16 included.

numpy has no bfloat16 of its own; ringtrain's is ``ml_dtypes.bfloat16``
(:data:`ringtrain.kernels.BFLOAT16`), which the collectives and kernels take like any
other dtype. A torch bfloat16 tensor is seen through its int16 view, so no data is
copied. torch is never imported here: a tensor can only exist once the caller has
imported it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..kernels import BFLOAT16


def numpy_dtype(torch_dtype: Any) -> np.dtype:
    """The numpy dtype of tensors of ``torch_dtype`` (``ml_dtypes.bfloat16`` for bfloat16).

    Raises:
        TypeError: numpy has no such dtype (float8, complex32, ...).
    """
    torch = sys.modules["torch"]
    if torch_dtype == torch.bfloat16:
        return BFLOAT16
    return torch.empty(0, dtype=torch_dtype).numpy().dtype


def host_array(tensor: Any) -> np.ndarray:
    """A numpy array over a torch CPU tensor's memory (no copy); a bfloat16 tensor as
    ``ml_dtypes.bfloat16``.

    Raises:
        TypeError: a dtype numpy has no counterpart for (see :func:`numpy_dtype`).
    """
    torch = sys.modules["torch"]
    tensor = tensor.detach()
    if tensor.dtype != torch.bfloat16:
        return tensor.numpy()
    return tensor.view(torch.int16).numpy().view(BFLOAT16)


def torch_tensor(array: np.ndarray) -> Any:
    """A torch CPU tensor over a numpy array's memory (no copy); ``ml_dtypes.bfloat16``
    arrays become bfloat16 tensors."""
    torch = sys.modules["torch"]
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
