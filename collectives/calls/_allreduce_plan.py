"""Allreduce plans: a call's arguments validated, its algorithm chosen and its signature
made once, before anything is sent, then reused by every call like it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ...kernels import Compressor, FusionLayout, reducer
from ...kernels.reduction import Combine
from ..agreement._call import PAYLOAD_CAPACITY, Call
from ..agreement._carried import CarriedReduction
from ..agreement._checked import checked_collective, checked_ring
from ..algorithms._adasum import working_dtype
from ..algorithms._native import MPI_OPS
from ..algorithms._ring import chunk_bounds
from ..algorithms._selection import (ADASUM, adasum_algorithm, allreduce_algorithm,
                                     device_allreduce_algorithm, reduces_inside_nodes_on_gpus)
from ..base._checks import active_compressor, check_compression, check_reduction
from ..base._finishing import Finisher, finisher
from ..base._ops import ReduceOp, resolve_op
from ..config import current_settings
from ..memory._memory import AWARE, IPC, MPI_CANNOT_REDUCE, STAGED, goes_direct
from ..transport._compiled_checked import ALLREDUCE
from ..world._plan_cache import PlanCache
from ..world._process_sets import ProcessSet, resolve_group
from ..world._topology import HIERARCHICAL, NodeLayout, layout_of


def mpi_reduces(dtype: np.dtype) -> bool:
    """Whether the MPI library reduces values of ``dtype`` itself: not 16-bit floats
    (float16, bfloat16), which it reduces only by calling back into ringtrain's kernels."""
    return np.dtype(dtype) not in MPI_CANNOT_REDUCE


def layout_field(layout: NodeLayout, algorithm: str) -> dict[str, str]:
    """The call signature's ``layout`` field, for the algorithms that depend on it."""
    return {"layout": layout.describe()} if algorithm in HIERARCHICAL else {}


def memory_field(memory: str | None) -> dict[str, str]:
    """The call signature's ``memory`` field: device calls only."""
    return {"memory": memory} if memory else {}


def _device_compressed(compression: Any, dtype: np.dtype) -> bool:
    return isinstance(compression, Compressor) and compression.applies_to(dtype)


