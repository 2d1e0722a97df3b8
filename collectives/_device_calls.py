"""The collectives on device tensors.

With a CUDA-aware MPI (see :mod:`.cuda_aware`) and the ``auto`` or ``native``
algorithm, device pointers go straight to MPI's own collectives, after the stream that
produced the tensor has finished. Otherwise, or for reductions MPI cannot do on device
memory (16-bit floats, compression), the tensors travel through pinned host memory
(:mod:`._staging`) and ringtrain's algorithms run on the host copies. Scaling,
fusion and 16-bit casts run on the GPU, so fp16 compression halves the bytes that cross
PCIe. Every call returns once its results are in device memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI
import numpy as np

from ..kernels import (Compressor, abs_max, device, divide_into, pack, reducer, scale_into,
                       unpack)
from ._agreement import Call, agree
from ._buffers import DeviceTensor
from ._calls import check_splittable
from ._group import Group
from ._native import MPI_OPS
from ._ops import COPY_DTYPES, ReduceOp, check_dtype, resolve_op
from ._process_sets import ProcessSet, resolve_group
from ._ring import chunk_bounds
from ._staging import scratch, staged, through_host
from ._tracing import phase
from ._world import world
from .config import current_settings
from .errors import InvalidArgumentError, subject

AWARE = "cuda (CUDA-aware MPI)"
STAGED = "cuda (through host memory)"
"""The ``memory`` field of a device call's signature: ranks must agree on it."""

HostCollective = Callable[[np.ndarray], Callable[[], Any]]


