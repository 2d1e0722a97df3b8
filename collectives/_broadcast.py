"""broadcast and its in-place and asynchronous forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .agreement._agreement import agree
from .agreement._call import BYTES, PAYLOAD_CAPACITY, Call
from .agreement._carried import CarriedBroadcast
from .agreement._checked import CheckedCollective, checked_collective
from .algorithms import _broadcast_algorithms, _hierarchical, _native
from .algorithms._selection import broadcast_algorithm
from .base._buffers import device_tensor
from .base._checks import byte_view, flat, in_place_array, input_array, root_in_group
from .base._executor import Handle
from .base._group import Group
from .base._ops import COPY_DTYPES, check_dtype
from .calls._forms import CallForms
from .config import current_settings
from .memory._memory import AWARE, HOST, HostMemory, goes_direct
from .memory._placement import memory_for, staged
from .transport._compiled_checked import BROADCAST
from .world._plan_cache import PlanCache
from .world._process_sets import ProcessSet, resolve_group
from .world._topology import NodeLayout, hierarchy_for, layout_of


def broadcast(tensor: np.ndarray, root_rank: int, name: str | None = None,
              process_set: ProcessSet | None = None, *,
              algorithm: str | None = None) -> np.ndarray:
    """Return a new array holding ``root_rank``'s ``tensor`` on every rank.

    Args:
        tensor: on the root, the data; elsewhere an array of the same shape and dtype
            (its values are not used).
        root_rank: world rank of the sender; must be in the process set.
        name: names the tensor in error messages; the same on every rank.
        process_set: the ranks taking part (default: all).
        algorithm: ``binomial``, ``pipeline``, ``hierarchical``, ``native`` or ``auto``.

    Raises:
        MismatchError: ranks passed different shapes, dtypes, roots or names.
    """
    return _FORMS.blocking(False, tensor, name, process_set, (root_rank, algorithm))


def broadcast_(tensor: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None, *,
               algorithm: str | None = None) -> np.ndarray:
    """In-place :func:`broadcast`: ``tensor`` receives the root's data and is returned."""
    return _FORMS.blocking(True, tensor, name, process_set, (root_rank, algorithm))


def broadcast_async(tensor: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None) -> Handle:
    """Start :func:`broadcast`; ``synchronize(handle)`` returns the new array."""
    return _FORMS.start(False, tensor, name, process_set, (root_rank, algorithm))


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None, *,
                     algorithm: str | None = None) -> Handle:
    """Start :func:`broadcast_`."""
    return _FORMS.start(True, tensor, name, process_set, (root_rank, algorithm))


def broadcast_bytes(group: Group, data: Any, root: int, algorithm: str,
                    segment_bytes: int, layout: NodeLayout | None = None,
                    inner: str = "pipeline", memory: HostMemory = HOST) -> None:
    """The data phase of a broadcast, after agreement: 1-D uint8 ``data`` from ``root``
    (``native`` also takes device memory, with its ``memory``).

    ``hierarchical`` needs the agreed ``layout``, and runs ``inner`` (``pipeline`` or
    ``binomial``) between and inside the nodes.
    """
    nbytes = memory.nbytes(data)
    if group.size == 1 or nbytes == 0:
        return
    if algorithm == "hierarchical":
        _hierarchical.broadcast(hierarchy_for(group, layout), data, root, inner,
                                segment_bytes)
    elif algorithm == "pipeline":
        _broadcast_algorithms.pipeline(group, data, root, segment_bytes)
    elif algorithm in ("binomial", "recursive_doubling"):
        # recursive_doubling rides in the agreement (see _carried); data that follows
        # an agreement, as an object's, goes down the tree.
        _broadcast_algorithms.binomial(group, data, root)
    else:
        _native.broadcast(group, memory.for_mpi(data, np.uint8), root, nbytes,
                          **memory.phase_args)


class _BroadcastPlan:
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


_PLANS: PlanCache[_BroadcastPlan] = PlanCache()


