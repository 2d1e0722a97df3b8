"""Which memory a call's data is in: host arrays, or device memory staged, handed to MPI
or shared between the GPUs of a node. The device kinds load numba.cuda, so they are
imported here only for device tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..base._buffers import DeviceTensor
from ._memory import HOST, HostMemory


def staged(tensor: DeviceTensor, in_place: bool,
           host_body: Callable[[np.ndarray], Callable[[], Any]]) -> Callable[[], Any]:
    """A collective on device ``tensor`` run by its host body on a pinned copy (see
    :func:`._staging.staged`)."""
    from . import _staging  # loads numba.cuda: only for device tensors
    return _staging.staged(tensor, in_place, host_body)


def memory_for(signature: str | None, ordinal: int = 0) -> HostMemory:
    """The memory of a call whose signature names ``signature`` (None: host), on GPU
    ``ordinal`` for device memory."""
    if signature is None:
        return HOST
    from . import _device_memory  # loads numba.cuda: only for device tensors
    return _device_memory.device_memory(signature, ordinal)