class MPIMemory:
    """Device memory as mpi4py takes it: an object exposing ``__cuda_array_interface__``."""

    def __init__(self, array: Any, dtype: Any = None):
        address = device.address_of(array)
        dtype = device.dtype_of(array) if dtype is None else np.dtype(dtype)
        nbytes = device.byte_view(array).size
        self.__cuda_array_interface__ = {
            "version": 3, "data": (address, False), "shape": (nbytes // dtype.itemsize,),
            "typestr": dtype.str, "strides": None, "stream": None}


def goes_direct(algorithm: str | None, setting: str, reduced: np.dtype | None = None) -> bool:
    """Whether device pointers go to MPI: a CUDA-aware MPI, MPI's own algorithm chosen
    (``auto`` means it on device memory) and, for a reduction, a dtype MPI reduces (not
    float16: MPI has no 16-bit float type)."""
    return world().cuda_aware.aware and (algorithm or setting) in ("auto", "native") and \
        reduced != np.float16


def _scaled(source: Any, factor: float, target: Any) -> Any:
    """``source * factor`` in ``target`` (on the GPU), or ``source`` when the factor is 1."""
    if factor == 1.0:
        return source
    scale_into(source, factor, target)
    return target


def _synchronized(array: Any) -> Any:
    device.synchronize(device.byte_view(array))
    return array


def allreduce(tensor: DeviceTensor, op: Any, name: str | None, prescale_factor: float,
              postscale_factor: float, process_set: ProcessSet | None,
              algorithm: str | None, compression: Any, in_place: bool) -> Callable[[], Any]:
    """The body of an allreduce of device ``tensor`` (arguments as the host one's)."""
    collective = "allreduce_" if in_place else "allreduce"
    plan = device_allreduce_plan(tensor, op, name, prescale_factor, postscale_factor,
                                 process_set, algorithm, compression, collective)

    def run() -> Any:
        with device.on_device(tensor.device):
            tensor.wait_for_producer()
            out = tensor.owner if in_place else tensor.new(tensor.shape)
            target = tensor.memory if in_place else out
            reduce_planned_on_device(plan, collective, name, tensor.memory, target,
                                     prescale_factor, postscale_factor, tensor.device)
            return out

    return run


def device_allreduce_plan(array: Any, op: Any, name: str | None, prescale_factor: float,
                          postscale_factor: float, process_set: ProcessSet | None,
                          algorithm: str | None, compression: Any, collective: str) -> Any:
    """:func:`._allreduce.allreduce_plan` for device tensors like ``array`` (anything with
    their ``shape``, ``dtype`` and ``size``): MPI's own algorithm on device memory where
    :func:`goes_direct` allows it, else the algorithm chosen for the host copies; the
    ``memory`` field of the signature says which."""
    from ._allreduce import allreduce_plan
    compressed = isinstance(compression, Compressor) and compression.applies_to(array.dtype)
    direct = not compressed and \
        goes_direct(algorithm, current_settings().allreduce_algorithm, array.dtype)
    return allreduce_plan(array, op, name, prescale_factor, postscale_factor, process_set,
                          "native" if direct else algorithm, compression, collective,
                          memory=AWARE if direct else STAGED)


def reduce_planned_on_device(plan: Any, collective: str, name: str | None, source: Any,
                             target: Any, prescale_factor: float, postscale_factor: float,
                             ordinal: int) -> None:
    """Agree with the other ranks, then reduce device ``source`` into ``target`` (may be
    it) as ``plan`` (from :func:`._allreduce.allreduce_plan`) says: MPI's own allreduce on
    device memory when the plan chose ``native``, MPI is CUDA-aware and the dtype is not
    16-bit, else through pinned host memory. Device ``ordinal`` must be current.
    """
    from ._allreduce import warn_nonfinite
    group, settings, compressor = plan.group, plan.settings, plan.compressor
    divisor = group.size if plan.op is ReduceOp.Average else 1
    dtype = device.dtype_of(source)
    if compressor is None and plan.algorithm == "native" and \
            goes_direct("native", "native", dtype):
        agree(group, plan.call)
        start = _synchronized(_scaled(source, prescale_factor, target))
        _mpi_allreduce(group, start, target, plan.op)
        _finish(target, divisor, postscale_factor)
    elif compressor is None:
        agree(group, plan.call)
        start = _synchronized(_scaled(source, prescale_factor, target))
        if group.size == 1:  # nothing to exchange: the result never leaves the GPU
            if start is not target:
                _copy(start, target)
            _finish(target, divisor, postscale_factor)
            return
        through_host(group, plan.algorithm, start, target, dtype, plan.op, plan.combine,
                     plan.finish, settings.segment_bytes, None, plan.layout, ordinal)
    else:
        local_max, nonfinite = abs_max(source) if compressor.needs_range else (0.0, False)
        value_range = agree(group, plan.call,
                            local_range=(local_max * abs(prescale_factor), nonfinite))
        if nonfinite:
            warn_nonfinite(group, value_range, compressor, collective, name)
        scale = compressor.scale_for(value_range.abs_max, group.size)
        _reduce_compressed(group, plan.algorithm, compressor, source, target,
                           scale * prescale_factor, postscale_factor / (scale * divisor),
                           plan.op, name, settings.segment_bytes, plan.layout, ordinal)


def _mpi_allreduce(group: Group, source: Any, target: Any, op: ReduceOp) -> None:
    """MPI's allreduce on device memory (``source`` may be ``target``)."""
    if device.byte_view(target).size == 0:
        return
    if group.size == 1:
        if source is not target:
            _synchronized(_copy(source, target))
        return
    send = MPI.IN_PLACE if source is target else MPIMemory(source)
    with phase("MPI allreduce", bytes=device.byte_view(target).size, device=True):
        group.comm.Allreduce(send, MPIMemory(target), MPI_OPS[op])


def _finish(values: Any, divisor: int, postscale_factor: float) -> None:
    """Turn a sum into the result on the GPU, rounding as the host does: divide for
    Average, then scale."""
    if divisor != 1:
        divide_into(values, divisor, values)
    _synchronized(_scaled(values, postscale_factor, values))


def _copy(source: Any, target: Any) -> Any:
    scale_into(source, 1.0, target)
    return target


def _reduce_compressed(group: Group, algorithm: str, compressor: Compressor, source: Any,
                       target: Any, encode_scale: float, decode_scale: float, op: ReduceOp,
                       name: str | None, segment_bytes: int, layout: Any,
                       ordinal: int) -> None:
    """Cast to the wire format on the GPU, reduce the 16-bit values through host
    memory, cast back on the GPU with the scales fused into the casts."""
    size = device.byte_view(source).size // 4
    wire = scratch("wire", ordinal, size, compressor.wire_dtype)
    with phase("compress", bytes=size * 4, format=compressor.name, device=True):
        compressor.encode(source, wire, encode_scale, key=name)
        _synchronized(wire)
    if group.size > 1:
        through_host(group, algorithm, wire, wire, compressor.wire_dtype, op,
                     reducer(op.value, compressor.wire_dtype, compressor.encoding), None,
                     segment_bytes, compressor.encoding, layout, ordinal)
    with phase("decompress", bytes=size * 4, format=compressor.name, device=True):
        compressor.decode(wire, target, decode_scale)
        _synchronized(target)


def grouped_allreduce(tensors: list[DeviceTensor], op: Any, name: str | None,
                      prescale_factor: float, postscale_factor: float,
                      process_set: ProcessSet | None, algorithm: str | None,
                      compression: Any, in_place: bool) -> Callable[[], list[Any]]:
    """The body of a grouped allreduce of device tensors: one fused buffer per dtype,
    packed and unpacked on the GPU in one launch each."""
    from ._allreduce import GroupedCall, finisher, warn_nonfinite
    collective = "grouped_allreduce_" if in_place else "grouped_allreduce"
    if len({t.device for t in tensors}) > 1:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: the tensors are on different GPUs "
            f"({sorted({t.device for t in tensors})}); group the tensors of one GPU")
    arguments = (tensors, op, name, prescale_factor, postscale_factor, process_set,
                 algorithm, compression, collective)
    grouped = GroupedCall(*arguments, memory=STAGED)
    compressed = any(c is not None for c in grouped.compressors.values())
    direct = not compressed and all(
        goes_direct(algorithm, grouped.settings.allreduce_algorithm, dtype)
        for dtype in grouped.members)
    if direct:
        grouped = GroupedCall(*arguments, memory=AWARE, forced_algorithm="native")
    op, compression, group, settings, layout, chosen, call = (
        grouped.op, grouped.compression, grouped.group, grouped.settings, grouped.layout,
        grouped.chosen, grouped.call)
    divisor = group.size if op is ReduceOp.Average else 1
    ordinal = tensors[0].device if tensors else 0

    def run() -> list[Any]:
        with device.on_device(ordinal):
            for tensor in tensors:
                tensor.wait_for_producer()
            buffers, local_max, nonfinite = {}, 0.0, False
            for dtype, members in grouped.members.items():
                fusion, compressor = grouped.fusion[dtype], grouped.compressors[dtype]
                buffer = buffers[dtype] = scratch("fusion", ordinal, fusion.total_size, dtype)
                with phase("pack", bytes=fusion.nbytes, tensors=len(members), device=True):
                    pack(fusion, [tensors[i].memory for i in members], buffer, prescale_factor)
                if compressor is not None and compressor.needs_range:
                    part_max, part_nonfinite = abs_max(buffer)
                    local_max, nonfinite = max(local_max, part_max), nonfinite or part_nonfinite
            value_range = agree(group, call,
                                local_range=(local_max, nonfinite) if compressed else None)
            if nonfinite:
                warn_nonfinite(group, value_range, compression, collective, name)
            outputs: list[Any] = [t.owner for t in tensors] if in_place else [None] * len(tensors)
            for dtype, members in grouped.members.items():
                fusion, compressor = grouped.fusion[dtype], grouped.compressors[dtype]
                buffer = buffers[dtype]
                unpack_scale = postscale_factor
                if compressor is not None:
                    scale = compressor.scale_for(value_range.abs_max, group.size) \
                        if compressor.needs_range else 1.0
                    _reduce_compressed(group, chosen[dtype], compressor, buffer, buffer,
                                       scale, postscale_factor / (scale * divisor), op, name,
                                       settings.segment_bytes, layout, ordinal)
                    unpack_scale = 1.0
                elif direct:
                    _mpi_allreduce(group, _synchronized(buffer), buffer, op)
                    _finish(buffer, divisor, 1.0)
                elif group.size > 1:
                    through_host(group, chosen[dtype], _synchronized(buffer), buffer, dtype, op,
                                 reducer(op.value, dtype), finisher(divisor, 1.0),
                                 settings.segment_bytes, None, layout, ordinal)
                targets = []
                for index in members:
                    if not in_place:
                        outputs[index] = tensors[index].new(tensors[index].shape)
                    targets.append(tensors[index].memory if in_place else outputs[index])
                with phase("unpack", bytes=fusion.nbytes, tensors=len(members), device=True):
                    unpack(fusion, buffer, targets, unpack_scale)
                    _synchronized(buffer)
            return outputs

    return run


