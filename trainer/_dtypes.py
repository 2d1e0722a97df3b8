"""The numpy dtype of a torch dtype, bfloat16 included.

numpy has no bfloat16 of its own; ringtrain's is ``ml_dtypes.bfloat16``
(:data:`ringtrain.kernels.BFLOAT16`), which the collectives and kernels take like any
other dtype (the collectives' engine views torch tensors as such arrays). torch is never
imported here: a torch dtype can only exist once the caller has imported it.
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
