"""allreduce and its in-place, asynchronous and grouped forms."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI
import numpy as np

from ..kernels import (Compression, Compressor, FusionLayout, abs_max, pack, reducer,
                       scale_into)
from ..kernels.reduction import Combine
from . import _hierarchical, _recursive_doubling, _ring
from ._agreement import PAYLOAD_CAPACITY, Call, ValueRange, agree
from ._buffers import device_tensor, results_like, returns_itself
from ._calls import check_scale_factors, execute, flat, in_place_array, input_array
from ._executor import Handle
from ._group import Group
from ._native import MPI_OPS, sixteen_bit_op
from ._ops import REDUCE_DTYPES, ReduceOp, check_dtype, check_op_for_dtype, resolve_op
from ._process_sets import ProcessSet, resolve_group
from ._selection import allreduce_algorithm
from ._topology import HIERARCHICAL, Layout, hierarchy_for, layout_of
from ._tracing import phase
from .config import current_settings
from .errors import InvalidArgumentError, NonFiniteWarning, subject

Finish = Callable[[np.ndarray], None]


def allreduce(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet | None = None, *,
              algorithm: str | None = None,
              compression: Compressor = Compression.none) -> np.ndarray:
    """Combine ``tensor`` over all ranks; return the result as a new array.

    Args:
        tensor: this rank's array (any shape, a supported dtype): a numpy array, a torch
            tensor (CPU or CUDA), a CuPy or numba device array; the result is of the same
            kind, on the same device (see docs/gpu.md). Non-contiguous arrays are copied
            first.
        op: Average (default), Sum, Min, Max or Product. Average of integers is refused.
        name: names the tensor in error messages; must be the same on every rank.
        prescale_factor: multiplies the input before the reduction (floating dtypes).
        postscale_factor: multiplies the result (floating dtypes).
        process_set: the ranks taking part (default: all).
        algorithm: ``ring``, ``recursive_doubling``, ``hierarchical``, ``node_leader``,
            ``native`` or ``auto`` (default: the ``allreduce_algorithm`` setting).
        compression: ``Compression.fp16`` or ``Compression.bf16`` send float32 tensors
            as 16-bit floats (half the bytes; the result is float32 again, with the
            16-bit format's precision); other dtypes travel as they are. Product is
            refused with compression. The hierarchical algorithms compress only the
            traffic between nodes.

    Returns:
        A new array of ``tensor``'s shape and dtype, bit-identical on every rank.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops, names or algorithms.
        InvalidArgumentError, UnsupportedDtypeError: bad arguments, before any
            communication.
    """
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, compression, in_place=False)
    return execute("allreduce", name, run,
                   restore=results_like(tensor))


def allreduce_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None, *,
               algorithm: str | None = None,
               compression: Compressor = Compression.none) -> np.ndarray:
    """In-place :func:`allreduce`: ``tensor`` receives the result and is returned."""
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, compression, in_place=True)
    return execute("allreduce_", name, run,
                   restore=returns_itself(tensor))


def allreduce_async(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                    name: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None,
                    compression: Compressor = Compression.none) -> Handle:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new array.

    ``tensor`` must not be modified until the handle is complete.
    """
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, compression, in_place=False)
    return execute("allreduce", name, run, asynchronous=True,
                   restore=results_like(tensor))


def allreduce_async_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                     name: str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                     algorithm: str | None = None,
                     compression: Compressor = Compression.none) -> Handle:
    """Start :func:`allreduce_`; ``tensor`` holds the result once the handle is complete."""
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, compression, in_place=True)
    return execute("allreduce_", name, run, asynchronous=True,
                   restore=returns_itself(tensor))


def grouped_allreduce(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                      name: str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                      algorithm: str | None = None,
                      compression: Compressor = Compression.none) -> list[np.ndarray]:
    """Allreduce several arrays as one: arrays of one dtype travel in one fused buffer.

    Arguments as :func:`allreduce`; every rank passes the same number of arrays with the
    same shapes and dtypes, in the same order.

    Returns:
        New arrays, one per input, in order.
    """
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, compression, in_place=False)
    return execute("grouped_allreduce", name, run,
                   restore=results_like(tensors))


