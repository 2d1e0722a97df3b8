"""reducescatter: the reduction over all ranks, each rank keeping its share of axis 0."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from ..kernels import Compression, Compressor, abs_max, encoding_of, reducer
from ..kernels.host import scale_into
from ..kernels.reduction import Combine
from .agreement._agreement import agree
from .agreement._call import PAYLOAD_CAPACITY, Call
from .agreement._carried import CarriedReduction
from .agreement._checked import CheckedCollective, checked_collective, checked_ring
from .algorithms import _hierarchical, _native, _ring
from .algorithms._native import MPI_OPS
from .algorithms._selection import reducescatter_algorithm
from .base._buffers import device_tensor
from .base._checks import (active_compressor, check_compression, check_reduction, check_splits,
                           check_splittable, flat, input_array)
from .base._executor import Handle
from .base._finishing import Finisher, finisher
from .base._group import Group
from .base._ops import ReduceOp, resolve_op
from .base._result_pool import RESULTS
from .calls._allreduce_run import warn_nonfinite
from .calls._forms import CallForms
from .config import current_settings
from .errors import InvalidArgumentError, subject
from .memory._memory import AWARE, HOST, goes_direct
from .memory._placement import memory_for, staged
from .transport import _recursive_doubling
from .transport._compiled_checked import REDUCE_SCATTER
from .world._plan_cache import PlanCache
from .world._process_sets import ProcessSet, resolve_group
from .world._topology import NodeLayout, hierarchy_for, layout_of


def reducescatter(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set: ProcessSet | None = None, *,
                  algorithm: str | None = None,
                  compression: Compressor = Compression.none,
                  splits: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Reduce ``tensor`` over all ranks and return this rank's share of axis 0.

    Axis 0 is split as ``splits`` says, else as evenly as possible, the earlier ranks
    taking the extra rows (the ``numpy.array_split`` convention): with 10 rows on 4 ranks,
    ranks get 3, 3, 2, 2.

    Args:
        tensor: this rank's array, at least 1-D; same shape and dtype on every rank.
        op, name, prescale_factor, postscale_factor, process_set: as for
            :func:`~ringtrain.allreduce`.
        algorithm: ``ring``, ``hierarchical``, ``recursive_doubling``, ``native`` or
            ``auto`` (``hierarchical``: inside the nodes, then between them; on nodes
            of unequal size the ring).
        compression: ``Compression.fp16`` or ``Compression.bf16`` send float32 tensors
            as 16-bit floats, as :func:`~ringtrain.allreduce` does (the result is
            float32); a compressed reduce-scatter runs the ring, or ``hierarchical``
            where ``auto`` or the call chooses it.
        splits: the rows each rank keeps, in rank order (non-negative integers summing
            to ``tensor.shape[0]``; zeros allowed); the same on every rank.

    Returns:
        A new array of shape ``(rows of this rank, *tensor.shape[1:])``.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops, names or splits.
    """
    return _FORMS.blocking(False, tensor, name, process_set,
                           (op, prescale_factor, postscale_factor, algorithm, compression, splits))


def reducescatter_async(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                        name: str | None = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, process_set: ProcessSet | None = None,
                        *, algorithm: str | None = None,
                        compression: Compressor = Compression.none,
                        splits: Sequence[int] | np.ndarray | None = None) -> Handle:
    """Start :func:`reducescatter`; ``synchronize(handle)`` returns this rank's share."""
    return _FORMS.start(False, tensor, name, process_set,
                        (op, prescale_factor, postscale_factor, algorithm, compression, splits))


