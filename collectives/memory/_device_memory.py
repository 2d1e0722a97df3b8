"""Device memory for the collectives: tensors in GPU memory, through pinned host memory,
handed to a CUDA-aware MPI, or reduced on the GPUs of one node through CUDA IPC.

With a CUDA-aware MPI (see :mod:`.cuda_aware`) and the ``auto`` or ``native``
algorithm, device pointers go straight to MPI's own collectives, after the stream that
produced the tensor has finished (:class:`DirectMemory`). Otherwise, or for reductions
MPI cannot do on device memory (16-bit floats, compression), reductions travel through
pinned host memory in pipelined segments and ringtrain's algorithms run on the host
copies (:class:`StagedMemory`; the other collectives run on a pinned copy, see
:func:`._staging.staged`). When every rank of the group is on one node, large
allreduces run on the GPUs instead, each reading its peers' buffers through CUDA IPC
(:class:`IpcMemory`). Scaling, fusion and 16-bit casts run on the GPU, so fp16
compression halves the bytes that cross PCIe. Every call returns once its results are
in device memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager

from mpi4py import MPI
import numpy as np

from ...kernels import BFLOAT16, device, scale_into
from ...kernels.reduction import Combine
from ..algorithms import _ipc, _native
from ..algorithms._selection import host_allreduce_algorithm
from ..base._buffers import DeviceTensor
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._ops import ReduceOp
from ..config import current_settings
from ..world._topology import NodeLayout, hierarchy_for
from ._memory import AWARE, IPC, STAGED, HostMemory
from ._staging import scratch, through_host


class MPIMemory:
    """Device memory as mpi4py takes it: an object exposing ``__cuda_array_interface__``."""

    def __init__(self, array: Any, dtype: Any = None):
        address = device.address_of(array)
        dtype = device.dtype_of(array) if dtype is None else np.dtype(dtype)
        if dtype == BFLOAT16:  # MPI has no bfloat16: its bits
            dtype = np.dtype(np.uint16)
        nbytes = device.nbytes_of(array)
        self.__cuda_array_interface__ = {
            "version": 3, "data": (address, False), "shape": (nbytes // dtype.itemsize,),
            "typestr": dtype.str, "strides": None, "stream": None}


class _Entered:
    """The context of a call on device tensors: their GPU current, their producers done."""

    def __init__(self, tensors: tuple[DeviceTensor, ...], ordinal: int):
        self._tensors = tensors
        self._ordinal = ordinal
        self._device: Any = None

    def __enter__(self) -> None:
        self._device = device.on_device(self._ordinal)
        self._device.__enter__()
        for tensor in self._tensors:
            tensor.wait_for_producer()

    def __exit__(self, *exc: Any) -> None:
        self._device.__exit__(*exc)


class StagedMemory(HostMemory):
    """Device memory on GPU ``ordinal``, reduced through pinned host memory."""

    signature: str | None = STAGED
    phase_args: dict[str, Any] = {"device": True}

    def __init__(self, ordinal: int):
        self.ordinal = ordinal

    def entered(self, *tensors: DeviceTensor) -> ContextManager[Any]:
        return _Entered(tensors, self.ordinal)

    def new(self, like: DeviceTensor, shape: tuple[int, ...]) -> Any:
        return like.new(shape)

    def scratch(self, use: str, size: int, dtype: Any, kept: Any = None) -> Any:
        return scratch(use, self.ordinal, size, dtype)

    def scaled(self, source: Any, factor: float, target: Any) -> Any:
        if factor != 1.0:
            scale_into(source, factor, target)
            source = target
        return self.settled(source)

    def settled(self, array: Any) -> Any:
        device.synchronize(array)
        return array

    def nbytes(self, array: Any) -> int:
        return device.nbytes_of(array)

    def elements(self, array: Any) -> int:
        return device.nbytes_of(array) // device.dtype_of(array).itemsize

    def copy(self, source: Any, target: Any) -> None:
        scale_into(source, 1.0, target)
        self.settled(target)

    def for_mpi(self, array: Any, dtype: Any = None) -> MPIMemory:
        return MPIMemory(array, dtype)

    def finish(self, values: Any, finish: Finisher | None) -> None:
        """Divide and scale on the GPU, rounding as the host does; return once done."""
        queue_finish(values, finish)
        self.settled(values)

    def reduce(self, group: Group, algorithm: str, source: Any, result: Any, op: ReduceOp,
               combine: Combine, finish: Callable[[Any], None] | None, segment_bytes: int,
               encoding: str | None, layout: NodeLayout | None) -> None:
        if group.size == 1:  # nothing to exchange: the result never leaves the GPU
            if source is not result:
                self.copy(source, result)
            self.finish(result, finish)
            return
        through_host(group, algorithm, source, result, device.dtype_of(source), op, combine,
                     finish, segment_bytes, encoding, layout, self.ordinal)


class DirectMemory(StagedMemory):
    """Device memory on GPU ``ordinal`` handed to a CUDA-aware MPI's own collectives."""

    signature = AWARE

    def reduce(self, group: Group, algorithm: str, source: Any, result: Any, op: ReduceOp,
               combine: Combine, finish: Callable[[Any], None] | None, segment_bytes: int,
               encoding: str | None, layout: NodeLayout | None) -> None:
        nbytes = device.nbytes_of(result)
        if nbytes and group.size == 1 and source is not result:
            self.copy(source, result)
        elif nbytes and group.size > 1:
            send = MPI.IN_PLACE if source is result else MPIMemory(source)
            _native.allreduce(group, send, MPIMemory(result), _native.MPI_OPS[op], nbytes,
                              device=True)
        self.finish(result, finish)