def grouped_allreduce_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                       name: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                       algorithm: str | None = None,
                       compression: Compressor = Compression.none) -> list[np.ndarray]:
    """In-place :func:`grouped_allreduce`; returns the input arrays, now reduced."""
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, compression, in_place=True)
    return execute("grouped_allreduce_", name, run,
                   restore=returns_itself(tensors))


def grouped_allreduce_async(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                            name: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None, *,
                            algorithm: str | None = None,
                            compression: Compressor = Compression.none) -> Handle:
    """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the list."""
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, compression, in_place=False)
    return execute("grouped_allreduce", name, run, asynchronous=True,
                   restore=results_like(tensors))


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                             name: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None, *,
                             algorithm: str | None = None,
                             compression: Compressor = Compression.none) -> Handle:
    """Start :func:`grouped_allreduce_`."""
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, compression, in_place=True)
    return execute("grouped_allreduce_", name, run, asynchronous=True,
                   restore=returns_itself(tensors))


def check_reduction(array: np.ndarray, op: ReduceOp, name: str | None,
                    prescale_factor: float, postscale_factor: float, collective: str) -> None:
    """Refuse what no reduction accepts: unsupported dtype, Average of integers, bad scales."""
    check_dtype(array.dtype, REDUCE_DTYPES, collective, name)
    check_op_for_dtype(op, array.dtype, collective, name)
    check_scale_factors(array.dtype, prescale_factor, postscale_factor, collective, name)


def check_compression(compression: Any, collective: str, name: str | None) -> Compressor:
    """``compression`` if it is a compressor, else InvalidArgumentError."""
    if not isinstance(compression, Compressor):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: compression must be Compression.none, .fp16, "
            f".bf16 or another Compressor, got {compression!r}")
    return compression


def active_compressor(compression: Compressor, dtype: np.dtype, op: ReduceOp,
                      collective: str, name: str | None) -> Compressor | None:
    """The compressor that will encode tensors of ``dtype``, or None when they travel as
    they are; a product of compressed values is refused (a scale would be raised to the
    power of the number of ranks)."""
    if not compression.applies_to(dtype):
        return None
    if op is ReduceOp.Product:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: {compression.name} compression supports Sum, "
            f"Average, Min and Max, not Product")
    if compression.error_feedback and name is None:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: {compression.name} compression with error "
            f"feedback keeps a residual per tensor name: give the tensor a name")
    return compression


class _Plan:
    """What one kind of allreduce call needs, validated and computed once, then reused."""

    __slots__ = ("group", "settings", "op", "algorithm", "call", "finish", "combine",
                 "compressor", "wire", "layout")

    def __init__(self, array: np.ndarray, op: Any, name: str | None, prescale_factor: float,
                 postscale_factor: float, process_set: ProcessSet | None,
                 algorithm: str | None, compression: Any, collective: str,
                 memory: str | None = None):
        self.op = resolve_op(op, collective, name)
        check_reduction(array, self.op, name, prescale_factor, postscale_factor, collective)
        compression = check_compression(compression, collective, name)
        self.compressor = active_compressor(compression, array.dtype, self.op, collective,
                                            name)
        wire_dtype = self.compressor.wire_dtype if self.compressor else array.dtype
        self.group = resolve_group(process_set, collective, name)
        self.settings = current_settings()
        self.layout = layout_of(self.group, self.settings)
        self.algorithm = allreduce_algorithm(algorithm, array.size * wire_dtype.itemsize,
                                             self.group.size, self.settings, name, self.layout)
        self.call = Call(collective="allreduce", name=name, op=self.op.name,
                         dtype=array.dtype, shape=array.shape, algorithm=self.algorithm,
                         segment_bytes=None if self.algorithm == "native"
                         else self.settings.segment_bytes, compression=compression.name,
                         **layout_field(self.layout, self.algorithm),
                         **({"memory": memory} if memory else {}))
        self.finish = finisher(self.group.size if self.op is ReduceOp.Average else 1,
                               postscale_factor)
        self.combine = reducer(self.op.value, wire_dtype,
                               self.compressor.encoding if self.compressor else None)
        self.wire = np.empty(array.size, wire_dtype) if self.compressor and not memory \
            else None


_plans: dict[tuple, _Plan] = {}
_PLANS_KEPT = 1024


