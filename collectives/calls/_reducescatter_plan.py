"""Reduce-scatter plans: a call's arguments validated, its algorithm chosen and its
signature made once, before anything is sent, then reused by every call like it."""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any

import numpy as np

from ...kernels import reducer
from ..agreement._call import PAYLOAD_CAPACITY, Call
from ..agreement._carried import CarriedReduction
from ..agreement._checked import CheckedCollective, checked_collective, checked_ring
from ..algorithms import _ring
from ..algorithms._native import MPI_OPS
from ..algorithms._selection import reducescatter_algorithm
from ..base._checks import (active_compressor, check_compression, check_reduction, check_splits,
                            check_splittable)
from ..base._finishing import Finisher, finisher
from ..base._ops import ReduceOp, resolve_op
from ..config import current_settings
from ..errors import InvalidArgumentError, subject
from ..memory._memory import AWARE
from ..transport._compiled_checked import REDUCE_SCATTER
from ..world._plan_cache import PlanCache
from ..world._process_sets import ProcessSet, resolve_group
from ..world._topology import NodeLayout, layout_of


class ReducescatterPlan:
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


_PLANS: PlanCache[ReducescatterPlan] = PlanCache()


def reducescatter_plan(array: Any, op: Any, name: str | None, prescale_factor: float,
                       postscale_factor: float, process_set: ProcessSet | None,
                       algorithm: str | None, compression: Any, splits: Any,
                       on_device: bool = False) -> ReducescatterPlan:
    """The plan of a reduce-scatter of arrays like ``array`` (anything with ``shape``,
    ``dtype``, ``size`` and ``nbytes``; device memory with ``on_device``), kept for the
    calls like it.

    Raises what :func:`ringtrain.reducescatter` raises before any communication.
    """
    key = _key(on_device, array, op, name, prescale_factor, postscale_factor, process_set,
               algorithm, compression, splits)
    return _PLANS.get(key, process_set, "reducescatter", name) or _PLANS.keep(
        key, ReducescatterPlan(array, op, name, prescale_factor, postscale_factor,
                               process_set, algorithm, compression, on_device, splits))


def kept_reducescatter_plan(collective: str, tensor: np.ndarray, name: str | None,
                            process_set: ProcessSet | None,
                            arguments: tuple) -> ReducescatterPlan | None:
    """The plan :func:`reducescatter_plan` made before for an uncompressed reduce-scatter
    of host array ``tensor`` with ``arguments`` (op, prescale and postscale factors,
    algorithm, compression, splits), if it is still valid; else None."""
    op, prescale_factor, postscale_factor, algorithm, compression, splits = arguments
    plan = _PLANS.get(_key(False, tensor, op, name, prescale_factor, postscale_factor,
                           process_set, algorithm, compression, splits), process_set,
                      collective, name)
    return plan if plan is None or plan.compressor is None else None


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