class AllreducePlan:
    """What one kind of allreduce call needs, validated and computed once, then reused.

    Attributes:
        group, settings, op, layout: the call's, resolved.
        algorithm: the algorithm chosen.
        memory: where the data travels (``None`` for host arrays; see :mod:`._memory`).
        call: the signature the ranks compare.
        compressor: the compressor that encodes the data, or None.
        combine: reduces two ranks' values in the wire format (None for Adasum).
        finish: turns the sum into the result (None when nothing is to do); for Adasum,
            the postscale in the working precision (see :func:`._adasum.allreduce`).
        wire: the host plan's own buffer for the compressed values.
        carried: how the data travels in the agreement's messages (small host arrays
            reduced by recursive doubling), or None.
        checked: the check and the data phase in one compiled call (host arrays,
            uncompressed): MPI's own allreduce (``native``, MPI's own datatypes), or
            the ring (``ring``, the dtypes and ops it combines in compiled code); or None.
        finish_checked: what turns ``checked``'s result into the call's (``finish`` for
            MPI's own allreduce; None for the ring, which finishes in the call).
    """

    __slots__ = ("group", "settings", "op", "algorithm", "call", "finish", "combine",
                 "compressor", "wire", "layout", "memory", "carried", "checked",
                 "finish_checked")

    def __init__(self, array: Any, op: Any, name: str | None, prescale_factor: float,
                 postscale_factor: float, process_set: ProcessSet | None,
                 algorithm: str | None, compression: Any, collective: str,
                 on_device: bool = False):
        self.op = resolve_op(op, collective, name)
        adasum = self.op is ReduceOp.Adasum
        if adasum:
            algorithm = adasum_algorithm(algorithm, collective, name, on_device)
        self.memory: str | None = None
        if on_device:
            direct = not _device_compressed(compression, array.dtype) and goes_direct(
                algorithm, current_settings().allreduce_algorithm, array.dtype)
            algorithm = "native" if direct else algorithm
            self.memory = AWARE if direct else STAGED
        check_reduction(array, self.op, name, prescale_factor, postscale_factor, collective)
        compression = check_compression(compression, collective, name)
        self.compressor = active_compressor(compression, array.dtype, self.op, collective,
                                            name)
        wire_dtype = self.compressor.wire_dtype if self.compressor else array.dtype
        self.group = resolve_group(process_set, collective, name)
        self.settings = current_settings()
        self.layout = layout_of(self.group, self.settings)
        choose = device_allreduce_algorithm if self.memory == STAGED else allreduce_algorithm
        self.algorithm = ADASUM if adasum else choose(
            algorithm, array.size * wire_dtype.itemsize, self.group.size, self.settings, name,
            self.layout, mpi_reduces(array.dtype))
        if self.memory == STAGED and reduces_inside_nodes_on_gpus(self.algorithm, self.layout):
            self.memory = IPC
        self.call = Call(collective="allreduce", name=name, op=self.op.name,
                         dtype=array.dtype, shape=array.shape, algorithm=self.algorithm,
                         segment_bytes=None if self.algorithm == "native"
                         else self.settings.segment_bytes, compression=compression.name,
                         **layout_field(self.layout, self.algorithm),
                         **memory_field(self.memory))
        self.finish: Finisher | None = finisher(
            self.group.size if self.op is ReduceOp.Average else 1, postscale_factor,
            working_dtype(array.dtype) if adasum else array.dtype)
        self.combine: Combine | None = None if adasum else reducer(
            self.op.value, wire_dtype, self.compressor.encoding if self.compressor else None)
        self.wire = np.empty(array.size, wire_dtype) \
            if self.compressor and not self.memory else None
        carried = self.memory is None and self.compressor is None and \
            self.algorithm == "recursive_doubling" and array.nbytes <= PAYLOAD_CAPACITY
        self.carried = CarriedReduction(self.group, self.call, array.dtype, array.size,
                                        self.combine, self.finish) if carried else None
        self.checked, self.finish_checked = None, None
        if self.memory is None and self.compressor is None:
            if self.algorithm == "native":
                self.checked = checked_collective(self.group, self.call, ALLREDUCE,
                                                  array.dtype, array.size, MPI_OPS[self.op])
                self.finish_checked = self.finish
            elif self.algorithm == "ring":
                self.checked = checked_ring(
                    self.group, self.call, array.dtype,
                    chunk_bounds(array.size, self.group.size), True, self.combine,
                    self.finish, self.settings.segment_bytes)


_PLANS: PlanCache[AllreducePlan] = PlanCache()


def allreduce_plan(array: Any, op: Any, name: str | None, prescale_factor: float,
                   postscale_factor: float, process_set: ProcessSet | None,
                   algorithm: str | None, compression: Any, collective: str,
                   on_device: bool = False) -> AllreducePlan:
    """The plan of an allreduce of arrays like ``array``, cached; rebuilt when the
    settings or the world changed.

    ``array`` needs ``shape``, ``dtype`` and ``size``. With ``on_device``, the data is in
    GPU memory: MPI's own algorithm on device memory where :func:`._memory.goes_direct`
    allows it, else the GPUs' own through CUDA IPC where the ranks share a node, else
    the algorithm chosen for host copies; the signature's ``memory`` field says which.
    Raises what :func:`ringtrain.allreduce` raises before any communication.
    """
    key = _key(array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
               compression, collective, on_device)
    return _PLANS.get(key, process_set, collective, name) or _PLANS.keep(key, AllreducePlan(
        array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
        compression, collective, on_device))