def broadcast(tensor: DeviceTensor, root_rank: Any, name: str | None,
              process_set: ProcessSet | None, algorithm: str | None, in_place: bool,
              host: HostCollective) -> Callable[[], Any]:
    """The body of a broadcast of device ``tensor``: MPI's own on device memory when MPI
    is CUDA-aware, else ``host`` (the host collective) on a pinned copy."""
    from ._broadcast import root_in_group
    if not goes_direct(algorithm, current_settings().broadcast_algorithm):
        return staged(tensor, in_place, host)
    collective = "broadcast_" if in_place else "broadcast"
    check_dtype(tensor.dtype, COPY_DTYPES, collective, name)
    group = resolve_group(process_set, collective, name)
    root = root_in_group(group, root_rank, collective, name)
    call = Call(collective="broadcast", name=name, root_rank=int(root_rank),
                dtype=tensor.dtype, shape=tensor.shape, algorithm="native", memory=AWARE)

    def run() -> Any:
        with device.on_device(tensor.device):
            tensor.wait_for_producer()
            agree(group, call)
            out = tensor.owner if in_place else tensor.new(tensor.shape)
            target = tensor.memory if in_place else out
            if not in_place and group.rank == root:
                _synchronized(_copy(tensor.memory, target))
            if group.size > 1 and tensor.nbytes:
                with phase("MPI broadcast", bytes=tensor.nbytes, device=True):
                    group.comm.Bcast(MPIMemory(target, np.uint8), root)
            return out

    return run


