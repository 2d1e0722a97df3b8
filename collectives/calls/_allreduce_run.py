"""Running planned allreduces: the call validated into its body; agree with the other
ranks, then scale, compress, reduce and unpack, the same steps for host arrays and device
tensors (only the memory, :mod:`..memory._memory`, that moves and reduces a flat buffer
differs); the runs of a kept plan; the call forms declared (:data:`FORMS`,
:data:`GROUPED_FORMS`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...kernels import Compressor, FusionLayout, abs_max, pack, reducer, unpack
from ..agreement._agreement import agree
from ..agreement._call import ValueRange
from ..algorithms._adasum import working_dtype
from ..algorithms._data_phase import hierarchical_wire, reduce_hierarchical
from ..algorithms._selection import ADASUM
from ..base._buffers import device_tensor
from ..base._checks import flat, in_place_array, input_array
from ..base._finishing import finisher
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._result_pool import RESULTS
from ..base._tracing import phase
from ..errors import InvalidArgumentError, NonFiniteWarning, subject
from ..memory._memory import HOST, HostMemory
from ..memory._placement import memory_for
from ..world._process_sets import ProcessSet
from ..world._topology import HIERARCHICAL, NodeLayout
from ._allreduce_plan import (AllreducePlan, GroupedCall, allreduce_plan,
                              kept_allreduce_plan)
from ._forms import CallForms


def reduce_planned(plan: AllreducePlan, collective: str, name: str | None, source: Any,
                   result: Any, prescale_factor: float, postscale_factor: float,
                   ordinal: int = 0) -> None:
    """Agree with the other ranks, then reduce 1-D ``source`` into ``result`` (may be it).

    Host arrays, or device memory on GPU ``ordinal`` (made current by the caller) as the
    plan's ``memory`` says. The scale factors must be those the plan was made with.
    """
    if plan.carried is not None:
        plan.carried.run(source, result, prescale_factor)
        return
    memory = memory_for(plan.memory, ordinal)
    if plan.compressor is not None:
        local_max, nonfinite = abs_max(source) if plan.compressor.needs_range \
            else (0.0, False)
        value_range = agree(plan.group, plan.call,
                            local_range=(local_max * abs(prescale_factor), nonfinite))
        if nonfinite:
            warn_nonfinite(plan.group, value_range, plan.compressor, collective, name)
        reduce_compressed(memory, plan.group, plan.algorithm, plan.layout, plan.compressor,
                          source, result, prescale_factor, postscale_factor, plan.op,
                          value_range, plan.settings.segment_bytes, name, plan.wire)
    elif plan.checked is not None and prescale_factor == 1.0:
        plan.checked.run(source, result)
        if plan.finish_checked is not None:
            plan.finish_checked(result)
    else:
        agree(plan.group, plan.call)
        start = memory.scaled(source, prescale_factor, result)
        memory.reduce(plan.group, plan.algorithm, start, result, plan.op, plan.combine,
                      plan.finish, plan.settings.segment_bytes, None, plan.layout)


def reduce_compressed(memory: HostMemory, group: Group, algorithm: str, layout: NodeLayout,
                      compressor: Compressor, source: Any, result: Any,
                      prescale_factor: float, postscale_factor: float, op: ReduceOp,
                      value_range: ValueRange, segment_bytes: int, name: str | None,
                      wire: Any = None) -> None:
    """A compressed allreduce after agreement: encode (scale and prescale fused into the
    cast), reduce the wire buffer, decode (postscale and 1/N fused).

    The hierarchical algorithms on host memory compress only between the nodes.
    ``wire`` is a buffer kept for the call (host), else one is taken from ``memory``.
    """
    scale = compressor.scale_for(value_range.abs_max, group.size) \
        if compressor.needs_range else 1.0
    divisor = group.size if op is ReduceOp.Average else 1
    decode_scale = postscale_factor / (scale * divisor)
    size = memory.elements(source)
    wire = memory.scratch("wire", size, compressor.wire_dtype, wire)
    if algorithm in HIERARCHICAL and memory is HOST:
        start = memory.scaled(source, prescale_factor, result)
        reduce_hierarchical(group, algorithm, layout, start, result, op, segment_bytes,
                            hierarchical_wire(compressor, wire, op, scale, decode_scale,
                                              name))
        return
    with phase("compress", bytes=size * 4, format=compressor.name, **memory.phase_args):
        compressor.encode(source, wire, scale * prescale_factor, key=name)
        memory.settled(wire)
    memory.reduce(group, algorithm, wire, wire, op,
                  reducer(op.value, compressor.wire_dtype, compressor.encoding), None,
                  segment_bytes, compressor.encoding, layout)
    with phase("decompress", bytes=size * 4, format=compressor.name, **memory.phase_args):
        compressor.decode(wire, result, decode_scale)
        memory.settled(result)


def reduce_fused(plan: AllreducePlan, collective: str, name: str | None,
                 layout: FusionLayout, tensors: Sequence[Any], buffer: Any,
                 prescale_factor: float, postscale_factor: float, ordinal: int = 0) -> None:
    """Allreduce ``tensors`` in place through their fusion ``buffer`` (1-D, ``layout``'s
    size): pack them with the prescale fused into the copy, reduce the buffer as
    ``plan`` says (made for such a buffer, with ``postscale_factor``), unpack."""
    memory = memory_for(plan.memory, ordinal)
    with phase("pack", bytes=layout.nbytes, tensors=len(tensors), **memory.phase_args):
        pack(layout, tensors, buffer, prescale_factor)
    reduce_planned(plan, collective, name, buffer, buffer, 1.0, postscale_factor, ordinal)
    with phase("unpack", bytes=layout.nbytes, tensors=len(tensors), **memory.phase_args):
        unpack(layout, buffer, tensors)
        memory.settled(buffer)


def reduce_grouped(grouped: GroupedCall, collective: str, name: str | None,
                   sources: Sequence[Any], targets: Sequence[Any] | None,
                   prescale_factor: float, postscale_factor: float,
                   ordinal: int = 0) -> list[Any]:
    """Run a grouped allreduce: one fused buffer per dtype, packed (prescale fused),
    one agreement for all, each buffer reduced, unpacked (postscale fused).

    ``sources`` are the tensors' memory; the results are unpacked into ``targets``, or,
    when it is None (host arrays out of place), left in the fused buffers, whose views
    are the results. Returns where the results are, in order.
    """
    memory = memory_for(grouped.memory, ordinal)
    group, op = grouped.group, grouped.op
    divisor = group.size if op is ReduceOp.Average else 1
    buffers, local_max, nonfinite = {}, 0.0, False
    for dtype, members in grouped.members.items():
        fusion, compressor = grouped.fusion[dtype], grouped.compressors[dtype]
        kept = fusion.empty_buffer() if memory is HOST else None
        buffer = buffers[dtype] = memory.scratch("fusion", fusion.total_size, dtype, kept)
        with phase("pack", bytes=fusion.nbytes, tensors=len(members), **memory.phase_args):
            pack(fusion, [sources[i] for i in members], buffer, prescale_factor)
        if compressor is not None and compressor.needs_range:
            part_max, part_nonfinite = abs_max(buffer)
            local_max, nonfinite = max(local_max, part_max), nonfinite or part_nonfinite
    compressed = any(c is not None for c in grouped.compressors.values())
    value_range = agree(group, grouped.call,
                        local_range=(local_max, nonfinite) if compressed else None)
    if nonfinite:
        warn_nonfinite(group, value_range, grouped.compression, collective, name)
    results: list[Any] = [None] * len(sources) if targets is None else list(targets)
    for dtype, members in grouped.members.items():
        fusion, compressor, buffer = grouped.fusion[dtype], grouped.compressors[dtype], \
            buffers[dtype]
        unpack_scale = postscale_factor
        if compressor is not None:
            reduce_compressed(memory, group, grouped.chosen[dtype], grouped.layout,
                              compressor, buffer, buffer, 1.0, postscale_factor, op,
                              value_range, grouped.settings.segment_bytes, name)
            unpack_scale = 1.0
        elif op is ReduceOp.Adasum:  # each tensor (its zero padding after it) on its own
            memory.reduce(group, ADASUM, buffer, buffer, op, None,
                          finisher(1, postscale_factor, working_dtype(dtype)),
                          grouped.settings.segment_bytes, None, grouped.layout,
                          [*fusion.offsets.tolist(), fusion.total_size])
            unpack_scale = 1.0  # applied before the result was rounded
        else:
            memory.reduce(group, grouped.chosen[dtype], memory.settled(buffer), buffer, op,
                          reducer(op.value, dtype), finisher(divisor, 1.0, dtype),
                          grouped.settings.segment_bytes, None, grouped.layout)
        if targets is None:
            for index, view in zip(members, fusion.views(buffer)):
                results[index] = view
            if unpack_scale == 1.0:
                continue
        with phase("unpack", bytes=fusion.nbytes, tensors=len(members), **memory.phase_args):
            unpack(fusion, buffer, [results[i] for i in members], unpack_scale)
            memory.settled(buffer)
    return results


def warn_nonfinite(group: Group, value_range: ValueRange, compressor: Compressor,
                   collective: str, name: str | None) -> None:
    """Say which ranks fed inf or NaN into a compressed reduction (they reach the result)."""
    lowest, highest = (group.world_ranks[r] for r in value_range.nonfinite_ranks)
    ranks = f"rank {lowest}" if lowest == highest else \
        f"ranks {lowest} and {highest} (and perhaps ranks between)"
    warnings.warn(f"{subject(collective, name)}: inf or NaN in the input of {ranks}; "
                  f"{compressor.name} compression passes them on to the result",
                  NonFiniteWarning, stacklevel=2)


def prepare(collective: str, tensor: Any, name: str | None, process_set: ProcessSet | None,
            op: Any, prescale_factor: float, postscale_factor: float, algorithm: str | None,
            compression: Any) -> Callable[[], Any]:
    """Validate an allreduce of ``tensor`` (``collective`` ``allreduce_``: in place) and
    return its body (run it to reduce)."""
    in_place = collective == "allreduce_"
    on_device = device_tensor(tensor, collective, name, in_place)
    if on_device is not None:
        plan = allreduce_plan(on_device, op, name, prescale_factor, postscale_factor,
                              process_set, algorithm, compression, collective, on_device=True)
        memory = memory_for(plan.memory, on_device.device)

        def run_on_device() -> Any:
            with memory.entered(on_device):
                out = on_device.owner if in_place else memory.new(on_device, on_device.shape)
                reduce_planned(plan, collective, name, on_device.memory,
                               on_device.memory if in_place else out, prescale_factor,
                               postscale_factor, on_device.device)
                return out

        return run_on_device
    array = (in_place_array if in_place else input_array)(tensor, collective, name)
    plan = allreduce_plan(array, op, name, prescale_factor, postscale_factor, process_set,
                          algorithm, compression, collective)
    source = flat(array)
    copy_back = in_place and not array.flags.c_contiguous
    if in_place:
        output = array
        result = source
    else:
        output = RESULTS.empty(array.shape, array.dtype)
        result = output.reshape(-1)

    def run() -> np.ndarray:
        reduce_planned(plan, collective, name, source, result, prescale_factor,
                       postscale_factor)
        if copy_back:
            output[...] = result.reshape(output.shape)
        return output

    return run


def _planned(plan: AllreducePlan, collective: str, name: str | None, tensor: np.ndarray,
             output: np.ndarray, arguments: tuple) -> None:
    """The run of a kept plan (see :class:`CallForms`): reduce C-contiguous ``tensor``
    into ``output`` (may be it)."""
    source = tensor.reshape(-1)
    reduce_planned(plan, collective, name, source,
                   source if output is tensor else output.reshape(-1), arguments[1],
                   arguments[2])


def _carried(plan: AllreducePlan, collective: str, name: str | None, tensor: np.ndarray,
             output: np.ndarray, arguments: tuple) -> None:
    """The run of a kept plan whose data rides in the agreement (see :class:`CallForms`)."""
    plan.carried.run(tensor, output, arguments[1])


def prepare_grouped(collective: str, tensors: Sequence[Any], name: str | None,
                    process_set: ProcessSet | None, op: Any, prescale_factor: float,
                    postscale_factor: float, algorithm: str | None,
                    compression: Any) -> Callable[[], list[Any]]:
    """Validate a grouped allreduce of ``tensors`` (``collective``
    ``grouped_allreduce_``: in place) and return its body."""
    in_place = collective == "grouped_allreduce_"
    arguments = (op, name, prescale_factor, postscale_factor, process_set, algorithm,
                 compression, collective)
    on_device = [device_tensor(t, collective, name, in_place) for t in tensors]
    if any(t is not None for t in on_device):
        if not all(on_device):
            raise InvalidArgumentError(
                f"{subject(collective, name)}: some tensors are in GPU memory and some in "
                f"host memory; group them separately")
        if len({t.device for t in on_device}) > 1:
            raise InvalidArgumentError(
                f"{subject(collective, name)}: the tensors are on different GPUs "
                f"({sorted({t.device for t in on_device})}); group the tensors of one GPU")
        grouped = GroupedCall(on_device, *arguments, on_device=True)
        ordinal = on_device[0].device
        memory = memory_for(grouped.memory, ordinal)

        def run_on_device() -> list[Any]:
            with memory.entered(*on_device):
                sources = [t.memory for t in on_device]
                targets = sources if in_place else [memory.new(t, t.shape) for t in on_device]
                reduce_grouped(grouped, collective, name, sources, targets, prescale_factor,
                               postscale_factor, ordinal)
                return [t.owner for t in on_device] if in_place else targets

        return run_on_device
    convert = in_place_array if in_place else input_array
    arrays = [convert(t, collective, name) for t in tensors]
    grouped = GroupedCall(arrays, *arguments)
    return lambda: reduce_grouped(grouped, collective, name, arrays,
                                  arrays if in_place else None, prescale_factor,
                                  postscale_factor)


FORMS = CallForms("allreduce", prepare, kept_allreduce_plan, _planned, _carried,
                  planned_output=RESULTS.empty, carried_output=np.empty)
GROUPED_FORMS = CallForms("grouped_allreduce", prepare_grouped)
