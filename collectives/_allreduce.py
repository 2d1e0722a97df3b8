"""allreduce and its in-place, asynchronous and grouped forms (planned by
:mod:`.calls._allreduce_plan`, run by :mod:`.calls._allreduce_run`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kernels import Compression, Compressor
from .base._executor import Handle
from .base._ops import ReduceOp
from .calls._allreduce_run import FORMS, GROUPED_FORMS
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
    return FORMS.blocking(False, tensor, name, process_set,
                          (op, prescale_factor, postscale_factor, algorithm, compression))


def allreduce_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average, name: str | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet | None = None, *,
               algorithm: str | None = None,
               compression: Compressor = Compression.none) -> np.ndarray:
    """In-place :func:`allreduce`: ``tensor`` receives the result and is returned."""
    return FORMS.blocking(True, tensor, name, process_set,
                          (op, prescale_factor, postscale_factor, algorithm, compression))


def allreduce_async(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                    name: str | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None,
                    compression: Compressor = Compression.none) -> Handle:
    """Start :func:`allreduce`; ``synchronize(handle)`` returns the new array.

    ``tensor`` must not be modified until the handle is complete.
    """
    return FORMS.start(False, tensor, name, process_set,
                       (op, prescale_factor, postscale_factor, algorithm, compression))


def allreduce_async_(tensor: np.ndarray, op: ReduceOp = ReduceOp.Average,
                     name: str | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                     algorithm: str | None = None,
                     compression: Compressor = Compression.none) -> Handle:
    """Start :func:`allreduce_`; ``tensor`` holds the result once the handle is complete."""
    return FORMS.start(True, tensor, name, process_set,
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
    return GROUPED_FORMS.blocking(False, tensors, name, process_set,
                                  (op, prescale_factor, postscale_factor, algorithm, compression))


def grouped_allreduce_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                       name: str | None = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet | None = None, *,
                       algorithm: str | None = None,
                       compression: Compressor = Compression.none) -> list[np.ndarray]:
    """In-place :func:`grouped_allreduce`; returns the input arrays, now reduced."""
    return GROUPED_FORMS.blocking(True, tensors, name, process_set,
                                  (op, prescale_factor, postscale_factor, algorithm, compression))


def grouped_allreduce_async(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                            name: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet | None = None, *,
                            algorithm: str | None = None,
                            compression: Compressor = Compression.none) -> Handle:
    """Start :func:`grouped_allreduce`; ``synchronize(handle)`` returns the list."""
    return GROUPED_FORMS.start(False, tensors, name, process_set,
                               (op, prescale_factor, postscale_factor, algorithm, compression))


def grouped_allreduce_async_(tensors: Sequence[np.ndarray], op: ReduceOp = ReduceOp.Average,
                             name: str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet | None = None, *,
                             algorithm: str | None = None,
                             compression: Compressor = Compression.none) -> Handle:
    """Start :func:`grouped_allreduce_`."""
    return GROUPED_FORMS.start(True, tensors, name, process_set,
                               (op, prescale_factor, postscale_factor, algorithm, compression))