def _plan(array: Any, op: Any, name: str | None, prescale_factor: float,
          postscale_factor: float, process_set: ProcessSet | None, algorithm: str | None,
          compression: Any, collective: str, memory: str | None = None) -> _Plan:
    """The cached plan for this kind of call, rebuilt when settings or the world changed."""
    try:
        key = (collective, array.shape, array.dtype, op, name, prescale_factor,
               postscale_factor, process_set, algorithm, id(compression), memory)
        plan = _plans.get(key)
    except TypeError:  # an unhashable argument: validation will say what is wrong
        key, plan = None, None
    if plan is not None and plan.settings is current_settings() and \
            plan.group is resolve_group(process_set, collective, name):
        return plan
    plan = _Plan(array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
                 compression, collective, memory)
    if key is not None:
        if len(_plans) >= _PLANS_KEPT:
            _plans.clear()
        _plans[key] = plan
    return plan


def _prepare(tensor: Any, op: Any, name: str | None, prescale_factor: float,
             postscale_factor: float, process_set: ProcessSet | None, algorithm: str | None,
             compression: Any, in_place: bool) -> Callable[[], np.ndarray]:
    collective = "allreduce_" if in_place else "allreduce"
    on_device = device_tensor(tensor, collective, name, in_place)
    if on_device is not None:
        from . import _device_calls  # loads numba.cuda: only for device tensors
        return _device_calls.allreduce(on_device, op, name, prescale_factor,
                                       postscale_factor, process_set, algorithm, compression,
                                       in_place)
    array = (in_place_array if in_place else input_array)(tensor, collective, name)
    plan = _plan(array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
                 compression, collective)
    source = flat(array)
    copy_back = in_place and not array.flags.c_contiguous
    if in_place:
        output = array
        result = source
    else:
        output = np.empty(array.shape, array.dtype)
        result = output.reshape(-1)

    def run() -> np.ndarray:
        reduce_planned(plan, collective, name, source, result, prescale_factor,
                       postscale_factor)
        if copy_back:
            output[...] = result.reshape(output.shape)
        return output

    return run


def allreduce_plan(array: Any, op: Any, name: str | None, prescale_factor: float,
                   postscale_factor: float, process_set: ProcessSet | None,
                   algorithm: str | None, compression: Any, collective: str,
                   memory: str | None = None) -> _Plan:
    """Validate an allreduce of arrays like ``array`` once; run it with :func:`reduce_planned`.

    For callers that reduce the same buffers again and again (the trainer's fusion
    buckets). ``array`` needs ``shape``, ``dtype`` and ``size``; ``memory`` names where
    device tensors' data travels (a field of the call's signature). Raises what
    :func:`allreduce` raises before any communication.
    """
    return _plan(array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
                 compression, collective, memory)


def reduce_planned(plan: _Plan, collective: str, name: str | None, source: np.ndarray,
                   result: np.ndarray, prescale_factor: float, postscale_factor: float) -> None:
    """Agree with the other ranks, then reduce 1-D ``source`` into ``result`` (may be it).

    The scale factors must be those the plan was made with.
    """
    if plan.compressor is not None:
        _reduce_compressed(plan, collective, name, source, result, prescale_factor,
                           postscale_factor)
    elif plan.algorithm == "recursive_doubling" and source.nbytes <= PAYLOAD_CAPACITY:
        agree(plan.group, plan.call, payload=source, combine=plan.combine, result=result,
              prescale_factor=prescale_factor)
        if plan.finish is not None:
            plan.finish(result)
    else:
        agree(plan.group, plan.call)
        start = _prescaled(source, result, prescale_factor)
        reduce_flat(plan.group, plan.algorithm, start, result, plan.op, plan.combine,
                    plan.finish, plan.settings.segment_bytes, layout=plan.layout)