def kept_allreduce_plan(collective: str, array: Any, name: str | None,
                        process_set: ProcessSet | None,
                        arguments: tuple) -> AllreducePlan | None:
    """The plan :func:`allreduce_plan` made before for an allreduce of host array
    ``array`` with ``arguments`` (op, prescale and postscale factors, algorithm,
    compression), if it is still valid; else None."""
    op, prescale_factor, postscale_factor, algorithm, compression = arguments
    return _PLANS.get(_key(array, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, compression, collective, False),
                      process_set, collective, name)


def _key(array: Any, op: Any, name: str | None, prescale_factor: float,
         postscale_factor: float, process_set: ProcessSet | None, algorithm: str | None,
         compression: Any, collective: str, on_device: bool) -> tuple:
    """What an allreduce's plan is kept by."""
    return (collective, array.shape, array.dtype, op, name, prescale_factor, postscale_factor,
            process_set, algorithm, id(compression), on_device)


class GroupedCall:
    """A grouped allreduce of arrays like ``arrays`` (anything with ``shape`` and
    ``dtype``), validated, and its signature.

    Attributes:
        op, compression, group, settings, layout: the call's, resolved.
        memory: where the data travels (None for host arrays; see :mod:`._memory`).
        members: the indices of the arrays of each dtype, in order.
        fusion: the fusion layout of each dtype's arrays.
        compressors: the compressor that encodes each dtype, or None.
        chosen: the algorithm of each dtype's fused buffer (``algorithm`` for all when
            given, else as ``auto`` or the requested one chooses by size; ``native`` for
            device memory handed to MPI, ``ipc`` for device memory reduced on the GPUs
            of one node; ``adasum`` for every dtype of an Adasum).
        call: the signature the ranks compare.

    Raises:
        What :func:`grouped_allreduce` raises before any communication.
    """

    def __init__(self, arrays: Sequence[Any], op: Any, name: str | None,
                 prescale_factor: float, postscale_factor: float,
                 process_set: ProcessSet | None, algorithm: str | None, compression: Any,
                 collective: str, on_device: bool = False):
        self.op = resolve_op(op, collective, name)
        adasum = self.op is ReduceOp.Adasum
        if adasum:
            algorithm = adasum_algorithm(algorithm, collective, name, on_device)
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
        self.memory: str | None = None
        if on_device:
            direct = not any(self.compressors.values()) and all(
                goes_direct(algorithm, self.settings.allreduce_algorithm, dtype)
                for dtype in self.members)
            self.memory = AWARE if direct else STAGED
        choose = device_allreduce_algorithm if self.memory == STAGED else allreduce_algorithm
        self.chosen = {dtype: ADASUM if adasum else "native" if self.memory == AWARE
                       else choose(algorithm, self._wire_bytes(dtype), self.group.size,
                                   self.settings, name, self.layout,
                                   mpi_reduces(dtype))
                       for dtype in self.members}
        if self.memory == STAGED and any(reduces_inside_nodes_on_gpus(chosen, self.layout)
                                         for chosen in self.chosen.values()):
            self.memory = IPC  # the other dtypes' buffers go through the host
        hierarchical = next((c for c in self.chosen.values() if c in HIERARCHICAL), "")
        self.call = Call(collective="grouped_allreduce", name=name, op=self.op.name,
                         dtype=tuple(np.dtype(a.dtype) for a in arrays),
                         shape=tuple(tuple(a.shape) for a in arrays),
                         algorithm=tuple(self.chosen[np.dtype(a.dtype)] for a in arrays),
                         segment_bytes=self.settings.segment_bytes,
                         compression=self.compression.name,
                         **memory_field(self.memory),
                         **layout_field(self.layout, hierarchical))

    def _wire_bytes(self, dtype: np.dtype) -> int:
        """Bytes on the wire of one dtype's fused buffer."""
        compressor = self.compressors[dtype]
        return self.fusion[dtype].total_size * \
            (compressor.wire_dtype.itemsize if compressor else dtype.itemsize)
