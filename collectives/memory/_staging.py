"""Device tensors through host memory, for an MPI that must not see device pointers.

Copies go through page-locked (pinned) host buffers, which the GPU reads and writes by
DMA. :func:`through_host` pipelines a reduction: while one segment is reduced across
ranks, the next is copied down and the previous one copied up. :func:`staged` runs any
host collective on a pinned copy of a device tensor and hands the result back on the
device. Everything here runs on the collectives' thread, one call at a time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ...kernels import device
from ...kernels.reduction import Combine
from ..algorithms._data_phase import reduce_flat
from ..base._buffers import DeviceTensor
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._tracing import phase
from ..world._topology import NodeLayout

PIPELINE_BYTES = 4 << 20
"""Segment of the copy/reduce pipeline: big enough that a copy runs at full link speed,
small enough that the first copy and the last one hide little of the reduction."""
PIPELINE_SLOTS = 3
"""Pinned segment buffers of the pipeline: one copied down, one reduced, one copied up."""


class PinnedPool:
    """Pinned host buffers kept for reuse, by power-of-two size class.

    Pinning memory costs about as much as copying it once, so buffers are kept: at most
    ``per_class`` free ones of each size, none larger than ``largest_kept`` bytes (page-
    locked memory is taken from the whole machine).
    """

    def __init__(self, per_class: int = 2, largest_kept: int = 64 << 20):
        self.per_class = per_class
        self.largest_kept = largest_kept
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A pinned buffer of at least ``nbytes`` bytes (uint8)."""
        size_class = 1 << max(12, (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            free = self._free.get(size_class)
            if free:
                return free.pop()
        return device.pinned_bytes(size_class)

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer from :meth:`take`."""
        if buffer.nbytes > self.largest_kept:
            return
        with self._lock:
            free = self._free.setdefault(buffer.nbytes, [])
            if len(free) < self.per_class:
                free.append(buffer)


POOL = PinnedPool()
_engines: dict[int, device.CopyEngine] = {}
_scratch: dict[tuple[str, int, np.dtype], Any] = {}


def scratch(use: str, ordinal: int, size: int, dtype: Any) -> Any:
    """A device buffer of ``size`` elements of ``dtype`` on device ``ordinal`` (made
    current by the caller) for ``use`` (buffers of different uses never alias), reused
    by later calls: valid until the call returns."""
    key = (use, ordinal, np.dtype(dtype))
    buffer = _scratch.get(key)
    if buffer is None or buffer.size < size:
        buffer = _scratch[key] = device.empty((max(size, 1),), dtype)
    return buffer[:size]


def copy_engine(ordinal: int) -> device.CopyEngine:
    """The copy streams of device ``ordinal`` (made current by the caller)."""
    engine = _engines.get(ordinal)
    if engine is None:
        engine = _engines[ordinal] = device.CopyEngine()
    return engine


def host_array(buffer: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The first bytes of a pinned ``buffer`` as an array of ``shape`` and ``dtype``."""
    count = math.prod(shape)
    return buffer[:count * dtype.itemsize].view(dtype).reshape(shape)


def through_host(group: Group, algorithm: str, source: Any, result: Any, dtype: np.dtype,
                 op: ReduceOp, combine: Combine, finish: Callable | None,
                 segment_bytes: int, encoding: str | None, layout: NodeLayout,
                 ordinal: int) -> None:
    """Reduce device ``source`` into device ``result`` (may be it) across ranks, through
    pinned host memory in pipelined segments; returns once ``result`` is written.

    Segments rotate through :data:`PIPELINE_SLOTS` pinned buffers, so the host memory
    used is a few segments whatever the size: while segment k is reduced across ranks,
    segment k+1 is copied down and segment k-1 up. The arguments after ``dtype`` are
    those of the host reduction (:func:`._data_phase.reduce_flat`), run on each segment.
    """
    nbytes = device.nbytes_of(source)
    if nbytes == 0:
        return
    step = max(dtype.itemsize, PIPELINE_BYTES // dtype.itemsize * dtype.itemsize)
    bounds = list(range(0, nbytes, step)) + [nbytes]
    pieces = list(zip(bounds, bounds[1:]))
    slots = min(PIPELINE_SLOTS, len(pieces))
    buffer = POOL.take(slots * step)
    hosts = [buffer[slot * step:(slot + 1) * step] for slot in range(slots)]
    uploaded: list[Any] = [None] * slots
    down, up = device.byte_view(source), device.byte_view(result)
    engine = copy_engine(ordinal)

    def copy_down(index: int) -> Any:
        slot = index % slots
        if uploaded[slot] is not None:  # the slot's last segment must be on its way up
            uploaded[slot].synchronize()
        start, end = pieces[index]
        return engine.to_host(down[start:end], hosts[slot][:end - start])

    try:
        copied = copy_down(0)
        for index, (start, end) in enumerate(pieces):
            with phase("copy to host", bytes=end - start):
                copied.synchronize()
            if index + 1 < len(pieces):
                copied = copy_down(index + 1)
            host = hosts[index % slots][:end - start]
            values = host.view(dtype)
            reduce_flat(group, algorithm, values, values, op, combine, finish, segment_bytes,
                        encoding, layout)
            uploaded[index % slots] = engine.to_device(host, up[start:end])
        with phase("copy to device", bytes=nbytes):
            engine.finish()
    finally:
        engine.finish()  # no copy may still use the buffer once it is given back
        POOL.give(buffer)


def staged(tensor: DeviceTensor, in_place: bool,
           host_collective: Callable[[np.ndarray], Callable[[], Any]]) -> Callable[[], Any]:
    """Run a host collective on a pinned copy of device ``tensor``.

    ``host_collective(array)`` validates its arguments and returns the collective's
    body (as the host ``_prepare`` functions do); it is called at once, so bad
    arguments are refused before anything is queued.

    Returns:
        The body for the device tensor: it copies the tensor down, runs the host body,
        and returns the caller's tensor refilled (in place) or the host result as a new
        tensor of the caller's kind (a tuple's first item only: alltoall's splits stay
        on the host).
    """
    buffer = POOL.take(tensor.nbytes)
    mirror = host_array(buffer, tensor.shape, tensor.dtype)
    try:
        body = host_collective(mirror)
    except BaseException:
        POOL.give(buffer)
        raise

    def run() -> Any:
        try:
            with device.on_device(tensor.device):
                tensor.wait_for_producer()
                if tensor.nbytes:
                    with phase("copy to host", bytes=tensor.nbytes):
                        device.copy_to_host(device.byte_view(tensor.memory),
                                            mirror.reshape(-1).view(np.uint8))
                result = body()
                if in_place and tensor.nbytes:
                    with phase("copy to device", bytes=tensor.nbytes):
                        target = device.byte_view(tensor.memory)
                        device.copy_to_device(mirror.reshape(-1).view(np.uint8), target)
                        device.synchronize(target)
                if in_place:
                    return tensor.owner
                if isinstance(result, tuple):
                    return (to_device(tensor, result[0]), *result[1:])
                return to_device(tensor, result)
        finally:
            POOL.give(buffer)

    return run


def to_device(like: DeviceTensor, array: np.ndarray) -> Any:
    """A new tensor of ``like``'s kind and device holding host ``array``."""
    out = like.new(array.shape, array.dtype)
    if array.size:
        with phase("copy to device", bytes=array.nbytes):
            target = device.byte_view(out)
            device.copy_to_device(np.ascontiguousarray(array).reshape(-1).view(np.uint8),
                                  target)
            device.synchronize(target)
    return out