def _reduce_compressed(plan: _Plan, collective: str, name: str | None, source: np.ndarray,
                       result: np.ndarray, prescale_factor: float,
                       postscale_factor: float) -> None:
    """Encode, reduce the wire buffer, decode: scales fused into the casts."""
    compressor, group, wire = plan.compressor, plan.group, plan.wire
    local_max, nonfinite = abs_max(source) if compressor.needs_range else (0.0, False)
    value_range = agree(group, plan.call,
                        local_range=(local_max * abs(prescale_factor), nonfinite))
    if nonfinite:
        warn_nonfinite(group, value_range, compressor, collective, name)
    scale = compressor.scale_for(value_range.abs_max, group.size)
    divisor = group.size if plan.op is ReduceOp.Average else 1
    if plan.algorithm in HIERARCHICAL:
        start = _prescaled(source, result, prescale_factor)
        reduce_hierarchical(group, plan.algorithm, plan.layout, start, result, plan.op,
                            plan.settings.segment_bytes,
                            _hierarchical.Wire(compressor, wire, plan.combine, scale,
                                               postscale_factor / (scale * divisor), name))
        return
    with phase("compress", bytes=source.nbytes, format=compressor.name):
        compressor.encode(source, wire, scale * prescale_factor, key=name)
    reduce_flat(group, plan.algorithm, wire, wire, plan.op, plan.combine, None,
                plan.settings.segment_bytes, compressor.encoding)
    with phase("decompress", bytes=result.nbytes, format=compressor.name):
        compressor.decode(wire, result, postscale_factor / (scale * divisor))


def warn_nonfinite(group: Group, value_range: ValueRange, compressor: Compressor,
                   collective: str, name: str | None) -> None:
    """Say which ranks fed inf or NaN into a compressed reduction (they reach the result)."""
    lowest, highest = (group.world_ranks[r] for r in value_range.nonfinite_ranks)
    ranks = f"rank {lowest}" if lowest == highest else \
        f"ranks {lowest} and {highest} (and perhaps ranks between)"
    warnings.warn(f"{subject(collective, name)}: inf or NaN in the input of {ranks}; "
                  f"{compressor.name} compression passes them on to the result",
                  NonFiniteWarning, stacklevel=2)


def reduce_flat(group: Group, algorithm: str, source: np.ndarray, result: np.ndarray,
                op: ReduceOp, combine: Combine, finish: Finish | None, segment_bytes: int,
                encoding: str | None = None, layout: Layout | None = None) -> None:
    """The data phase of an allreduce, after agreement: 1-D ``source`` into ``result``.

    ``combine`` reduces two ranks' values (see :func:`ringtrain.kernels.reducer`);
    ``encoding`` names a 16-bit float format stored as uint16; ``layout`` is the one
    the call agreed on (the hierarchical algorithms need it).
    """
    if group.size == 1 or source.size == 0:
        if result is not source:
            result[:] = source
    elif algorithm in HIERARCHICAL:
        hierarchy = hierarchy_for(group, layout or layout_of(group, current_settings()))
        _hierarchical_schedule(algorithm)(hierarchy, source, result, combine, finish,
                                          segment_bytes)
        return
    elif algorithm == "ring":
        _ring.allreduce(group, source, result, combine, finish, segment_bytes)
        return
    elif algorithm == "recursive_doubling":
        if result is not source:
            result[:] = source
        with phase("recursive doubling", bytes=result.nbytes):
            _recursive_doubling.allreduce(group, result, combine, segment_bytes)
    elif encoding is not None or result.dtype == np.float16:
        send = MPI.IN_PLACE if result is source else [source.view(np.uint16), MPI.UINT16_T]
        with phase("MPI allreduce", bytes=result.nbytes):
            group.comm.Allreduce(send, [result.view(np.uint16), MPI.UINT16_T],
                                 sixteen_bit_op(op, encoding))
    else:
        send = MPI.IN_PLACE if result is source else source
        with phase("MPI allreduce", bytes=result.nbytes):
            group.comm.Allreduce(send, result, MPI_OPS[op])
    if finish is not None:
        finish(result)


def reduce_hierarchical(group: Group, algorithm: str, layout: Layout, source: np.ndarray,
                        result: np.ndarray, op: ReduceOp, segment_bytes: int,
                        wire: _hierarchical.Wire) -> None:
    """A compressed hierarchical allreduce after agreement: full precision inside the
    nodes, ``wire``'s format between them; ``wire`` applies the scales."""
    if source.size == 0 or group.size == 1:
        if result is not source:
            result[:] = source
        np.multiply(result, wire.decode_scale * wire.encode_scale, out=result)
        return
    _hierarchical_schedule(algorithm)(hierarchy_for(group, layout), source, result,
                                      reducer(op.value, source.dtype), None, segment_bytes,
                                      wire)


