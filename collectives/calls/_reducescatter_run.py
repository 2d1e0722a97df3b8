"""Running planned reduce-scatters: the call validated into its body, the data phase
after the agreement (uncompressed, compressed, or the whole array by recursive doubling),
and the runs of a kept plan; the call forms declared (:data:`FORMS`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...kernels import abs_max, encoding_of
from ...kernels.host import scale_into
from ...kernels.reduction import Combine
from ..agreement._agreement import agree
from ..agreement._call import Call
from ..algorithms import _hierarchical, _native
from ..algorithms._compiled_ring import reduce_scatter_by_ring
from ..algorithms._data_phase import recursive_doubling_allreduce
from ..base._buffers import device_tensor
from ..base._checks import check_compression, flat, input_array
from ..base._finishing import Finisher
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._result_pool import RESULTS
from ..config import current_settings
from ..memory._memory import AWARE, HOST, goes_direct
from ..memory._placement import memory_for, staged
from ..world._process_sets import ProcessSet
from ..world._topology import hierarchy_for
from ._allreduce_run import warn_nonfinite
from ._forms import CallForms
from ._reducescatter_plan import (ReducescatterPlan, kept_reducescatter_plan,
                                  reducescatter_plan)


def _prepare(collective: str, tensor: Any, name: str | None, process_set: ProcessSet | None,
             op: Any, prescale_factor: float, postscale_factor: float, algorithm: str | None,
             compression: Any, splits: Any) -> Callable[[], Any]:
    on_device = device_tensor(tensor, collective, name)
    if on_device is not None and (
            check_compression(compression, "reducescatter", name).applies_to(on_device.dtype)
            or not goes_direct(algorithm, current_settings().reducescatter_algorithm,
                               on_device.dtype)):
        return staged(on_device, False, lambda array: _prepare(
            collective, array, name, process_set, op, prescale_factor, postscale_factor,
            algorithm, compression, splits))
    array = on_device if on_device is not None else input_array(tensor, collective, name)
    plan = reducescatter_plan(array, op, name, prescale_factor, postscale_factor,
                              process_set, algorithm, compression, splits,
                              on_device is not None)
    if plan.compressor is not None:
        flat_array = flat(array)
        return lambda: _compressed(plan, flat_array, name, prescale_factor, postscale_factor)
    if on_device is not None:
        memory, source = memory_for(AWARE, on_device.device), on_device.memory
    else:
        memory, source = HOST, flat(array)
    if plan.carried is not None:
        return lambda: _carried(plan, source, prescale_factor)

    def run() -> Any:
        with memory.entered(*([] if on_device is None else [on_device])):
            return _reduced(plan, memory, source, array, prescale_factor)

    return run


def _reduced(plan: ReducescatterPlan, memory: Any, source: Any, like: Any,
             prescale_factor: float) -> Any:
    """An uncompressed reduce-scatter as ``plan`` says, once checked: agree, reduce flat
    ``source`` (host, or device memory as ``memory`` takes it) and return this rank's
    share, a new array of ``like``'s kind."""
    group, chosen, segment_bytes = plan.group, plan.chosen, plan.settings.segment_bytes
    if chosen == "recursive_doubling":
        return _by_recursive_doubling(group, plan.call, source, prescale_factor, plan.combine,
                                      plan.finish, plan.bounds[group.rank], plan.share_shape,
                                      segment_bytes)
    checked = plan.checked if memory is HOST and prescale_factor == 1.0 else None
    if checked is None:
        agree(group, plan.call)
    start = source
    if prescale_factor != 1.0:
        start = memory.scaled(source, prescale_factor,
                              memory.scratch("prescaled", like.size, like.dtype))
    output = memory.new(like, plan.share_shape)
    result = output.reshape(-1) if memory is HOST else output
    if checked is not None:
        checked.run(start, result)
        memory.finish(output, plan.finish_checked)
        return output
    if chosen == "ring" and group.size > 1:
        reduce_scatter_by_ring(group, memory.for_mpi(start), memory.for_mpi(result),
                               plan.bounds, plan.combine, plan.finish, segment_bytes)
        return output
    if chosen == "hierarchical" and group.size > 1:
        _hierarchical.reduce_scatter(hierarchy_for(group, plan.layout), memory.for_mpi(start),
                                     memory.for_mpi(result), plan.bounds, plan.combine,
                                     plan.finish, segment_bytes)
        return output
    elif group.size == 1:
        memory.copy(start, result)
    elif like.size:
        _native.reducescatter(group, memory.for_mpi(start), memory.for_mpi(result),
                              plan.counts, plan.op, like.size * like.dtype.itemsize,
                              encoding_of(like.dtype), **memory.phase_args)
    memory.finish(output, plan.finish)
    return output


