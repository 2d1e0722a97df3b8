"""allreduce and its in-place, asynchronous and grouped forms."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI
import numpy as np

from ..kernels import REDUCTION_UFUNCS
from . import _recursive_doubling, _ring
from ._agreement import PAYLOAD_CAPACITY, Call, agree
from ._calls import check_scale_factors, execute, flat, in_place_array, input_array
from ._executor import Handle
from ._group import Group
from ._native import MPI_OPS
from ._ops import REDUCE_DTYPES, ReduceOp, check_dtype, check_op_for_dtype, resolve_op
from ._process_sets import ProcessSet, resolve_group
from ._selection import allreduce_algorithm
from .config import current_settings

Finish = Callable[[np.ndarray], None]


def allreduce(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet | None = None, *,
              algorithm: str | None = None) -> np.ndarray:
    """Combine ``tensor`` over all ranks; return the result as a new array.

    Args:
        tensor: this rank's array (any shape, a supported dtype); non-contiguous arrays
            are copied first.
        op: Average (default), Sum, Min, Max or Product. Average of integers is refused.
        name: names the tensor in error messages; must be the same on every rank.
        prescale_factor: multiplies the input before the reduction (floating dtypes).
        postscale_factor: multiplies the result (floating dtypes).
        process_set: the ranks taking part (default: all).
        algorithm: ``ring``, ``recursive_doubling``, ``native`` or ``auto`` (default:
            the ``allreduce_algorithm`` setting).

    Returns:
        A new array of ``tensor``'s shape and dtype, bit-identical on every rank.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops, names or algorithms.
        InvalidArgumentError, UnsupportedDtypeError: bad arguments, before any
            communication.
    """
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, in_place=False)
    return execute("allreduce", name, run)


def allreduce_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None, *,
               algorithm: str | None = None) -> np.ndarray:
    """In-place :func:`allreduce`: ``tensor`` receives the result and is returned."""
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, in_place=True)
    return execute("allreduce_", name, run)


def allreduce_async(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                    name: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None) -> Handle:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new array.

    ``tensor`` must not be modified until the handle is complete.
    """
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, in_place=False)
    return execute("allreduce", name, run, asynchronous=True)


def allreduce_async_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                     name: str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                     algorithm: str | None = None) -> Handle:
    """Start :func:`allreduce_`; ``tensor`` holds the result once the handle is complete."""
    run = _prepare(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   algorithm, in_place=True)
    return execute("allreduce_", name, run, asynchronous=True)


def grouped_allreduce(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                      name: str | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                      algorithm: str | None = None) -> list[np.ndarray]:
    """Allreduce several arrays as one: arrays of one dtype travel in one fused buffer.

    Arguments as :func:`allreduce`; every rank passes the same number of arrays with the
    same shapes and dtypes, in the same order.

    Returns:
        New arrays, one per input, in order.
    """
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, in_place=False)
    return execute("grouped_allreduce", name, run)


def grouped_allreduce_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                       name: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                       algorithm: str | None = None) -> list[np.ndarray]:
    """In-place :func:`grouped_allreduce`; returns the input arrays, now reduced."""
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, in_place=True)
    return execute("grouped_allreduce_", name, run)


def grouped_allreduce_async(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                            name: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None, *,
                            algorithm: str | None = None) -> Handle:
    """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the list."""
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, in_place=False)
    return execute("grouped_allreduce", name, run, asynchronous=True)


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                             name: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None, *,
                             algorithm: str | None = None) -> Handle:
    """Start :func:`grouped_allreduce_`."""
    run = _prepare_grouped(tensors, op, name, prescale_factor, postscale_factor, process_set,
                           algorithm, in_place=True)
    return execute("grouped_allreduce_", name, run, asynchronous=True)


def check_reduction(array: np.ndarray, op: ReduceOp, name: str | None,
                    prescale_factor: float, postscale_factor: float, collective: str) -> None:
    """Refuse what no reduction accepts: unsupported dtype, Average of integers, bad scales."""
    check_dtype(array.dtype, REDUCE_DTYPES, collective, name)
    check_op_for_dtype(op, array.dtype, collective, name)
    check_scale_factors(array.dtype, prescale_factor, postscale_factor, collective, name)


class _Plan:
    """What one kind of allreduce call needs, validated and computed once, then reused."""

    __slots__ = ("group", "settings", "op", "algorithm", "call", "finish", "ufunc")

    def __init__(self, array: np.ndarray, op: Any, name: str | None, prescale_factor: float,
                 postscale_factor: float, process_set: ProcessSet | None,
                 algorithm: str | None, collective: str):
        self.op = resolve_op(op, collective, name)
        check_reduction(array, self.op, name, prescale_factor, postscale_factor, collective)
        self.group = resolve_group(process_set, collective, name)
        self.settings = current_settings()
        self.algorithm = allreduce_algorithm(algorithm, array.nbytes, self.group.size,
                                             self.settings, name)
        self.call = Call(collective="allreduce", name=name, op=self.op.name,
                         dtype=array.dtype, shape=array.shape, algorithm=self.algorithm,
                         segment_bytes=None if self.algorithm == "native"
                         else self.settings.segment_bytes)
        self.finish = finisher(self.group.size if self.op is ReduceOp.Average else 1,
                               postscale_factor)
        self.ufunc = REDUCTION_UFUNCS[self.op.value]


_plans: dict[tuple, _Plan] = {}
_PLANS_KEPT = 1024


