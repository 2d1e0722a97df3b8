"""Allgather plans: a call's arguments validated, its algorithm chosen and its signature
made once, before anything is sent, then reused by every call like it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..agreement._call import BYTES, Call
from ..agreement._carried import CarriedGather
from ..agreement._checked import CheckedCollective, checked_collective
from ..algorithms._selection import auto_choice, requested
from ..base._ops import COPY_DTYPES, check_dtype
from ..config import current_settings
from ..memory._memory import AWARE
from ..transport._compiled_checked import ALLGATHER, MAILBOX_ALLGATHER
from ..transport._mailboxes import mailboxes_of
from ..world._plan_cache import PlanCache
from ..world._process_sets import ProcessSet, resolve_group
from ..world._topology import layout_of


class AllgatherPlan:
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


_PLANS: PlanCache[AllgatherPlan] = PlanCache()


def allgather_plan(array: Any, name: str | None, process_set: ProcessSet | None,
                   algorithm: str | None, on_device: bool = False) -> AllgatherPlan:
    """The plan of an allgather of arrays like ``array`` (anything with ``shape``,
    ``dtype`` and ``nbytes``; device memory with ``on_device``), kept for the calls like
    it.

    Raises what :func:`ringtrain.allgather` raises before any communication.
    """
    key = _key(on_device, array, name, process_set, algorithm)
    return _PLANS.get(key, process_set, "allgather", name) or _PLANS.keep(key, AllgatherPlan(
        array, name, process_set, algorithm, on_device))


def kept_allgather_plan(collective: str, tensor: np.ndarray, name: str | None,
                        process_set: ProcessSet | None,
                        arguments: tuple) -> AllgatherPlan | None:
    """The plan :func:`allgather_plan` made before for an allgather of host array
    ``tensor`` with ``arguments`` (the algorithm), if it is still valid; else None."""
    return _PLANS.get(_key(False, tensor, name, process_set, arguments[0]), process_set,
                      collective, name)


def _key(on_device: bool, array: Any, name: str | None, process_set: ProcessSet | None,
         algorithm: str | None) -> tuple:
    """What an allgather's plan is kept by."""
    return (on_device, array.shape, array.dtype, name, process_set, algorithm)
