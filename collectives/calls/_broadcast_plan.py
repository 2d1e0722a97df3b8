"""Broadcast plans: a call's arguments validated, its algorithm chosen and its signature
made once, before anything is sent, then reused by every call like it."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..agreement._call import BYTES, PAYLOAD_CAPACITY, Call
from ..agreement._carried import CarriedBroadcast
from ..agreement._checked import CheckedCollective, checked_collective
from ..algorithms._selection import broadcast_algorithm
from ..base._checks import root_in_group
from ..base._ops import COPY_DTYPES, check_dtype
from ..config import current_settings
from ..memory._memory import AWARE
from ..transport._compiled_checked import BROADCAST
from ..world._plan_cache import PlanCache
from ..world._process_sets import ProcessSet, resolve_group
from ..world._topology import layout_of


class BroadcastPlan:
    """A broadcast of arrays like the one given, validated and chosen once.

    Attributes:
        group, settings, layout: the call's, resolved (``layout`` None on device).
        root: the root's rank in ``group``.
        chosen: the algorithm (``native`` for device memory handed to MPI).
        inner: the schedule of a hierarchical broadcast, between and inside the nodes.
        call: the signature the ranks compare.
        carried: how a small host array travels in the agreement's messages, or None.
        checked: MPI's own broadcast made in the agreement's compiled call (host arrays,
            ``native``), or None.
    """

    def __init__(self, array: Any, root_rank: Any, name: str | None,
                 process_set: ProcessSet | None, algorithm: str | None, collective: str,
                 on_device: bool):
        check_dtype(array.dtype, COPY_DTYPES, collective, name)
        self.settings = settings = current_settings()
        self.group = group = resolve_group(process_set, collective, name)
        self.root = root_in_group(group, root_rank, collective, name)
        self.carried: CarriedBroadcast | None = None
        self.checked: CheckedCollective | None = None
        if on_device:
            self.layout, self.chosen, self.inner = None, "native", ""
            self.call = Call(collective="broadcast", name=name, root_rank=int(root_rank),
                             dtype=array.dtype, shape=array.shape, algorithm="native",
                             memory=AWARE)
            return
        self.layout = layout = layout_of(group, settings)
        self.chosen = chosen = broadcast_algorithm(algorithm, array.nbytes, group.size,
                                                   settings, name, layout)
        self.inner = "pipeline" if array.nbytes >= settings.broadcast_pipeline_min_bytes \
            else "binomial"
        hierarchical = chosen == "hierarchical"
        self.call = Call(collective="broadcast", name=name, root_rank=int(root_rank),
                         dtype=array.dtype, shape=array.shape, algorithm=chosen,
                         segment_bytes=settings.segment_bytes
                         if chosen == "pipeline" or hierarchical else None,
                         **({"layout": layout.describe(), "schedule": self.inner}
                            if hierarchical else {}))
        if chosen == "native":
            self.checked = checked_collective(group, self.call, BROADCAST, BYTES,
                                              array.nbytes, root=self.root)
        if chosen == "recursive_doubling" and array.nbytes <= PAYLOAD_CAPACITY:
            self.carried = CarriedBroadcast(group, self.call, array.nbytes, self.root)


_PLANS: PlanCache[BroadcastPlan] = PlanCache()


def broadcast_plan(collective: str, array: Any, root_rank: Any, name: str | None,
                   process_set: ProcessSet | None, algorithm: str | None,
                   on_device: bool = False) -> BroadcastPlan:
    """The plan of a broadcast of arrays like ``array`` (anything with ``shape``, ``dtype``
    and ``nbytes``; device memory with ``on_device``), kept for the calls like it.

    Raises what :func:`ringtrain.broadcast` raises before any communication.
    """
    key = _key(collective, on_device, array, root_rank, name, process_set, algorithm)
    return _PLANS.get(key, process_set, collective, name) or _PLANS.keep(key, BroadcastPlan(
        array, root_rank, name, process_set, algorithm, collective, on_device))


def kept_broadcast_plan(collective: str, tensor: np.ndarray, name: str | None,
                        process_set: ProcessSet | None,
                        arguments: tuple) -> BroadcastPlan | None:
    """The plan :func:`broadcast_plan` made before for a broadcast of host array
    ``tensor`` with ``arguments`` (root rank, algorithm), if it is still valid; else None."""
    root_rank, algorithm = arguments
    return _PLANS.get(_key(collective, False, tensor, root_rank, name, process_set, algorithm),
                      process_set, collective, name)


def _key(collective: str, on_device: bool, array: Any, root_rank: Any, name: str | None,
         process_set: ProcessSet | None, algorithm: str | None) -> tuple:
    """What a broadcast's plan is kept by."""
    return (collective, on_device, array.shape, array.dtype, type(root_rank), root_rank, name,
            process_set, algorithm)