def _compressed(plan: ReducescatterPlan, source: np.ndarray, name: str | None,
                prescale_factor: float, postscale_factor: float) -> np.ndarray:
    """A reduce-scatter of host float32 ``source`` (flat) through a 16-bit wire, by the
    ring: the steps of a compressed allreduce (encode with the scale agreed over all
    ranks, reduce the wire, decode with the postscale and 1/N fused), on this rank's
    share only."""
    group, compressor, bounds = plan.group, plan.compressor, plan.bounds
    local_max, nonfinite = abs_max(source) if compressor.needs_range else (0.0, False)
    value_range = agree(group, plan.call,
                        local_range=(local_max * abs(prescale_factor), nonfinite))
    if nonfinite:
        warn_nonfinite(group, value_range, compressor, "reducescatter", name)
    scale = compressor.scale_for(value_range.abs_max, group.size) \
        if compressor.needs_range else 1.0
    divisor = group.size if plan.op is ReduceOp.Average else 1
    wire = HOST.scratch("wire", source.size, compressor.wire_dtype)
    output = RESULTS.empty(plan.share_shape, source.dtype)
    decode_scale = postscale_factor / (scale * divisor)
    if plan.chosen == "hierarchical" and group.size > 1:
        # Summed in full precision inside the nodes; only what crosses them is cast.
        _hierarchical.reduce_scatter(
            hierarchy_for(group, plan.layout), source, output.reshape(-1), bounds,
            plan.node_combine, None, plan.settings.segment_bytes,
            _hierarchical.Wire(compressor, wire, plan.combine, scale * prescale_factor,
                               decode_scale, name))
        return output
    compressor.encode(source, wire, scale * prescale_factor, key=name)
    own = bounds[group.rank + 1] - bounds[group.rank]
    reduced = HOST.scratch("wire share", own, compressor.wire_dtype)
    if group.size > 1:
        reduce_scatter_by_ring(group, wire, reduced, bounds, plan.combine, None,
                               plan.settings.segment_bytes)
    else:
        reduced[:] = wire
    compressor.decode(reduced, output.reshape(-1), decode_scale)
    return output


def _carried(plan: ReducescatterPlan, array: np.ndarray, prescale_factor: float
             ) -> np.ndarray:
    """A small reduce-scatter in the agreement's own messages: the whole array reduced
    (and finished), this rank's share of it returned (a view of the new array)."""
    reduced = np.empty(array.size, array.dtype)
    plan.carried.run(array, reduced, prescale_factor)
    return np.ndarray(plan.share_shape, reduced.dtype, reduced, plan.share_offset)


def _by_recursive_doubling(group: Group, call: Call, source: np.ndarray,
                           prescale_factor: float, combine: Combine, finish: Finisher | None,
                           start: int, shape: tuple[int, ...],
                           segment_bytes: int) -> np.ndarray:
    """A reduce-scatter as an allreduce by recursive doubling of which this rank keeps
    its share (of ``shape``, from element ``start`` of the flat array), above the
    agreement's payload."""
    agree(group, call)
    reduced = np.empty_like(source)
    scale_into(source, prescale_factor, reduced)
    recursive_doubling_allreduce(group, reduced, combine, segment_bytes)
    output = RESULTS.empty(shape, source.dtype)
    share = reduced[start:start + output.size]
    if finish is None:
        np.copyto(output.reshape(-1), share)
    else:
        finish.into(share, output.reshape(-1))
    return output


def _planned(plan: ReducescatterPlan, collective: str, name: str | None, tensor: np.ndarray,
             output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept uncompressed plan (see :class:`CallForms`): this rank's share."""
    return _reduced(plan, HOST, tensor.reshape(-1), tensor, arguments[1])


def _carried_run(plan: ReducescatterPlan, collective: str, name: str | None,
                 tensor: np.ndarray, output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan whose data rides in the agreement (see :class:`CallForms`):
    this rank's share."""
    return _carried(plan, tensor, arguments[1])


FORMS = CallForms("reducescatter", _prepare, kept_reducescatter_plan, _planned, _carried_run)