class _ReducescatterPlan:
    """A reduce-scatter of arrays like the one given, validated and chosen once.

    Attributes:
        group, settings, op: the call's, resolved.
        layout: the group's nodes (None for device memory handed to MPI).
        compressor: the compressor of the wire (host float32 arrays), or None.
        chosen: the algorithm (``native`` for device memory handed to MPI; ``ring``
            or ``hierarchical`` when compressed).
        call: the signature the ranks compare.
        rows: the first row of each rank's share, and the number of rows at the end.
        bounds, counts: each rank's share in elements of the flat array.
        share_shape, share_offset: this rank's share's shape, and where it starts in
            the flat array (bytes).
        combine: reduces two ranks' values (in the wire format when compressed).
        node_combine: when compressed, reduces two ranks' values before the cast (the
            hierarchical algorithm's sums inside the nodes).
        finish: turns the sum into the result (None when nothing is to do, or when
            compressed: the decoding finishes).
        carried: how a small host array is reduced whole in the agreement's messages
            (``recursive_doubling``), each rank keeping its share; or None.
        checked: the check and the data phase in one compiled call (host arrays):
            MPI's own reduce-scatter (``native``, MPI's own datatypes split evenly) or
            the ring (``ring``, the dtypes and ops it combines in compiled code); or None.
        finish_checked: what turns ``checked``'s result into the share (``finish`` for
            MPI's own; None for the ring, which finishes in the call).
    """

    def __init__(self, array: Any, op: Any, name: str | None, prescale_factor: float,
                 postscale_factor: float, process_set: ProcessSet | None,
                 algorithm: str | None, compression: Any, on_device: bool,
                 splits: Any = None):
        compression = check_compression(compression, "reducescatter", name)
        self.op = op = resolve_op(op, "reducescatter", name)
        if op is ReduceOp.Adasum:
            raise InvalidArgumentError(
                f"{subject('reducescatter', name)}: op Adasum combines whole vectors; it is "
                f"an allreduce (and grouped allreduce) op only")
        check_reduction(array, op, name, prescale_factor, postscale_factor, "reducescatter")
        check_splittable(array.shape, "reducescatter", name)
        self.settings = settings = current_settings()
        self.group = group = resolve_group(process_set, "reducescatter", name)
        self.carried: CarriedReduction | None = None
        self.checked: CheckedCollective | None = None
        self.finish_checked: Finisher | None = None
        self.compressor = compressor = active_compressor(compression, array.dtype, op,
                                                         "reducescatter", name)
        row = math.prod(array.shape[1:])
        if splits is None:
            self.rows = rows = _ring.chunk_bounds(array.shape[0], group.size)
            given = {}
        else:
            kept = check_splits(splits, array.shape[0], group.size, name, "reducescatter")
            self.rows = rows = [0, *accumulate(kept.tolist())]
            # Splits equal to the even ones are the same call as none given.
            given = {} if rows == _ring.chunk_bounds(array.shape[0], group.size) else \
                {"splits": tuple(kept.tolist())}
        self.bounds = bounds = [r * row for r in rows]
        self.counts = [bounds[r + 1] - bounds[r] for r in range(group.size)]
        self.share_shape = (rows[group.rank + 1] - rows[group.rank], *array.shape[1:])
        self.share_offset = bounds[group.rank] * array.dtype.itemsize
        self.layout = None if on_device else layout_of(group, settings)
        if compressor is not None:
            chosen = reducescatter_algorithm(algorithm, array.nbytes, group.size, settings,
                                             name, self.layout)
            self.chosen = chosen = chosen if chosen == "hierarchical" else "ring"
            self.call = Call(collective="reducescatter", name=name, op=op.name,
                             dtype=array.dtype, shape=array.shape, algorithm=chosen,
                             segment_bytes=settings.segment_bytes,
                             compression=compressor.name, **given,
                             **_layout_field(chosen, self.layout))
            self.combine = reducer(op.value, compressor.wire_dtype, compressor.encoding)
            self.node_combine = reducer(op.value, array.dtype)
            self.finish: Finisher | None = None
            return
        if on_device:
            self.chosen = "native"
            self.call = Call(collective="reducescatter", name=name, op=op.name,
                             dtype=array.dtype, shape=array.shape, algorithm="native",
                             memory=AWARE, compression=compression.name, **given)
        else:
            self.chosen = chosen = reducescatter_algorithm(
                algorithm, array.nbytes, group.size, settings, name, self.layout)
            self.call = Call(collective="reducescatter", name=name, op=op.name,
                             dtype=array.dtype, shape=array.shape, algorithm=chosen,
                             segment_bytes=settings.segment_bytes
                             if chosen in ("ring", "hierarchical") else None,
                             compression=compression.name, **given,
                             **_layout_field(chosen, self.layout))
        self.combine = reducer(op.value, array.dtype)
        self.finish = finisher(group.size if op is ReduceOp.Average else 1, postscale_factor,
                               array.dtype)
        if self.chosen == "recursive_doubling" and array.nbytes <= PAYLOAD_CAPACITY:
            self.carried = CarriedReduction(group, self.call, array.dtype, array.size,
                                            self.combine, self.finish)
        if self.chosen == "native" and not on_device and len(set(self.counts)) == 1:
            self.checked = checked_collective(group, self.call, REDUCE_SCATTER, array.dtype,
                                              self.counts[0], MPI_OPS[op])
            self.finish_checked = self.finish
        elif self.chosen == "ring" and not on_device:
            self.checked = checked_ring(group, self.call, array.dtype, bounds, False,
                                        self.combine, self.finish, settings.segment_bytes)