def _hierarchical_schedule(algorithm: str) -> Callable[..., None]:
    """The function of a hierarchical algorithm (``hierarchical`` or ``node_leader``)."""
    return _hierarchical.allreduce if algorithm == "hierarchical" else \
        _hierarchical.leader_allreduce


def _prescaled(source: np.ndarray, result: np.ndarray, factor: float) -> np.ndarray:
    """What the reduction starts from: ``source``, or ``source * factor`` in ``result``."""
    if factor == 1.0:
        return source
    np.multiply(source, factor, out=result)
    return result


def layout_field(layout: Layout, algorithm: str) -> dict[str, str]:
    """The call signature's ``layout`` field, for the algorithms that depend on it."""
    return {"layout": layout.describe()} if algorithm in HIERARCHICAL else {}


def finisher(divisor: int, postscale_factor: float) -> Finish | None:
    """The in-place step that turns a sum into the result: divide for Average, then scale."""
    if divisor == 1 and postscale_factor == 1.0:
        return None

    def finish(values: np.ndarray) -> None:
        if divisor != 1:
            np.divide(values, divisor, out=values)
        if postscale_factor != 1.0:
            np.multiply(values, postscale_factor, out=values)

    return finish


class GroupedCall:
    """A grouped allreduce of arrays like ``arrays`` (anything with ``shape`` and
    ``dtype``), validated, and its signature.

    Attributes:
        op, compression, group, settings, layout: the call's, resolved.
        members: the indices of the arrays of each dtype, in order.
        fusion: the fusion layout of each dtype's arrays.
        compressors: the compressor that encodes each dtype, or None.
        chosen: the algorithm of each dtype's fused buffer (``algorithm`` for all when
            given, else as ``auto`` or the requested one chooses by size).
        call: the signature the ranks compare, with ``memory`` when given.

    Raises:
        What :func:`grouped_allreduce` raises before any communication.
    """

    def __init__(self, arrays: Sequence[Any], op: Any, name: str | None,
                 prescale_factor: float, postscale_factor: float,
                 process_set: ProcessSet | None, algorithm: str | None, compression: Any,
                 collective: str, memory: str | None = None,
                 forced_algorithm: str | None = None):
        self.op = resolve_op(op, collective, name)
        for array in arrays:
            check_reduction(array, self.op, name, prescale_factor, postscale_factor,
                            collective)
        self.compression = check_compression(compression, collective, name)
        self.group = resolve_group(process_set, collective, name)
        self.settings = current_settings()
        self.layout = layout_of(self.group, self.settings)
        self.members: dict[np.dtype, list[int]] = {}
        for index, array in enumerate(arrays):
            self.members.setdefault(np.dtype(array.dtype), []).append(index)
        self.fusion = {dtype: FusionLayout.of([arrays[i] for i in members])
                       for dtype, members in self.members.items()}
        self.compressors = {dtype: active_compressor(self.compression, dtype, self.op,
                                                     collective, name)
                            for dtype in self.members}
        self.chosen = {dtype: forced_algorithm or allreduce_algorithm(
            algorithm, self._wire_bytes(dtype), self.group.size, self.settings, name,
            self.layout) for dtype in self.members}
        hierarchical = next((c for c in self.chosen.values() if c in HIERARCHICAL), "")
        self.call = Call(collective="grouped_allreduce", name=name, op=self.op.name,
                         dtype=tuple(np.dtype(a.dtype) for a in arrays),
                         shape=tuple(tuple(a.shape) for a in arrays),
                         algorithm=tuple(self.chosen[np.dtype(a.dtype)] for a in arrays),
                         segment_bytes=self.settings.segment_bytes,
                         compression=self.compression.name,
                         **({"memory": memory} if memory else {}),
                         **layout_field(self.layout, hierarchical))

    def _wire_bytes(self, dtype: np.dtype) -> int:
        """Bytes on the wire of one dtype's fused buffer."""
        compressor = self.compressors[dtype]
        return self.fusion[dtype].total_size * \
            (compressor.wire_dtype.itemsize if compressor else dtype.itemsize)


class _Fused:
    """One dtype's share of a grouped allreduce: its tensors, layout and buffers."""

    def __init__(self, members: list[int], layout: FusionLayout,
                 compressor: Compressor | None):
        self.members = members
        self.layout = layout
        self.buffer = self.layout.empty_buffer()
        self.compressor = compressor
        self.wire = np.empty(self.layout.total_size, compressor.wire_dtype) \
            if compressor else self.buffer


