"""allgather: every rank's rows, concatenated along axis 0 in rank order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpi4py import MPI
import numpy as np

from . import _hierarchical, _ring
from ._agreement import Call, agree
from ._buffers import device_tensor, results_like
from ._calls import execute, flat, input_array
from ._executor import Handle
from ._group import Group
from ._ops import COPY_DTYPES, check_dtype
from ._process_sets import ProcessSet, resolve_group
from ._selection import simple_algorithm
from ._topology import Layout, hierarchy_for, layout_of
from .config import current_settings


def allgather(tensor: np.ndarray, name: str | None = None,
              process_set: ProcessSet | None = None, *,
              algorithm: str | None = None) -> np.ndarray:
    """Concatenate every rank's ``tensor`` along axis 0, in rank order.

    The first dimension may differ between ranks; the other dimensions and the dtype
    must not. A 0-d array counts as one row.

    Args:
        tensor: this rank's rows.
        name: names the tensor in error messages; the same on every rank.
        process_set: the ranks taking part (default: all).
        algorithm: ``ring``, ``hierarchical``, ``native`` or ``auto`` (``ring``).

    Returns:
        A new array of shape ``(sum of first dimensions, *tensor.shape[1:])``.
    """
    return execute("allgather", name, _prepare(tensor, name, process_set, algorithm),
                   restore=results_like(tensor))


def allgather_async(tensor: np.ndarray, name: str | None = None,
                    process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None) -> Handle:
    """Start :func:`allgather`; ``synchronize(handle)`` returns the new array."""
    return execute("allgather", name, _prepare(tensor, name, process_set, algorithm),
                   asynchronous=True,
                   restore=results_like(tensor))


def gather_rows(group: Group, rows: np.ndarray, row_shape: tuple[int, ...], algorithm: str,
                layout: Layout | None = None, segment_bytes: int = 0
                ) -> tuple[np.ndarray, np.ndarray]:
    """The data phase of an allgather, after agreement: exchange row counts, then rows.

    ``hierarchical`` needs the agreed ``layout`` and the segment size.

    Returns:
        The gathered rows and the number of rows each rank sent.
    """
    counts = np.empty(group.size, np.int64)
    group.comm.Allgather(np.array([rows.shape[0]], np.int64), counts)
    output = np.empty((int(counts.sum()), *row_shape), rows.dtype)
    row_bytes = rows.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    bounds = [0, *np.cumsum(counts * row_bytes).tolist()]
    data = output.reshape(-1).view(np.uint8)
    mine = flat(rows).view(np.uint8)
    if algorithm == "hierarchical" and group.size > 1:
        data[bounds[group.rank]:bounds[group.rank + 1]] = mine
        _hierarchical.allgather(group, hierarchy_for(group, layout), data, bounds,
                                segment_bytes)
    elif algorithm == "native":
        group.comm.Allgatherv(mine, [data, (counts * row_bytes).tolist(), bounds[:-1], MPI.BYTE])
    else:
        data[bounds[group.rank]:bounds[group.rank + 1]] = mine
        _ring.allgather(group, data, bounds)
    return output, counts


def _prepare(tensor: Any, name: str | None, process_set: ProcessSet | None,
             algorithm: str | None) -> Callable[[], np.ndarray]:
    on_device = device_tensor(tensor, "allgather", name)
    if on_device is not None:
        from . import _device_calls  # loads numba.cuda: only for device tensors
        return _device_calls.allgather(
            on_device, name, process_set, algorithm,
            lambda array: _prepare(array, name, process_set, algorithm))
    array = input_array(tensor, "allgather", name)
    check_dtype(array.dtype, COPY_DTYPES, "allgather", name)
    rows = array.reshape(1) if array.ndim == 0 else array
    group = resolve_group(process_set, "allgather", name)
    settings = current_settings()
    chosen = simple_algorithm("allgather", algorithm, settings, name)
    layout = layout_of(group, settings)
    extra = {"layout": layout.describe(), "segment_bytes": settings.segment_bytes} \
        if chosen == "hierarchical" else {}
    call = Call(collective="allgather", name=name, dtype=array.dtype,
                algorithm=chosen, **{"shape[1:]": rows.shape[1:]}, **extra)

    def run() -> np.ndarray:
        agree(group, call)
        return gather_rows(group, rows, rows.shape[1:], chosen, layout,
                           settings.segment_bytes)[0]

    return run