class IpcMemory(StagedMemory):
    """Device memory on GPU ``ordinal`` reduced on the GPUs through CUDA IPC (:mod:`._ipc`):
    between the ranks of one node, or inside each node for the hierarchical allreduce,
    whose chunks cross the nodes through host memory; through host memory alone where
    the ranks turn out unable to share device memory."""

    signature = IPC

    def reduce(self, group: Group, algorithm: str, source: Any, result: Any, op: ReduceOp,
               combine: Combine, finish: Callable[[Any], None] | None, segment_bytes: int,
               encoding: str | None, layout: NodeLayout | None) -> None:
        if group.size > 1 and algorithm == "ipc":
            if _ipc.allreduce(_ipc.node_buffers(group, self.ordinal), source, result, op,
                              finish, finishing, encoding):
                return
            algorithm = host_allreduce_algorithm(self.nbytes(source), group.size,
                                                 current_settings())
        elif algorithm == "hierarchical":  # the plan took IPC memory for it (see _plans)
            dtype = device.dtype_of(source)

            def across(owners: Group, chunk: Any) -> None:
                chosen = host_allreduce_algorithm(self.nbytes(chunk), owners.size,
                                                  current_settings())
                through_host(owners, chosen, chunk, chunk, dtype, op, combine, finish,
                             segment_bytes, encoding, None, self.ordinal)

            if _ipc.hierarchical_allreduce(group, hierarchy_for(group, layout), self.ordinal,
                                           source, result, op, finishing, across, encoding):
                return
        super().reduce(group, algorithm, source, result, op, combine, finish, segment_bytes,
                       encoding, layout)


def finishing(values: Any, finish: Finisher | None) -> list[Callable[[], None]]:
    """The kernels that divide and scale device ``values`` in place, rounding as the host
    does, prepared (:func:`ringtrain.kernels.device.prepared_division`): each call of one
    queues it on the values' stream."""
    launches = []
    if finish is not None:
        if finish.divisor != 1:
            launches.append(device.prepared_division(values, finish.divisor, values))
        if finish.postscale_factor != 1.0:
            launches.append(device.prepared_scaling(values, finish.postscale_factor, values))
    return launches


def queue_finish(values: Any, finish: Finisher | None) -> None:
    """Queue the division and scaling of device ``values`` on their stream."""
    for launch in finishing(values, finish):
        launch()


_KINDS: dict[str, type[StagedMemory]] = {STAGED: StagedMemory, AWARE: DirectMemory,
                                         IPC: IpcMemory}
_memories: dict[tuple[str, int], StagedMemory] = {}


def device_memory(signature: str, ordinal: int) -> StagedMemory:
    """The memory of GPU ``ordinal`` that a call's signature names: :data:`STAGED`,
    :data:`AWARE` or :data:`IPC`."""
    memory = _memories.get((signature, ordinal))
    if memory is None:
        memory = _memories[(signature, ordinal)] = _KINDS[signature](ordinal)
    return memory
