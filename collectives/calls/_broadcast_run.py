"""Running planned broadcasts: the call validated into its body, the data phase after
the agreement, and the runs of a kept plan; the call forms declared (:data:`FORMS`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..agreement._agreement import agree
from ..algorithms import _broadcast_algorithms, _hierarchical, _native
from ..base._buffers import device_tensor
from ..base._checks import byte_view, flat, in_place_array, input_array
from ..base._group import Group
from ..config import current_settings
from ..memory._memory import AWARE, HOST, HostMemory, goes_direct
from ..memory._placement import memory_for, staged
from ..world._process_sets import ProcessSet
from ..world._topology import NodeLayout, hierarchy_for
from ._broadcast_plan import BroadcastPlan, broadcast_plan, kept_broadcast_plan
from ._forms import CallForms


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
    plan = broadcast_plan(collective, array, root_rank, name, process_set, algorithm,
                          on_device is not None)
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


def _broadcast(plan: BroadcastPlan, memory: Any, array: Any, source: Any, owner: Any,
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


def _planned(plan: BroadcastPlan, collective: str, name: str | None, tensor: np.ndarray,
             output: np.ndarray | None, arguments: tuple) -> np.ndarray:
    """The run of a kept plan (see :class:`CallForms`): into ``output``, ``tensor``
    itself in place, or (None) into a new array."""
    return _broadcast(plan, HOST, tensor, tensor, tensor, output is not None)


def _carried(plan: BroadcastPlan, array: np.ndarray, output: np.ndarray) -> None:
    """A small broadcast in the agreement's own messages, into C-contiguous ``output``."""
    plan.carried.run(byte_view(array), byte_view(output))


def _carried_run(plan: BroadcastPlan, collective: str, name: str | None, tensor: np.ndarray,
                 output: np.ndarray, arguments: tuple) -> None:
    """The run of a kept plan whose data rides in the agreement (see :class:`CallForms`)."""
    _carried(plan, tensor, output)


FORMS = CallForms("broadcast", _prepare, kept_broadcast_plan, _planned, _carried_run,
                  carried_output=np.empty)
