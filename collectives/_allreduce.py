"""allreduce and its in-place, asynchronous and grouped forms: the caller's tensors
(host arrays or device tensors) turned into a planned call (:mod:`._plans`) run by
:mod:`._allreduce_run`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..kernels import Compression, Compressor
from .base._buffers import device_tensor
from .base._checks import flat, in_place_array, input_array
from .base._executor import Handle
from .base._ops import ReduceOp
from .base._result_pool import RESULTS
from .calls._allreduce_run import reduce_grouped, reduce_planned
from .calls._forms import CallForms
from .calls._plans import (AllreducePlan, GroupedCall, allreduce_plan,
                           kept_allreduce_plan)
from .errors import InvalidArgumentError, subject
from .memory._placement import memory_for
from .world._process_sets import ProcessSet


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
        op: Average (default), Sum, Min, Max, Product or Adasum. Average of integers is
            refused. Adasum (floating dtypes, host arrays, no compression) combines the
            ranks' vectors as Horovod's Adasum does, by its own algorithm (see
            docs/collectives.md); in a grouped allreduce each tensor on its own.
        name: names the tensor in error messages; must be the same on every rank.
        prescale_factor: multiplies the input before the reduction (floating dtypes).
        postscale_factor: multiplies the result (floating dtypes).
        process_set: the ranks taking part (default: all).
        algorithm: ``ring``, ``recursive_doubling``, ``hierarchical``, ``node_leader``,
            ``native`` or ``auto`` (default: the ``allreduce_algorithm`` setting); unset
            for Adasum.
        compression: ``Compression.fp16`` or ``Compression.bf16`` send float32 tensors
            as 16-bit floats (half the bytes; the result is float32 again, with the
            16-bit format's precision); other dtypes travel as they are, but fp16
            refuses bfloat16 tensors. Product is refused with compression. The
            hierarchical algorithms compress only the traffic between nodes.

    Returns:
        A new array of ``tensor``'s shape and dtype, bit-identical on every rank.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, ops, names or algorithms.
        InvalidArgumentError, UnsupportedDtypeError: bad arguments, before any
            communication.
    """
    return _FORMS.blocking(False, tensor, name, process_set,
                           (op, prescale_factor, postscale_factor, algorithm, compression))


def allreduce_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None, *,
               algorithm: str | None = None,
               compression: Compressor = Compression.none) -> np.ndarray:
    """In-place :func:`allreduce`: ``tensor`` receives the result and is returned."""
    return _FORMS.blocking(True, tensor, name, process_set,
                           (op, prescale_factor, postscale_factor, algorithm, compression))


def allreduce_async(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                    name: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None,
                    compression: Compressor = Compression.none) -> Handle:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new array.

    ``tensor`` must not be modified until the handle is complete.
    """
    return _FORMS.start(False, tensor, name, process_set,
                        (op, prescale_factor, postscale_factor, algorithm, compression))


def allreduce_async_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                     name: str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                     algorithm: str | None = None,
                     compression: Compressor = Compression.none) -> Handle:
    """Start :func:`allreduce_`; ``tensor`` holds the result once the handle is complete."""
    return _FORMS.start(True, tensor, name, process_set,
                        (op, prescale_factor, postscale_factor, algorithm, compression))


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
    return _GROUPED_FORMS.blocking(False, tensors, name, process_set,
                                   (op, prescale_factor, postscale_factor, algorithm, compression))


def grouped_allreduce_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                       name: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                       algorithm: str | None = None,
                       compression: Compressor = Compression.none) -> list[np.ndarray]:
    """In-place :func:`grouped_allreduce`; returns the input arrays, now reduced."""
    return _GROUPED_FORMS.blocking(True, tensors, name, process_set,
                                   (op, prescale_factor, postscale_factor, algorithm, compression))


def grouped_allreduce_async(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                            name: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None, *,
                            algorithm: str | None = None,
                            compression: Compressor = Compression.none) -> Handle:
    """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the list."""
    return _GROUPED_FORMS.start(False, tensors, name, process_set,
                                (op, prescale_factor, postscale_factor, algorithm, compression))


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                             name: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None, *,
                             algorithm: str | None = None,
                             compression: Compressor = Compression.none) -> Handle:
    """Start :func:`grouped_allreduce_`."""
    return _GROUPED_FORMS.start(True, tensors, name, process_set,
                                (op, prescale_factor, postscale_factor, algorithm, compression))


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


_FORMS = CallForms("allreduce", prepare, kept_allreduce_plan, _planned, _carried,
                   planned_output=RESULTS.empty, carried_output=np.empty)
_GROUPED_FORMS = CallForms("grouped_allreduce", prepare_grouped)
