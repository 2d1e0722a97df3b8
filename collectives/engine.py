"""The collectives' engine: what the trainer (and any other front end built on the
collectives) may use besides the public API. Everything else in ``collectives`` whose
name starts with ``_`` is private to it.

The contract:

- :func:`allreduce_plan` validates an allreduce of buffers like a given one once (host
  arrays, or with ``on_device=True`` device memory) and returns its plan; :func:`reduce_planned`
  runs it on a flat buffer and :func:`reduce_fused` on tensors packed into a fusion
  buffer. Both must run in program order on every rank: inside a body given to
  :func:`execute` or :func:`submit`.
- :func:`execute` runs a body in program order on the caller's thread (or returns a
  :class:`Handle` with ``asynchronous=True``); :func:`submit` queues it on the
  collectives thread and returns its :class:`Handle`; :func:`inside_a_call` says whether
  the caller is inside a call in progress (a callback a completing call runs), where a
  call must run at once instead of being queued behind the one it is in.
- :func:`phase` records a phase of the call in progress on the timeline.
- :func:`device_tensor` describes a tensor in GPU memory (None for host tensors), and
  :func:`on_device` is the context a call on it runs in (its GPU current, its producer
  stream finished); :func:`is_torch_tensor`, :func:`torch_view` (a torch CPU tensor as a
  numpy array, bfloat16 as ``ml_dtypes.bfloat16``, no copy) and :func:`torch_from_host`
  (back) are how the collectives see torch tensors.
- :func:`resolve_group` gives the group of a process set, :func:`end_of_sequence` closes
  a sequence of collectives that every rank must have made alike, :data:`COPY_DTYPES`
  are the dtypes the collectives move.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager

from ._objects import end_of_sequence
from .base._buffers import DeviceTensor, device_tensor, is_torch_tensor, torch_from_host, torch_view
from .base._executor import Handle
from .base._ops import COPY_DTYPES
from .base._tracing import phase
from .calls._allreduce_run import reduce_fused, reduce_planned
from .calls._calls import execute
from .calls._allreduce_plan import AllreducePlan, allreduce_plan
from .memory._memory import STAGED
from .memory._placement import memory_for
from .world._process_sets import ProcessSet, resolve_group
from .world._world import world

__all__ = [
    "AllreducePlan", "COPY_DTYPES", "DeviceTensor", "Handle", "allreduce_plan",
    "device_tensor", "end_of_sequence", "execute", "inside_a_call", "is_torch_tensor",
    "on_device", "phase", "reduce_fused", "reduce_planned", "resolve_group", "submit",
    "torch_from_host", "torch_view",
]


def submit(collective: str, name: str | None, body: Callable[[], Any],
           process_set: ProcessSet | None = None) -> Handle:
    """Queue ``body`` on the collectives thread, in program order; its handle.

    A named body on ``process_set`` that other threads' calls overtake on some rank is
    matched with the others' by its name (see :func:`execute`).
    """
    return execute(collective, name, body, asynchronous=True, process_set=process_set)


def inside_a_call() -> bool:
    """Whether the calling thread is inside a collective call in progress (e.g. a done
    callback of a handle, which the collectives thread runs as the call completes)."""
    return world().executor.holds_turn()


def on_device(tensor: DeviceTensor) -> ContextManager[Any]:
    """The context of a call on device ``tensor``: its GPU current, and the stream that
    produced it finished."""
    return memory_for(STAGED, tensor.device).entered(tensor)
