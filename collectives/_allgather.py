"""allgather: every rank's rows, concatenated along axis 0 in rank order."""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import numpy as np

from .agreement._agreement import agree
from .agreement._call import BYTES, Call
from .agreement._carried import CarriedGather
from .agreement._checked import CheckedCollective, checked_collective
from .algorithms import _hierarchical, _native, _ring
from .algorithms._selection import auto_choice, requested
from .base._buffers import device_tensor
from .base._checks import byte_view, flat, input_array
from .base._executor import Handle
from .base._group import Group
from .base._ops import COPY_DTYPES, check_dtype
from .calls._forms import CallForms
from .config import Settings, current_settings
from .memory._memory import AWARE, HOST, HostMemory, goes_direct
from .memory._placement import memory_for, staged
from .transport import _pairwise
from .transport._compiled_checked import ALLGATHER, MAILBOX_ALLGATHER
from .transport._mailboxes import mailboxes_of
from .world._plan_cache import PlanCache
from .world._process_sets import ProcessSet, resolve_group
from .world._topology import NodeLayout, hierarchy_for, layout_of


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
        algorithm: ``ring``, ``pairwise``, ``hierarchical``, ``native`` or ``auto``
            (the tuning table's choice for the gathered size).

    Returns:
        A new array of shape ``(sum of first dimensions, *tensor.shape[1:])``.
    """
    return _FORMS.blocking(False, tensor, name, process_set, (algorithm,))


def allgather_async(tensor: np.ndarray, name: str | None = None,
                    process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None) -> Handle:
    """Start :func:`allgather`; ``synchronize(handle)`` returns the new array."""
    return _FORMS.start(False, tensor, name, process_set, (algorithm,))


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


class _AllgatherPlan:
    """An allgather of arrays like the one given, validated and chosen once.

    Attributes:
        group, settings, layout: the call's, resolved (``layout`` None on device).
        row_shape: the shape of one row.
        chosen: the algorithm (``native`` for device memory handed to MPI; ``auto``
            resolved once the ranks' row counts are known).
        call: the signature the ranks compare.
        gather_layout: ``layout`` where the rows may take the hierarchical algorithm
            (it is then part of ``call``), else None.
        carried: how the ranks' row counts, and their rows where they fit, travel in the
            agreement's messages (``recursive_doubling``), or None.
        count: this rank's row count, as ``carried``'s words.
        even_counts: every rank's row count when each gives as many rows as this one.
        even_shape, even_sizes, even_choice: then, the result's shape, the bytes of each
            rank and ``auto``'s algorithm.
        checked: where the rows do not ride and MPI's own allgather or the pairwise
            exchange through the node's mailboxes moves them, the check (the row counts
            with it) and the allgather in one compiled call; or None.
    """

    def __init__(self, array: Any, name: str | None, process_set: ProcessSet | None,
                 algorithm: str | None, on_device: bool):
        check_dtype(array.dtype, COPY_DTYPES, "allgather", name)
        self.settings = settings = current_settings()
        self.group = group = resolve_group(process_set, "allgather", name)
        self.row_shape = row_shape = tuple(array.shape[1:])
        self.carried: CarriedGather | None = None
        self.checked: CheckedCollective | None = None
        if on_device:
            self.layout, self.chosen = None, "native"
            self.call = Call(collective="allgather", name=name, dtype=array.dtype,
                             algorithm="native", memory=AWARE, **{"shape[1:]": row_shape})
            return
        chosen = requested("allgather", algorithm, settings, name)
        self.layout = layout = layout_of(group, settings)
        row_bytes = array.dtype.itemsize * math.prod(row_shape)
        if chosen == "auto" and (not layout.pays_off or auto_choice(
                "allgather", row_bytes * group.size, group.size, settings,
                layout) == "recursive_doubling"):
            # The row counts ride in the agreement (the rows too where they fit): decided
            # on the layout and the row size, which all ranks share.
            chosen = "recursive_doubling"
        self.chosen = chosen
        if chosen == "recursive_doubling":
            self.even_choice = auto_choice("allgather", array.nbytes * group.size,
                                           group.size, settings, layout)
        # The layout where the rows may go the hierarchical way (a signature field, so
        # that ranks whose layouts differ fail instead of waiting), else None.
        self.gather_layout = layout if chosen == "hierarchical" or layout.pays_off and (
            chosen == "auto" or chosen == "recursive_doubling"
            and self.even_choice == "hierarchical") else None
        extra = {} if self.gather_layout is None else \
            {"layout": layout.describe(), "segment_bytes": settings.segment_bytes}
        self.call = Call(collective="allgather", name=name, dtype=array.dtype,
                         algorithm=chosen, **{"shape[1:]": row_shape}, **extra)
        if chosen == "recursive_doubling":
            rows = array.shape[0] if array.shape else 1
            # The rows ride where the table takes recursive doubling for their size.
            self.carried = CarriedGather(group, self.call, 1, array.nbytes
                                         if self.even_choice == "recursive_doubling" else 0)
            self.count = np.array([rows], np.int64)
            self.even_counts = np.full(group.size, rows, np.int64)
            self.even_shape = (rows * group.size, *row_shape)
            self.even_sizes = [array.nbytes] * group.size
            kind = ALLGATHER if self.even_choice == "native" else MAILBOX_ALLGATHER \
                if self.even_choice == "pairwise" and mailboxes_of(group) else None
            if not self.carried.carries_data and kind is not None:
                self.checked = checked_collective(group, self.call, kind, BYTES,
                                                  array.nbytes, words=self.count)


_PLANS: PlanCache[_AllgatherPlan] = PlanCache()


def _prepare(collective: str, tensor: Any, name: str | None, process_set: ProcessSet | None,
             algorithm: str | None) -> Callable[[], Any]:
    on_device = device_tensor(tensor, collective, name)
    if on_device is not None and not goes_direct(algorithm,
                                                 current_settings().allgather_algorithm):
        return staged(on_device, False,
                      lambda array: _prepare(collective, array, name, process_set, algorithm))
    array = on_device if on_device is not None else input_array(tensor, collective, name)
    key = _key(on_device is not None, array, name, process_set, algorithm)
    plan = _PLANS.get(key, process_set, collective, name) or _PLANS.keep(key, _AllgatherPlan(
        array, name, process_set, algorithm, on_device is not None))
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


def _gathered(plan: _AllgatherPlan, memory: HostMemory, rows: Any, like: Any) -> Any:
    """An allgather as ``plan`` says, once checked, of ``rows`` (a host array, or the
    memory of device tensor ``like``): agree, then gather; the new array."""
    agree(plan.group, plan.call)
    return gather_rows(plan.group, rows, plan.row_shape, plan.chosen, plan.layout,
                       plan.settings.segment_bytes, memory, like, plan.settings)[0]


def _key(on_device: bool, array: Any, name: str | None, process_set: ProcessSet | None,
         algorithm: str | None) -> tuple:
    """What an allgather's plan is kept by."""
    return (on_device, array.shape, array.dtype, name, process_set, algorithm)


def _carried(plan: _AllgatherPlan, array: np.ndarray) -> np.ndarray:
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


def _kept(collective: str, tensor: np.ndarray, name: str | None,
          process_set: ProcessSet | None, arguments: tuple) -> _AllgatherPlan | None:
    """The plan of an allgather made before like this one, if still valid."""
    return _PLANS.get(_key(False, tensor, name, process_set, arguments[0]), process_set,
                      collective, name)


def _planned(plan: _AllgatherPlan, collective: str, name: str | None, tensor: np.ndarray,
             output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan (see :class:`CallForms`): the new array."""
    return _gathered(plan, HOST, tensor.reshape(1) if tensor.ndim == 0 else tensor, None)


def _carried_run(plan: _AllgatherPlan, collective: str, name: str | None, tensor: np.ndarray,
                 output: None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan whose row counts ride in the agreement (see
    :class:`CallForms`): the new array."""
    return _carried(plan, tensor)


_FORMS = CallForms("allgather", _prepare, _kept, _planned, _carried_run)
