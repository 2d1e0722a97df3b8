"""Running planned allreduces: agree with the other ranks, then scale, compress, reduce
and unpack, the same steps for host arrays and device tensors; only the memory
(:mod:`._memory`) that moves and reduces a flat buffer differs."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any


from ...kernels import Compressor, FusionLayout, abs_max, pack, reducer, unpack
from ..agreement._agreement import agree
from ..agreement._call import ValueRange
from ..algorithms._adasum import working_dtype
from ..algorithms._data_phase import hierarchical_wire, reduce_hierarchical
from ..algorithms._selection import ADASUM
from ..base._finishing import finisher
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._tracing import phase
from ..errors import NonFiniteWarning, subject
from ..memory._memory import HOST, HostMemory
from ..memory._placement import memory_for
from ..world._topology import HIERARCHICAL, NodeLayout
from ._plans import AllreducePlan, GroupedCall


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