def allgather(tensor: DeviceTensor, name: str | None, process_set: ProcessSet | None,
              algorithm: str | None, host: HostCollective) -> Callable[[], Any]:
    """The body of an allgather of device ``tensor`` (see :func:`broadcast`)."""
    if not goes_direct(algorithm, current_settings().allgather_algorithm):
        return staged(tensor, False, host)
    check_dtype(tensor.dtype, COPY_DTYPES, "allgather", name)
    group = resolve_group(process_set, "allgather", name)
    row_shape = tensor.shape[1:]
    call = Call(collective="allgather", name=name, dtype=tensor.dtype, algorithm="native",
                memory=AWARE, **{"shape[1:]": row_shape})
    rows = tensor.shape[0] if tensor.shape else 1
    row_bytes = tensor.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))

    def run() -> Any:
        with device.on_device(tensor.device):
            tensor.wait_for_producer()
            agree(group, call)
            counts = np.empty(group.size, np.int64)
            group.comm.Allgather(np.array([rows], np.int64), counts)
            out = tensor.new((int(counts.sum()), *row_shape))
            sizes = (counts * row_bytes).tolist()
            if sum(sizes):
                with phase("MPI allgather", bytes=sum(sizes), device=True):
                    group.comm.Allgatherv(
                        _bytes(tensor.memory),
                        [MPIMemory(out, np.uint8), sizes, _offsets(sizes), MPI.BYTE])
            return out

    return run


