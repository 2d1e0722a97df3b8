"""reducescatter: the reduction over all ranks, each rank keeping its share of axis 0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..kernels import Compression, Compressor, abs_max, encoding_of, reducer
from ..kernels.host import scale_into
from ..kernels.reduction import Combine
from . import _native, _recursive_doubling, _ring
from ._agreement import PAYLOAD_CAPACITY, Call, agree, agree_carrying
from ._allreduce_run import warn_nonfinite
from ._buffers import device_tensor, results_like
from ._calls import collective_call
from ._checks import (active_compressor, check_compression, check_reduction, check_splittable,
                      flat, input_array)
from ._data_phase import Finisher, finisher
from ._executor import Handle
from ._memory import AWARE, HOST, goes_direct
from ._placement import memory_for, staged
from ._ops import ReduceOp, resolve_op
from ._process_sets import ProcessSet, resolve_group
from ._result_pool import RESULTS
from ._group import Group
from ._selection import reducescatter_algorithm
from .config import current_settings
from .errors import InvalidArgumentError, subject


def reducescatter(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None, *,
                  algorithm: str | None = None,
                  compression: Compressor = Compression.none) -> np.ndarray:
    """Reduce ``tensor`` over all ranks and return this rank's share of axis 0.

    Axis 0 is split as evenly as possible, the earlier ranks taking the extra rows (the
    ``numpy.array_split`` convention): with 10 rows on 4 ranks, ranks get 3, 3, 2, 2.

    Args:
        tensor: this rank's array, at least 1-D; same shape and dtype on every rank.
        op, name, prescale_factor, postscale_factor, process_set: as for
            :func:`~ringtrain.allreduce`.
        algorithm: ``ring``, ``native`` or ``auto``.
        compression: ``Compression.fp16`` or ``Compression.bf16`` send float32 tensors
            as 16-bit floats, as :func:`~ringtrain.allreduce` does (the result is
            float32); a compressed reduce-scatter runs the ring.

    Returns:
        A new array of shape ``(rows of this rank, *tensor.shape[1:])``.
    """
    return collective_call("reducescatter", name, process_set,
                           lambda: _prepare(tensor, op, name, prescale_factor, postscale_factor,
                                            process_set, algorithm, compression),
                           restore=results_like(tensor))


def reducescatter_async(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                        name: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
                        *, algorithm: str | None = None,
                        compression: Compressor = Compression.none) -> Handle:
    """Start :func:`reducescatter`; ``synchronize(handle)`` returns this rank's share."""
    return collective_call("reducescatter", name, process_set,
                           lambda: _prepare(tensor, op, name, prescale_factor, postscale_factor,
                                            process_set, algorithm, compression),
                           asynchronous=True, restore=results_like(tensor))


def _prepare(tensor: Any, op: Any, name: str | None, prescale_factor: float,
             postscale_factor: float, process_set: ProcessSet | None,
             algorithm: str | None, compression: Any) -> Callable[[], Any]:
    compression = check_compression(compression, "reducescatter", name)
    on_device = device_tensor(tensor, "reducescatter", name)
    settings = current_settings()
    if on_device is not None and (compression.applies_to(on_device.dtype) or not goes_direct(
            algorithm, settings.reducescatter_algorithm, on_device.dtype)):
        return staged(on_device, False, lambda array: _prepare(
            array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
            compression))
    array = on_device if on_device is not None else \
        input_array(tensor, "reducescatter", name)
    op = resolve_op(op, "reducescatter", name)
    if op is ReduceOp.Adasum:
        raise InvalidArgumentError(
            f"{subject('reducescatter', name)}: op Adasum combines whole vectors; it is an "
            f"allreduce (and grouped allreduce) op only")
    check_reduction(array, op, name, prescale_factor, postscale_factor, "reducescatter")
    check_splittable(array.shape, "reducescatter", name)
    group = resolve_group(process_set, "reducescatter", name)
    compressor = active_compressor(compression, array.dtype, op, "reducescatter", name)
    if compressor is not None:
        return _compressed(array, op, name, prescale_factor, postscale_factor, group,
                           compressor, settings.segment_bytes)
    if on_device is not None:
        memory, chosen, source = memory_for(AWARE, on_device.device), "native", \
            on_device.memory
        call = Call(collective="reducescatter", name=name, op=op.name, dtype=array.dtype,
                    shape=array.shape, algorithm="native", memory=AWARE,
                    compression=compression.name)
    else:
        memory, source = HOST, flat(array)
        chosen = reducescatter_algorithm(algorithm, array.nbytes, group.size, settings, name)
        call = Call(collective="reducescatter", name=name, op=op.name, dtype=array.dtype,
                    shape=array.shape, algorithm=chosen,
                    segment_bytes=settings.segment_bytes if chosen == "ring" else None,
                    compression=compression.name)
    row = int(np.prod(array.shape[1:], dtype=np.int64))
    rows = _ring.chunk_bounds(array.shape[0], group.size)
    bounds = [r * row for r in rows]
    counts = [bounds[r + 1] - bounds[r] for r in range(group.size)]
    finish = finisher(group.size if op is ReduceOp.Average else 1, postscale_factor,
                      array.dtype)
    combine = reducer(op.value, array.dtype)
    nbytes = array.size * array.dtype.itemsize
    if chosen == "recursive_doubling":
        share = (rows[group.rank + 1] - rows[group.rank], *array.shape[1:])
        return lambda: _by_recursive_doubling(group, call, source, prescale_factor, combine,
                                              finish, bounds[group.rank], share,
                                              settings.segment_bytes)

    def run() -> Any:
        with memory.entered(*([] if on_device is None else [on_device])):
            agree(group, call)
            start = source
            if prescale_factor != 1.0:
                start = memory.scaled(source, prescale_factor,
                                      memory.scratch("prescaled", array.size, array.dtype))
            output = memory.new(array, (rows[group.rank + 1] - rows[group.rank],
                                        *array.shape[1:]))
            result = output.reshape(-1) if memory is HOST else output
            if chosen == "ring" and group.size > 1:
                _ring.reduce_scatter(group, memory.for_mpi(start), memory.for_mpi(result),
                                     bounds, combine, finish, settings.segment_bytes)
                return output
            if group.size == 1:
                memory.copy(start, result)
            elif nbytes:
                _native.reducescatter(group, memory.for_mpi(start), memory.for_mpi(result),
                                      counts, op, nbytes, encoding_of(array.dtype),
                                      **memory.phase_args)
            memory.finish(output, finish)
            return output

    return run


