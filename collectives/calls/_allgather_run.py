"""Running planned allgathers: the call validated into its body, the data phase after
the agreement, and the runs of a kept plan; the call forms declared (:data:`FORMS`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import numpy as np

from ..agreement._agreement import agree
from ..algorithms import _hierarchical, _native, _ring
from ..algorithms._selection import auto_choice
from ..base._buffers import device_tensor
from ..base._checks import byte_view, flat, input_array
from ..base._group import Group
from ..config import Settings, current_settings
from ..memory._memory import AWARE, HOST, HostMemory, goes_direct
from ..memory._placement import memory_for, staged
from ..transport import _pairwise
from ..world._process_sets import ProcessSet
from ..world._topology import NodeLayout, hierarchy_for
from ._allgather_plan import AllgatherPlan, allgather_plan, kept_allgather_plan
from ._forms import CallForms


def gather_rows(group: Group, rows: Any, row_shape: tuple[int, ...], algorithm: str,
                layout: NodeLayout | None = None, segment_bytes: int = 0,
                memory: HostMemory = HOST, like: Any = None,
                settings: Settings | None = None,
                counts: np.ndarray | None = None) -> tuple[Any, np.ndarray]:
    """The data phase of an allgather, after agreement: exchange row counts (unless
    ``counts`` gives every rank's already), then rows.

    ``rows`` is a host array or, for ``native`` only, the memory of device tensor
    ``like`` (whose kind the output takes) with its ``memory``. ``hierarchical`` needs
    the agreed ``layout`` and the segment size. ``auto`` (with ``settings``) is resolved
    from the gathered size once the row counts are known.

    Returns:
        The gathered rows and the number of rows each rank sent.
    """
    described = rows if like is None else like
    dtype, shape = np.dtype(described.dtype), tuple(described.shape)
    if counts is None:
        counts = np.empty(group.size, np.int64)
        group.comm.Allgather(np.array([shape[0] if shape else 1], np.int64), counts)
    rows_of = counts.tolist()
    output = memory.new(described, (sum(rows_of), *row_shape))
    row_bytes = dtype.itemsize * math.prod(row_shape)
    sizes = [rows * row_bytes for rows in rows_of]
    bounds = [0, *accumulate(sizes)]
    if algorithm == "auto":
        algorithm = auto_choice("allgather", bounds[-1], group.size,
                                settings or current_settings(), layout)
    if algorithm == "native":
        if sum(sizes):
            _native.allgather(group, memory.for_mpi(rows, np.uint8),
                              memory.for_mpi(output, np.uint8), sizes, **memory.phase_args)
        return output, counts
    data = output.reshape(-1).view(np.uint8)
    if algorithm == "pairwise":
        _pairwise.allgather(group, flat(rows).view(np.uint8), data, bounds)
        return output, counts
    data[bounds[group.rank]:bounds[group.rank + 1]] = flat(rows).view(np.uint8)
    if algorithm == "hierarchical" and group.size > 1:
        _hierarchical.allgather(group, hierarchy_for(group, layout), data, bounds,
                                segment_bytes)
    else:
        _ring.allgather(group, data, bounds)
    return output, counts


def _prepare(collective: str, tensor: Any, name: str | None, process_set: ProcessSet | None,
             algorithm: str | None) -> Callable[[], Any]:
    on_device = device_tensor(tensor, collective, name)
    if on_device is not None and not goes_direct(algorithm,
                                                 current_settings().allgather_algorithm):
        return staged(on_device, False,
                      lambda array: _prepare(collective, array, name, process_set, algorithm))
    array = on_device if on_device is not None else input_array(tensor, collective, name)
    plan = allgather_plan(array, name, process_set, algorithm, on_device is not None)
    if on_device is not None:
        memory, rows = memory_for(AWARE, on_device.device), on_device.memory
    else:
        memory, rows = HOST, array.reshape(1) if array.ndim == 0 else array

    if plan.carried is not None:
        return lambda: _carried(plan, array)

    def run() -> Any:
        with memory.entered(*([] if on_device is None else [on_device])):
            return _gathered(plan, memory, rows, on_device)

    return run


def _gathered(plan: AllgatherPlan, memory: HostMemory, rows: Any, like: Any) -> Any:
    """An allgather as ``plan`` says, once checked, of ``rows`` (a host array, or the
    memory of device tensor ``like``): agree, then gather; the new array."""
    agree(plan.group, plan.call)
    return gather_rows(plan.group, rows, plan.row_shape, plan.chosen, plan.layout,
                       plan.settings.segment_bytes, memory, like, plan.settings)[0]


def _carried(plan: AllgatherPlan, array: np.ndarray) -> np.ndarray:
    """An allgather whose row counts ride in the agreement's own messages.

    Every rank's row count, and its rows when they fit, ride in the agreement
    (:class:`CarriedGather`). When every count is the same (the usual case), every rank
    made the same choice: the rows have arrived, or they follow as the plan chose for
    their size; otherwise the ranks, all knowing every count now, gather the rows as
    ``auto`` chooses for their total size (the payloads, of different lengths, are not
    used). Where the plan has the compiled call (rows too large to ride, MPI's own
    allgather or the pairwise exchange through the mailboxes moving them), the counts
    travel with the check and the rows follow in the same call, unless some rank's count
    differs.
    """
    rows = array.reshape(1) if array.ndim == 0 else array
    mine = byte_view(rows)
    if plan.checked is not None:
        output = HOST.new(rows, plan.even_shape)
        counts = plan.checked.run(mine, byte_view(output))
        if counts is None:  # every count the same: the rows have arrived
            return output
    else:
        counts, carried = plan.carried.run(plan.count, mine)
        if counts is None:  # every count the same
            if carried is not None:
                return np.ndarray(plan.even_shape, rows.dtype, carried, plan.carried.data_offset)
            if plan.even_choice == "native":
                output = HOST.new(rows, plan.even_shape)
                _native.allgather(plan.group, mine, output.reshape(-1).view(np.uint8),
                                  plan.even_sizes)
                return output
    return gather_rows(plan.group, rows, plan.row_shape, "auto", plan.gather_layout,
                       plan.settings.segment_bytes, settings=plan.settings,
                       counts=plan.even_counts if counts is None else counts[:, 0])[0]


def _planned(plan: AllgatherPlan, collective: str, name: str | None, tensor: np.ndarray,
             output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan (see :class:`CallForms`): the new array."""
    return _gathered(plan, HOST, tensor.reshape(1) if tensor.ndim == 0 else tensor, None)


def _carried_run(plan: AllgatherPlan, collective: str, name: str | None, tensor: np.ndarray,
                 output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan whose row counts ride in the agreement (see
    :class:`CallForms`): the new array."""
    return _carried(plan, tensor)


FORMS = CallForms("allgather", _prepare, kept_allgather_plan, _planned, _carried_run)