def _plan(array: np.ndarray, op: Any, name: str | None, prescale_factor: float,
          postscale_factor: float, process_set: ProcessSet | None, algorithm: str | None,
          collective: str) -> _Plan:
    """The cached plan for this kind of call, rebuilt when settings or the world changed."""
    try:
        key = (collective, array.shape, array.dtype, op, name, prescale_factor,
               postscale_factor, process_set, algorithm)
        plan = _plans.get(key)
    except TypeError:  # an unhashable argument: validation will say what is wrong
        key, plan = None, None
    if plan is not None and plan.settings is current_settings() and \
            plan.group is resolve_group(process_set, collective, name):
        return plan
    plan = _Plan(array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
                 collective)
    if key is not None:
        if len(_plans) >= _PLANS_KEPT:
            _plans.clear()
        _plans[key] = plan
    return plan


def _prepare(tensor: Any, op: Any, name: str | None, prescale_factor: float,
             postscale_factor: float, process_set: ProcessSet | None, algorithm: str | None,
             in_place: bool) -> Callable[[], np.ndarray]:
    collective = "allreduce_" if in_place else "allreduce"
    array = (in_place_array if in_place else input_array)(tensor, collective, name)
    plan = _plan(array, op, name, prescale_factor, postscale_factor, process_set, algorithm,
                 collective)
    group, finish = plan.group, plan.finish
    source = flat(array)
    copy_back = in_place and not array.flags.c_contiguous
    if in_place:
        output = array
        result = source
    else:
        output = np.empty(array.shape, array.dtype)
        result = output.reshape(-1)

    def run() -> np.ndarray:
        if plan.algorithm == "recursive_doubling" and array.nbytes <= PAYLOAD_CAPACITY:
            agree(group, plan.call, payload=source, ufunc=plan.ufunc, result=result,
                  prescale_factor=prescale_factor)
            if finish is not None:
                finish(result)
        else:
            agree(group, plan.call)
            start = source
            if prescale_factor != 1.0:
                np.multiply(source, prescale_factor, out=result)
                start = result
            reduce_flat(group, plan.algorithm, start, result, plan.op, finish,
                        plan.settings.segment_bytes)
        if copy_back:
            output[...] = result.reshape(output.shape)
        return output

    return run


def reduce_flat(group: Group, algorithm: str, source: np.ndarray, result: np.ndarray,
                op: ReduceOp, finish: Finish | None, segment_bytes: int) -> None:
    """The data phase of an allreduce, after agreement: 1-D ``source`` into ``result``."""
    if group.size == 1 or source.size == 0:
        if result is not source:
            result[:] = source
    elif algorithm == "ring":
        _ring.allreduce(group, source, result, REDUCTION_UFUNCS[op.value], finish,
                        segment_bytes)
        return
    elif algorithm == "recursive_doubling":
        if result is not source:
            result[:] = source
        _recursive_doubling.allreduce(group, result, REDUCTION_UFUNCS[op.value], segment_bytes)
    else:
        send = MPI.IN_PLACE if result is source else source
        group.comm.Allreduce(send, result, MPI_OPS[op])
    if finish is not None:
        finish(result)


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


def _prepare_grouped(tensors: Sequence[Any], op: Any, name: str | None,
                     prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet | None, algorithm: str | None,
                     in_place: bool) -> Callable[[], list[np.ndarray]]:
    collective = "grouped_allreduce_" if in_place else "grouped_allreduce"
    convert = in_place_array if in_place else input_array
    arrays = [convert(t, collective, name) for t in tensors]
    op = resolve_op(op, collective, name)
    for array in arrays:
        check_reduction(array, op, name, prescale_factor, postscale_factor, collective)
    group = resolve_group(process_set, collective, name)
    settings = current_settings()
    by_dtype: dict[np.dtype, list[int]] = {}
    for index, array in enumerate(arrays):
        by_dtype.setdefault(array.dtype, []).append(index)
    fused_sizes = {dtype: sum(arrays[i].size for i in members)
                   for dtype, members in by_dtype.items()}
    chosen = {dtype: allreduce_algorithm(algorithm, fused_sizes[dtype] * dtype.itemsize,
                                         group.size, settings, name) for dtype in by_dtype}
    call = Call(collective="grouped_allreduce", name=name, op=op.name,
                dtype=tuple(a.dtype for a in arrays), shape=tuple(a.shape for a in arrays),
                algorithm=tuple(chosen[a.dtype] for a in arrays),
                segment_bytes=settings.segment_bytes)
    finish = finisher(group.size if op is ReduceOp.Average else 1, postscale_factor)

    def run() -> list[np.ndarray]:
        agree(group, call)
        outputs: list[np.ndarray] = list(arrays) if in_place else [None] * len(arrays)
        for dtype, members in by_dtype.items():
            fused = np.empty(fused_sizes[dtype], dtype)
            offset = 0
            for i in members:
                fused[offset:offset + arrays[i].size] = arrays[i].reshape(-1)
                offset += arrays[i].size
            if prescale_factor != 1.0:
                np.multiply(fused, prescale_factor, out=fused)
            reduce_flat(group, chosen[dtype], fused, fused, op, finish, settings.segment_bytes)
            offset = 0
            for i in members:
                piece = fused[offset:offset + arrays[i].size].reshape(arrays[i].shape)
                if in_place:
                    arrays[i][...] = piece
                else:
                    outputs[i] = piece
                offset += arrays[i].size
        return outputs

    return run