def _compressed(array: np.ndarray, op: ReduceOp, name: str | None, prescale_factor: float,
                postscale_factor: float, group: Any, compressor: Compressor,
                segment_bytes: int) -> Callable[[], Any]:
    """A reduce-scatter of host float32 ``array`` through a 16-bit wire, by the ring: the
    steps of a compressed allreduce (encode with the scale agreed over all ranks, reduce
    the wire, decode with the postscale and 1/N fused), on this rank's share only."""
    call = Call(collective="reducescatter", name=name, op=op.name, dtype=array.dtype,
                shape=array.shape, algorithm="ring",
                segment_bytes=segment_bytes, compression=compressor.name)
    row = int(np.prod(array.shape[1:], dtype=np.int64))
    rows = _ring.chunk_bounds(array.shape[0], group.size)
    bounds = [r * row for r in rows]
    combine = reducer(op.value, compressor.wire_dtype, compressor.encoding)
    source = flat(array)

    def run() -> np.ndarray:
        local_max, nonfinite = abs_max(source) if compressor.needs_range else (0.0, False)
        value_range = agree(group, call,
                            local_range=(local_max * abs(prescale_factor), nonfinite))
        if nonfinite:
            warn_nonfinite(group, value_range, compressor, "reducescatter", name)
        scale = compressor.scale_for(value_range.abs_max, group.size) \
            if compressor.needs_range else 1.0
        divisor = group.size if op is ReduceOp.Average else 1
        wire = HOST.scratch("wire", source.size, compressor.wire_dtype)
        compressor.encode(source, wire, scale * prescale_factor, key=name)
        own = bounds[group.rank + 1] - bounds[group.rank]
        reduced = HOST.scratch("wire share", own, compressor.wire_dtype)
        if group.size > 1:
            _ring.reduce_scatter(group, wire, reduced, bounds, combine, None, segment_bytes)
        else:
            reduced[:] = wire
        output = RESULTS.empty((rows[group.rank + 1] - rows[group.rank], *array.shape[1:]),
                               array.dtype)
        compressor.decode(reduced, output.reshape(-1), postscale_factor / (scale * divisor))
        return output

    return run


def _by_recursive_doubling(group: Group, call: Call, source: np.ndarray,
                           prescale_factor: float, combine: Combine, finish: Finisher | None,
                           start: int, shape: tuple[int, ...],
                           segment_bytes: int) -> np.ndarray:
    """A reduce-scatter as an allreduce by recursive doubling of which this rank keeps
    its share (of ``shape``, from element ``start`` of the flat array): in the
    agreement's own messages when the array fits in them."""
    if source.nbytes <= PAYLOAD_CAPACITY:
        reduced = agree_carrying(group, call, source.dtype, source.size,
                                 lambda data: scale_into(source, prescale_factor, data),
                                 combine)
    else:
        agree(group, call)
        reduced = np.empty_like(source)
        scale_into(source, prescale_factor, reduced)
        _recursive_doubling.allreduce(group, reduced, combine, segment_bytes)
    output = RESULTS.empty(shape, source.dtype)
    share = reduced[start:start + output.size]
    if finish is None:
        np.copyto(output.reshape(-1), share)
    else:
        finish.into(share, output.reshape(-1))
    return output
