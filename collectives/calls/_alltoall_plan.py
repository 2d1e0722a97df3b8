"""Alltoall plans: a call's arguments validated, its algorithm chosen and its signature
made once, before anything is sent, then reused by every call like it (the splits, which
may change from call to call, are checked at every call)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..agreement._call import BYTES, Call
from ..agreement._carried import CarriedGather
from ..agreement._checked import CheckedCollective, checked_collective
from ..algorithms._selection import auto_choice, requested
from ..base._checks import check_splits, check_splittable
from ..base._ops import COPY_DTYPES, check_dtype
from ..config import current_settings
from ..memory._memory import AWARE
from ..transport._compiled_checked import ALLTOALL, MAILBOX_ALLTOALL
from ..transport._mailboxes import mailboxes_of
from ..world._plan_cache import PlanCache
from ..world._process_sets import ProcessSet, resolve_group
from ..world._topology import layout_of


@dataclass(frozen=True)
class Movement:
    """An alltoall's data phase: the bytes sent to and received from each rank, the rows
    received in all, and the algorithm (``native`` or ``pairwise``)."""

    sent: list[int]
    received: list[int]
    rows: int
    algorithm: str


class AlltoallPlan:
    """An alltoall of arrays like the one given, validated and chosen once (the splits,
    which may change from call to call, are checked at every call).

    Attributes:
        group, settings: the call's, resolved.
        chosen: the algorithm (``native`` for device memory handed to MPI; ``auto``
            resolved once the ranks' splits are known).
        call: the signature the ranks compare.
        row_bytes: the bytes of one row.
        carried: how the splits matrix, and the whole send buffers where they are small,
            travel in the agreement's messages (``recursive_doubling``), or None.
        even_splits: the splits when none are given (rows cut as evenly as possible).
        even_matrix: the matrix of splits when no rank gives any, as a list of lists.
        even_move: the data phase when every rank's splits are the even ones and the rows
            do not ride in the agreement (``recursive_doubling`` plans only).
        even_received, even_block: then, the rows received from each rank, and the
            offset and length in bytes of this rank's block in every rank's send buffer.
        layout: the group's node layout (host memory).
        checked: where the even splits send as many rows to every rank and MPI's own
            alltoall or the pairwise exchange through the node's mailboxes moves them,
            the check (the splits with it) and the alltoall in one compiled call; or
            None.
    """

    def __init__(self, array: Any, name: str | None, process_set: ProcessSet | None,
                 algorithm: str | None, on_device: bool):
        check_dtype(array.dtype, COPY_DTYPES, "alltoall", name)
        check_splittable(array.shape, "alltoall", name)
        self.settings = settings = current_settings()
        self.group = group = resolve_group(process_set, "alltoall", name)
        row_shape = tuple(array.shape[1:])
        self.row_bytes = row_bytes = array.dtype.itemsize * math.prod(row_shape)
        self.carried: CarriedGather | None = None
        self.checked: CheckedCollective | None = None
        self.even_splits = check_splits(None, array.shape[0], group.size, name)
        self.even_matrix = [self.even_splits.tolist()] * group.size
        if on_device:
            self.chosen = "native"
            self.call = Call(collective="alltoall", name=name, dtype=array.dtype,
                             algorithm="native", memory=AWARE, **{"shape[1:]": row_shape})
            return
        chosen = requested("alltoall", algorithm, settings, name)
        if chosen == "auto":
            chosen = "recursive_doubling"  # the splits ride in the agreement (see _carried)
        self.chosen = chosen
        self.call = Call(collective="alltoall", name=name, dtype=array.dtype,
                         algorithm=chosen, **{"shape[1:]": row_shape})
        self.layout = layout_of(group, settings)
        if chosen == "recursive_doubling":
            received = int(self.even_splits[group.rank])
            self.even_received = np.full(group.size, received, np.int64)
            self.even_block = (int(self.even_splits[:group.rank].sum()) * row_bytes,
                               received * row_bytes)
            self.even_move = Movement(
                (self.even_splits * row_bytes).tolist(), [received * row_bytes] * group.size,
                received * group.size, auto_choice("alltoall", array.nbytes, group.size,
                                                   settings, self.layout))
            moved_by = self.even_move.algorithm
            self.carried = CarriedGather(group, self.call, group.size,
                                         array.nbytes if moved_by == "recursive_doubling" else 0)
            kind = ALLTOALL if moved_by == "native" else \
                MAILBOX_ALLTOALL if moved_by == "pairwise" and mailboxes_of(group) else None
            if kind is not None and len(set(self.even_move.sent)) == 1:
                self.checked = checked_collective(group, self.call, kind, BYTES,
                                                  self.even_move.sent[0],
                                                  words=self.even_splits)


_PLANS: PlanCache[AlltoallPlan] = PlanCache()


def alltoall_plan(array: Any, name: str | None, process_set: ProcessSet | None,
                  algorithm: str | None, on_device: bool = False) -> AlltoallPlan:
    """The plan of an alltoall of arrays like ``array`` (anything with ``shape``, ``dtype``
    and ``nbytes``; device memory with ``on_device``), kept for the calls like it.

    Raises what :func:`ringtrain.alltoall` raises before any communication, the splits
    aside.
    """
    key = _key(on_device, array, name, process_set, algorithm)
    return _PLANS.get(key, process_set, "alltoall", name) or _PLANS.keep(key, AlltoallPlan(
        array, name, process_set, algorithm, on_device))


def kept_alltoall_plan(collective: str, tensor: np.ndarray, name: str | None,
                       process_set: ProcessSet | None,
                       arguments: tuple) -> AlltoallPlan | None:
    """The plan :func:`alltoall_plan` made before for an alltoall of host array ``tensor``
    with the even splits and ``arguments``' algorithm, if it is still valid; else None
    (only a small call's, whose splits ride in the agreement, runs by it)."""
    splits, algorithm = arguments
    if splits is not None:
        return None
    return _PLANS.get(_key(False, tensor, name, process_set, algorithm), process_set,
                      collective, name)


def _key(on_device: bool, array: Any, name: str | None, process_set: ProcessSet | None,
         algorithm: str | None) -> tuple:
    """What an alltoall's plan is kept by."""
    return (on_device, array.shape, array.dtype, name, process_set, algorithm)