_PLANS: PlanCache[_ReducescatterPlan] = PlanCache()


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
    key = _key(on_device is not None, array, op, name, prescale_factor, postscale_factor,
               process_set, algorithm, compression, splits)
    plan = _PLANS.get(key, process_set, collective, name) or _PLANS.keep(
        key, _ReducescatterPlan(array, op, name, prescale_factor, postscale_factor,
                                process_set, algorithm, compression, on_device is not None,
                                splits))
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


def _reduced(plan: _ReducescatterPlan, memory: Any, source: Any, like: Any,
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
        _ring.reduce_scatter(group, memory.for_mpi(start), memory.for_mpi(result),
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


def _compressed(plan: _ReducescatterPlan, source: np.ndarray, name: str | None,
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
        _ring.reduce_scatter(group, wire, reduced, bounds, plan.combine, None,
                             plan.settings.segment_bytes)
    else:
        reduced[:] = wire
    compressor.decode(reduced, output.reshape(-1), decode_scale)
    return output


def _layout_field(chosen: str, layout: NodeLayout | None) -> dict[str, str]:
    """The layout, as the ranks compare it, of a call that runs on it."""
    return {"layout": layout.describe()} if chosen == "hierarchical" else {}


def _key(on_device: bool, array: Any, op: Any, name: str | None, prescale_factor: float,
         postscale_factor: float, process_set: ProcessSet | None, algorithm: str | None,
         compression: Any, splits: Any) -> tuple:
    """What a reduce-scatter's plan is kept by."""
    return (on_device, array.shape, array.dtype, op, name, prescale_factor, postscale_factor,
            process_set, algorithm, id(compression),
            None if splits is None else _splits_key(splits))


def _splits_key(splits: Any) -> Any:
    """Given splits as a plan is kept by them: their integers, or, for anything else (no
    plan is kept for it: making one says what is wrong), a key no plan has."""
    values = np.asarray(splits)
    return tuple(values.tolist()) if values.dtype.kind in "iu" else object()


def _carried(plan: _ReducescatterPlan, array: np.ndarray, prescale_factor: float
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
    _recursive_doubling.allreduce(group, reduced, combine, segment_bytes)
    output = RESULTS.empty(shape, source.dtype)
    share = reduced[start:start + output.size]
    if finish is None:
        np.copyto(output.reshape(-1), share)
    else:
        finish.into(share, output.reshape(-1))
    return output


def _kept(collective: str, tensor: np.ndarray, name: str | None,
          process_set: ProcessSet | None, arguments: tuple) -> _ReducescatterPlan | None:
    """The plan of an uncompressed reduce-scatter made before like this one, if still
    valid."""
    op, prescale_factor, postscale_factor, algorithm, compression, splits = arguments
    plan = _PLANS.get(_key(False, tensor, op, name, prescale_factor, postscale_factor,
                           process_set, algorithm, compression, splits), process_set,
                      collective, name)
    return plan if plan is None or plan.compressor is None else None


def _planned(plan: _ReducescatterPlan, collective: str, name: str | None, tensor: np.ndarray,
             output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept uncompressed plan (see :class:`CallForms`): this rank's share."""
    return _reduced(plan, HOST, tensor.reshape(-1), tensor, arguments[1])


def _carried_run(plan: _ReducescatterPlan, collective: str, name: str | None,
                 tensor: np.ndarray, output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan whose data rides in the agreement (see :class:`CallForms`):
    this rank's share."""
    return _carried(plan, tensor, arguments[1])


_FORMS = CallForms("reducescatter", _prepare, _kept, _planned, _carried_run)
