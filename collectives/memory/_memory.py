"""Where a collective's data lives, chosen when the call is planned: the one step that
differs between host arrays, device tensors staged through pinned host memory, and
device memory handed to a CUDA-aware MPI.

Every collective is written once over a memory: it agrees, scales, packs, compresses
and unpacks the same way, and asks its memory to move or reduce a flat buffer. Device
reductions between the ranks of one node may also run on the GPUs themselves, through
CUDA IPC (:data:`IPC`).
:data:`HOST` serves numpy arrays; the device kinds are in :mod:`._device_memory`, and
:mod:`._placement` picks one for a call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import numpy as np

from ...kernels import BFLOAT16, bits, scale_into
from ...kernels.reduction import Combine
from ..algorithms._data_phase import reduce_flat
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._result_pool import RESULTS
from ..world._topology import NodeLayout
from ..world._world import world

AWARE = "cuda (CUDA-aware MPI)"
STAGED = "cuda (through host memory)"
IPC = "cuda (IPC)"
"""The ``memory`` field of a device call's signature: ranks must agree on it."""


MPI_CANNOT_REDUCE = (np.dtype(np.float16), BFLOAT16)
"""dtypes MPI has no reduction of: ringtrain reduces them in host memory (with a
user-defined MPI op on their bits for ``native``)."""


def goes_direct(algorithm: str | None, setting: str, reduced: np.dtype | None = None) -> bool:
    """Whether device pointers go to MPI: a CUDA-aware MPI, MPI's own algorithm chosen
    (``auto`` means it on device memory) and, for a reduction, a dtype MPI reduces (not
    the 16-bit floats: MPI has no 16-bit float type)."""
    return world().cuda_aware.aware and (algorithm or setting) in ("auto", "native") and \
        reduced not in MPI_CANNOT_REDUCE


class HostMemory:
    """numpy arrays: MPI and ringtrain's algorithms read and write them where they are.

    Attributes:
        signature: the call signature's ``memory`` field (None: host calls have none).
        phase_args: what the timeline's phases of such a call carry.
    """

    signature: str | None = None
    phase_args: dict[str, Any] = {}

    def entered(self, *tensors: Any) -> ContextManager[Any]:
        """Where a call on ``tensors`` runs (device tensors: on their GPU, once the
        streams that produced them are done)."""
        return contextlib.nullcontext()

    def new(self, like: Any, shape: tuple[int, ...]) -> np.ndarray:
        """A new array of ``like``'s dtype for a result (see :mod:`._result_pool`)."""
        return RESULTS.empty(shape, like.dtype)

    def scratch(self, use: str, size: int, dtype: Any, kept: Any = None) -> np.ndarray:
        """A 1-D buffer of ``size`` elements for ``use``: ``kept`` (a plan's own) if
        given, else a new one."""
        return kept if kept is not None else np.empty(size, dtype)

    def scaled(self, source: Any, factor: float, target: Any) -> Any:
        """``source * factor`` in ``target``, or ``source`` itself when the factor is 1;
        ready for MPI to read."""
        if factor == 1.0:
            return source
        scale_into(source, factor, target)
        return target

    def settled(self, array: Any) -> Any:
        """``array`` once the work queued on it has finished (host: at once)."""
        return array

    def elements(self, array: Any) -> int:
        """The number of elements of ``array``."""
        return array.size

    def nbytes(self, array: Any) -> int:
        """The number of bytes of ``array``."""
        return array.nbytes

    def copy(self, source: Any, target: Any) -> None:
        """``target[:] = source``, finished when this returns."""
        target[...] = source

    def for_mpi(self, array: Any, dtype: Any = None) -> Any:
        """``array`` as MPI takes it, its bytes seen as ``dtype`` when given (bfloat16,
        which MPI lacks, as its uint16 bits)."""
        return bits(array) if dtype is None else array.reshape(-1).view(dtype)

    def finish(self, values: Any, finish: Finisher | None) -> None:
        """Apply ``finish`` (divide, scale) to reduced ``values``."""
        if finish is not None:
            finish(values)

    def reduce(self, group: Group, algorithm: str, source: Any, result: Any, op: ReduceOp,
               combine: Combine | None, finish: Callable[[Any], None] | None,
               segment_bytes: int, encoding: str | None, layout: NodeLayout | None,
               bounds: Sequence[int] | None = None) -> None:
        """Allreduce flat ``source`` into ``result`` (may be it) after agreement;
        ``bounds``: the tensors' offsets in it, for Adasum (host memory only: plans
        refuse Adasum on device memory)."""
        reduce_flat(group, algorithm, source, result, op, combine, finish, segment_bytes,
                    encoding, layout, bounds)


HOST = HostMemory()