def _prepare(collective: str, tensor: Any, name: str | None, process_set: ProcessSet | None,
             root_rank: Any, algorithm: str | None) -> Callable[[], Any]:
    in_place = collective == "broadcast_"
    on_device = device_tensor(tensor, collective, name, in_place)
    if on_device is not None and not goes_direct(algorithm,
                                                 current_settings().broadcast_algorithm):
        return staged(on_device, in_place, lambda array: _prepare(
            collective, array, name, process_set, root_rank, algorithm))
    array = on_device if on_device is not None else \
        (in_place_array if in_place else input_array)(tensor, collective, name)
    key = _key(collective, on_device is not None, array, root_rank, name, process_set,
               algorithm)
    plan = _PLANS.get(key, process_set, collective, name) or _PLANS.keep(key, _BroadcastPlan(
        array, root_rank, name, process_set, algorithm, collective, on_device is not None))
    if on_device is not None:
        memory = memory_for(AWARE, on_device.device)
        source, owner = on_device.memory, on_device.owner
    else:
        memory, source, owner = HOST, array, array

    if plan.carried is not None:
        def run_carried() -> np.ndarray:
            output = array if in_place and array.flags.c_contiguous else \
                np.empty(array.shape, array.dtype)
            _carried(plan, array, output)
            if in_place and output is not array:
                array[...] = output
            return array if in_place else output

        return run_carried

    def run() -> Any:
        with memory.entered(*([] if on_device is None else [on_device])):
            return _broadcast(plan, memory, array, source, owner, in_place)

    return run


def _broadcast(plan: _BroadcastPlan, memory: Any, array: Any, source: Any, owner: Any,
               in_place: bool) -> Any:
    """A broadcast as ``plan`` says, once checked: agree, then move the root's data
    into the caller's tensor ``owner`` (in place) or into a new array. ``source`` is the
    data, a host array or device memory as ``memory`` takes it; ``array`` describes it."""
    group, root = plan.group, plan.root
    checked = plan.checked if memory is HOST else None
    if checked is None:
        agree(group, plan.call)
    if in_place:
        output, work = owner, flat(source) if memory is HOST else source
    else:
        output = memory.new(array, array.shape)
        work = output.reshape(-1) if memory is HOST else output
        if group.rank == root and checked is None:
            memory.copy(source, output)
    if checked is not None:
        # Out of place the root sends its input and copies it into the result after, so
        # the others read the bytes where they lie, not a copy just written in this
        # core's cache.
        sent = flat(source) if not in_place and group.rank == root else work
        data = sent.view(np.uint8)
        checked.run(data, data)
        if sent is not work:
            work[...] = sent
    else:
        broadcast_bytes(group, work.view(np.uint8) if memory is HOST else work, root,
                        plan.chosen, plan.settings.segment_bytes, plan.layout, plan.inner,
                        memory)
    if in_place and memory is HOST and not array.flags.c_contiguous:
        array[...] = work.reshape(array.shape)
    return output


def _kept(collective: str, tensor: np.ndarray, name: str | None,
          process_set: ProcessSet | None, arguments: tuple) -> _BroadcastPlan | None:
    """The plan of a broadcast made before like this one, if still valid."""
    root_rank, algorithm = arguments
    return _PLANS.get(_key(collective, False, tensor, root_rank, name, process_set, algorithm),
                      process_set, collective, name)


def _planned(plan: _BroadcastPlan, collective: str, name: str | None, tensor: np.ndarray,
             output: np.ndarray | None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan (see :class:`CallForms`): into ``output``, ``tensor``
    itself in place, or (None) into a new array."""
    return _broadcast(plan, HOST, tensor, tensor, tensor, output is not None)


def _key(collective: str, on_device: bool, array: Any, root_rank: Any, name: str | None,
         process_set: ProcessSet | None, algorithm: str | None) -> tuple:
    """What a broadcast's plan is kept by."""
    return (collective, on_device, array.shape, array.dtype, type(root_rank), root_rank, name,
            process_set, algorithm)


def _carried(plan: _BroadcastPlan, array: np.ndarray, output: np.ndarray) -> None:
    """A small broadcast in the agreement's own messages, into C-contiguous ``output``."""
    plan.carried.run(byte_view(array), byte_view(output))


def _carried_run(plan: _BroadcastPlan, collective: str, name: str | None, tensor: np.ndarray,
                 output: np.ndarray, arguments: tuple) -> None:
    """The run of a kept plan whose data rides in the agreement (see :class:`CallForms`)."""
    _carried(plan, tensor, output)


_FORMS = CallForms("broadcast", _prepare, _kept, _planned, _carried_run,
                   carried_output=np.empty)