def _prepare_grouped(tensors: Sequence[Any], op: Any, name: str | None,
                     prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet | None, algorithm: str | None,
                     compression: Any, in_place: bool) -> Callable[[], list[np.ndarray]]:
    collective = "grouped_allreduce_" if in_place else "grouped_allreduce"
    on_device = [device_tensor(t, collective, name, in_place) for t in tensors]
    if any(t is not None for t in on_device):
        if not all(on_device):
            raise InvalidArgumentError(
                f"{subject(collective, name)}: some tensors are in GPU memory and some in "
                f"host memory; group them separately")
        from . import _device_calls  # loads numba.cuda: only for device tensors
        return _device_calls.grouped_allreduce(on_device, op, name, prescale_factor,
                                               postscale_factor, process_set, algorithm,
                                               compression, in_place)
    convert = in_place_array if in_place else input_array
    arrays = [convert(t, collective, name) for t in tensors]
    grouped = GroupedCall(arrays, op, name, prescale_factor, postscale_factor, process_set,
                          algorithm, compression, collective)
    op, compression, group, settings, layout, chosen, call = (
        grouped.op, grouped.compression, grouped.group, grouped.settings, grouped.layout,
        grouped.chosen, grouped.call)
    fused = {dtype: _Fused(members, grouped.fusion[dtype], grouped.compressors[dtype])
             for dtype, members in grouped.members.items()}
    divisor = group.size if op is ReduceOp.Average else 1
    compressed = [part for part in fused.values() if part.compressor is not None]
    ranged = any(part.compressor.needs_range for part in compressed)

    def run() -> list[np.ndarray]:
        local_max, nonfinite = 0.0, False
        for part in fused.values():
            pack(part.layout, [arrays[i] for i in part.members], part.buffer,
                 prescale_factor)
            if part.compressor is not None and part.compressor.needs_range:
                part_max, part_nonfinite = abs_max(part.buffer)
                local_max, nonfinite = max(local_max, part_max), nonfinite or part_nonfinite
        value_range = agree(group, call,
                            local_range=(local_max, nonfinite) if compressed else None)
        if nonfinite:
            warn_nonfinite(group, value_range, compression, collective, name)
        outputs: list[np.ndarray] = list(arrays) if in_place else [None] * len(arrays)
        for dtype, part in fused.items():
            scale, unpack_scale = 1.0, postscale_factor
            if part.compressor is not None:
                if ranged:
                    scale = part.compressor.scale_for(value_range.abs_max, group.size)
                if chosen[dtype] in HIERARCHICAL:
                    reduce_hierarchical(
                        group, chosen[dtype], layout, part.buffer, part.buffer, op,
                        settings.segment_bytes,
                        _hierarchical.Wire(part.compressor, part.wire,
                                           reducer(op.value, part.wire.dtype,
                                                   part.compressor.encoding),
                                           scale, postscale_factor / (scale * divisor), name))
                    _unpack(part, arrays, outputs, in_place, 1.0)
                    continue
                part.compressor.encode(part.buffer, part.wire, scale, key=name)
            encoding = part.compressor.encoding if part.compressor else None
            finish = finisher(divisor, 1.0) if part.compressor is None else None
            reduce_flat(group, chosen[dtype], part.wire, part.wire, op,
                        reducer(op.value, part.wire.dtype, encoding), finish,
                        settings.segment_bytes, encoding, layout)
            if part.compressor is not None:
                part.compressor.decode(part.wire, part.buffer,
                                       postscale_factor / (scale * divisor))
                unpack_scale = 1.0
            _unpack(part, arrays, outputs, in_place, unpack_scale)
        return outputs

    return run


def _unpack(part: _Fused, arrays: list[np.ndarray], outputs: list[np.ndarray],
            in_place: bool, scale: float) -> None:
    """Hand out one dtype's reduced buffer: into the inputs, or as views of it."""
    for index, view in zip(part.members, part.layout.views(part.buffer)):
        if in_place:
            scale_into(view, scale, arrays[index])
        else:  # the buffer is this call's own: its views are the results
            scale_into(view, scale, view)
            outputs[index] = view
