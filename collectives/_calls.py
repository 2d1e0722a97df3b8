"""What every collective does around its algorithm: check arrays, order the call, wrap errors."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI
import numpy as np

from . import timeline
from ._activity import ACTIVITY
from ._buffers import Restore, is_torch_tensor, torch_view
from ._executor import Handle
from ._tracing import call_span
from ._world import mpi_threads_supported, world
from .errors import (CommunicationError, InvalidArgumentError, RingtrainError,
                     UnsupportedDtypeError, subject)
from .logs import LOGGER, log_call


def input_array(tensor: Any, collective: str, name: str | None) -> np.ndarray:
    """The caller's tensor as a numpy array (no copy when it already is one, or a torch
    CPU tensor)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if is_torch_tensor(tensor):
        return torch_view(tensor, collective, name)
    try:
        return np.asarray(tensor)
    except (TypeError, ValueError) as error:
        raise UnsupportedDtypeError(
            f"{subject(collective, name)}: cannot use a "
            f"{type(tensor).__name__} as an array: {error}") from None


def in_place_array(tensor: Any, collective: str, name: str | None) -> np.ndarray:
    """The caller's tensor for an in-place collective: a writable numpy array (over a
    torch CPU tensor's memory for a tensor)."""
    if is_torch_tensor(tensor):
        return torch_view(tensor, collective, name)
    if not isinstance(tensor, np.ndarray):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: works in place and needs a numpy "
            f"array or a torch tensor, got {type(tensor).__name__}")
    if not tensor.flags.writeable:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: the array is read-only")
    return tensor


def flat(array: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous array, or a contiguous 1-D copy of any other."""
    if array.flags.c_contiguous:
        return array.reshape(-1)
    return np.ascontiguousarray(array).reshape(-1)


def check_splittable(shape: tuple[int, ...], collective: str, name: str | None) -> None:
    """Refuse a 0-d tensor where a collective splits the first dimension among the ranks."""
    if len(shape) == 0:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: needs at least one dimension to split among "
            f"the ranks, got a 0-d array")


def check_scale_factors(dtype: np.dtype, prescale_factor: float, postscale_factor: float,
                        collective: str, name: str | None) -> None:
    """Scale factors other than 1 need a floating dtype (an integer result would be cut)."""
    if dtype.kind != "f" and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: prescale_factor/postscale_factor "
            f"need a floating dtype, got {dtype}")


def execute(collective: str, name: str | None, body: Callable[[], Any],
            asynchronous: bool = False, restore: Restore | None = None) -> Any:
    """Run ``body`` in program order; return its result, or a :class:`Handle` if asynchronous.

    ``restore`` turns the result into what the caller gets (see :mod:`._buffers`).
    """
    if restore is not None:
        body = _restored(body, restore)
    executor = world().executor
    arguments = (collective, name, body)
    if not asynchronous:
        return executor.run(_guarded, arguments, collective, name)
    if not mpi_threads_supported():
        raise RingtrainError(
            f"{subject(collective + '_async', name)}: MPI was initialized without "
            f"thread support (MPI_THREAD_SERIALIZED or better is needed); leave "
            f"mpi4py.rc.thread_level at its default 'multiple'")
    return executor.submit(_guarded, arguments, collective, name)


def _restored(body: Callable[[], Any], restore: Restore) -> Callable[[], Any]:
    return lambda: restore(body())


def _guarded(collective: str, name: str | None, body: Callable[[], Any]) -> Any:
    line = timeline.ACTIVE
    if line is not None:
        with call_span(line, collective, name):
            return _logged(collective, name, body)
    return _logged(collective, name, body)


def _logged(collective: str, name: str | None, body: Callable[[], Any]) -> Any:
    if not LOGGER.isEnabledFor(logging.DEBUG):
        return _run(collective, name, body)
    before, start = ACTIVITY.last, time.perf_counter()
    try:
        return _run(collective, name, body)
    finally:
        if ACTIVITY.last is not before:
            log_call(ACTIVITY.last, world().group.world_rank, time.perf_counter() - start)


def _run(collective: str, name: str | None, body: Callable[[], Any]) -> Any:
    try:
        return body()
    except MPI.Exception as error:
        raise CommunicationError(
            f"{subject(collective, name)}: "
            f"MPI failed: {error}") from error


def poll(handle: Handle) -> bool:
    """Whether the asynchronous collective behind ``handle`` has finished.

    Args:
        handle: returned by one of the ``*_async`` functions.
    """
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous collective and return its result.

    Args:
        handle: returned by one of the ``*_async`` functions.

    Returns:
        What the blocking form of the collective returns.

    Raises:
        Whatever the collective raised (e.g. :class:`~ringtrain.MismatchError`).
    """
    return handle.wait()
