"""alltoall: each rank sends a block of rows to every rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpi4py import MPI
import numpy as np

from . import _pairwise, _ring
from ._agreement import Call, agree
from ._buffers import device_tensor, results_like
from ._calls import check_splittable, execute, flat, input_array
from ._executor import Handle
from ._ops import COPY_DTYPES, check_dtype
from ._process_sets import ProcessSet, resolve_group
from ._selection import simple_algorithm
from .config import current_settings
from .errors import InvalidArgumentError, subject


def alltoall(tensor: np.ndarray, splits: Sequence[int] | np.ndarray | None = None,
             name: str | None = None, process_set: ProcessSet | None = None, *,
             algorithm: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` of ``tensor`` to rank j; receive every rank's rows for us.

    Args:
        tensor: this rank's rows, at least 1-D.
        splits: how many rows go to each rank, in rank order, summing to
            ``tensor.shape[0]``; default: as even as possible, earlier ranks one more.
        name: names the tensor in error messages; the same on every rank.
        process_set: the ranks taking part (default: all).
        algorithm: ``pairwise``, ``native`` or ``auto``.

    Returns:
        ``(received, received_splits)``: the rows from every rank concatenated in rank
        order, and how many rows came from each rank (int64).
    """
    return execute("alltoall", name, _prepare(tensor, splits, name, process_set, algorithm),
                   restore=results_like(tensor))


def alltoall_async(tensor: np.ndarray, splits: Sequence[int] | np.ndarray | None = None,
                   name: str | None = None, process_set: ProcessSet | None = None, *,
                   algorithm: str | None = None) -> Handle:
    """Start :func:`alltoall`; ``synchronize(handle)`` returns ``(received, received_splits)``."""
    return execute("alltoall", name, _prepare(tensor, splits, name, process_set, algorithm),
                   asynchronous=True,
                   restore=results_like(tensor))


def check_splits(splits: Any, rows: int, size: int, name: str | None) -> np.ndarray:
    """The rows this rank sends to each rank, as int64: ``splits`` checked, or, when it is
    None, ``rows`` cut as evenly as possible."""
    if splits is None:
        return np.diff(np.array(_ring.chunk_bounds(rows, size), np.int64))
    values = np.asarray(splits)
    if values.shape != (size,) or values.dtype.kind not in "iu" or (values < 0).any():
        raise InvalidArgumentError(
            f"{subject('alltoall', name)}: splits must be {size} non-negative "
            f"integers (one per rank), got {list(np.ravel(values))}")
    if int(values.sum()) != rows:
        raise InvalidArgumentError(
            f"{subject('alltoall', name)}: splits {values.tolist()} sum to "
            f"{int(values.sum())}, but the tensor has {rows} rows")
    return values.astype(np.int64)


def _prepare(tensor: Any, splits: Any, name: str | None, process_set: ProcessSet | None,
             algorithm: str | None) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    on_device = device_tensor(tensor, "alltoall", name)
    if on_device is not None:
        from . import _device_calls  # loads numba.cuda: only for device tensors
        return _device_calls.alltoall(
            on_device, splits, name, process_set, algorithm,
            lambda array: _prepare(array, splits, name, process_set, algorithm))
    array = input_array(tensor, "alltoall", name)
    check_dtype(array.dtype, COPY_DTYPES, "alltoall", name)
    check_splittable(array.shape, "alltoall", name)
    group = resolve_group(process_set, "alltoall", name)
    send_splits = check_splits(splits, array.shape[0], group.size, name)
    chosen = simple_algorithm("alltoall", algorithm, current_settings(), name)
    call = Call(collective="alltoall", name=name, dtype=array.dtype, algorithm=chosen,
                **{"shape[1:]": array.shape[1:]})
    row_bytes = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))

    def run() -> tuple[np.ndarray, np.ndarray]:
        agree(group, call)
        received_splits = np.empty(group.size, np.int64)
        group.comm.Alltoall(send_splits, received_splits)
        output = np.empty((int(received_splits.sum()), *array.shape[1:]), array.dtype)
        send = flat(array).view(np.uint8)
        receive = output.reshape(-1).view(np.uint8)
        send_offsets = [0, *np.cumsum(send_splits * row_bytes).tolist()]
        receive_offsets = [0, *np.cumsum(received_splits * row_bytes).tolist()]
        if chosen == "native":
            group.comm.Alltoallv(
                [send, (send_splits * row_bytes).tolist(), send_offsets[:-1], MPI.BYTE],
                [receive, (received_splits * row_bytes).tolist(), receive_offsets[:-1],
                 MPI.BYTE])
        else:
            _pairwise.alltoall(group, send, send_offsets, receive, receive_offsets)
        return output, received_splits

    return run