def alltoall(tensor: DeviceTensor, splits: Any, name: str | None,
             process_set: ProcessSet | None, algorithm: str | None,
             host: HostCollective) -> Callable[[], Any]:
    """The body of an alltoall of device ``tensor`` (see :func:`broadcast`)."""
    from ._alltoall import check_splits
    if not goes_direct(algorithm, current_settings().alltoall_algorithm):
        return staged(tensor, False, host)
    check_dtype(tensor.dtype, COPY_DTYPES, "alltoall", name)
    check_splittable(tensor.shape, "alltoall", name)
    group = resolve_group(process_set, "alltoall", name)
    send_splits = check_splits(splits, tensor.shape[0], group.size, name)
    row_shape = tensor.shape[1:]
    call = Call(collective="alltoall", name=name, dtype=tensor.dtype, algorithm="native",
                memory=AWARE, **{"shape[1:]": row_shape})
    row_bytes = tensor.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))

    def run() -> tuple[Any, np.ndarray]:
        with device.on_device(tensor.device):
            tensor.wait_for_producer()
            agree(group, call)
            received_splits = np.empty(group.size, np.int64)
            group.comm.Alltoall(send_splits, received_splits)
            out = tensor.new((int(received_splits.sum()), *row_shape))
            sent, received = (send_splits * row_bytes).tolist(), \
                (received_splits * row_bytes).tolist()
            with phase("MPI alltoall", bytes=sum(sent), device=True):
                group.comm.Alltoallv([_bytes(tensor.memory), sent, _offsets(sent), MPI.BYTE],
                                     [_bytes(out), received, _offsets(received), MPI.BYTE])
            return out, received_splits

    return run


def reducescatter(tensor: DeviceTensor, op: Any, name: str | None, prescale_factor: float,
                  postscale_factor: float, process_set: ProcessSet | None,
                  algorithm: str | None, host: HostCollective) -> Callable[[], Any]:
    """The body of a reducescatter of device ``tensor`` (see :func:`broadcast`)."""
    from ._allreduce import check_reduction
    if not goes_direct(algorithm, current_settings().reducescatter_algorithm, tensor.dtype):
        return staged(tensor, False, host)
    op = resolve_op(op, "reducescatter", name)
    check_reduction(tensor, op, name, prescale_factor, postscale_factor, "reducescatter")
    check_splittable(tensor.shape, "reducescatter", name)
    group = resolve_group(process_set, "reducescatter", name)
    call = Call(collective="reducescatter", name=name, op=op.name, dtype=tensor.dtype,
                shape=tensor.shape, algorithm="native", memory=AWARE)
    row = int(np.prod(tensor.shape[1:], dtype=np.int64))
    rows = chunk_bounds(tensor.shape[0], group.size)
    counts = [(rows[r + 1] - rows[r]) * row for r in range(group.size)]
    divisor = group.size if op is ReduceOp.Average else 1

    def run() -> Any:
        with device.on_device(tensor.device):
            tensor.wait_for_producer()
            agree(group, call)
            source = tensor.memory
            if prescale_factor != 1.0:
                source = _synchronized(_scaled(source, prescale_factor,
                                               scratch("prescaled", tensor.device, tensor.size,
                                                       tensor.dtype)))
            out = tensor.new((rows[group.rank + 1] - rows[group.rank], *tensor.shape[1:]))
            if group.size == 1:
                _synchronized(_copy(source, out))
            elif tensor.nbytes:
                with phase("MPI reducescatter", bytes=tensor.nbytes, device=True):
                    group.comm.Reduce_scatter(MPIMemory(source), MPIMemory(out), counts,
                                              MPI_OPS[op])
            _finish(out, divisor, postscale_factor)
            return out

    return run


def _bytes(array: Any) -> MPIMemory:
    return MPIMemory(array, np.uint8)


def _offsets(sizes: Sequence[int]) -> list[int]:
    return [0, *np.cumsum(sizes).tolist()][:-1]
