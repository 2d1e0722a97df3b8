"""Where each tensor lives in a fusion buffer: computed once per set of tensors, reused."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

DEFAULT_ALIGNMENT_BYTES = 64
"""Each tensor starts on a cache line (and, on a GPU, a whole number of 32-byte sectors)."""

TASK_ELEMENTS = 16384
"""Elements per GPU copy task: each thread block copies whole tasks."""


class FusionLayout:
    """Offsets of several tensors of one dtype packed into one flat buffer.

    Tensor ``i`` occupies ``buffer[offsets[i]:offsets[i] + sizes[i]]``; every offset is a
    multiple of ``alignment`` elements and the gaps between tensors (the padding) are
    zero after a pack, so a reduction over the whole buffer never meets stale values.

    Attributes:
        dtype: the element type of every tensor and of the buffer.
        shapes: the tensors' shapes, in order.
        sizes: elements per tensor (int64 array).
        offsets: first element of each tensor in the buffer (int64 array).
        alignment: in elements.
        total_size: elements in the buffer, padding included (a multiple of alignment).
        padding: ``(start, stop)`` element ranges between and after tensors.
        tasks: ``(tensor, start, count)`` rows, int64, at most ``TASK_ELEMENTS`` long,
            covering every tensor; tensor ``-1`` marks padding (``start`` is then an
            offset in the buffer). The GPU kernels split
            their work by these rows, one launch for the whole buffer.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtype: Any,
                 alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES):
        """Lay out tensors of the given shapes and dtype.

        Args:
            shapes: one shape per tensor; zero-size tensors are allowed.
            dtype: their common dtype.
            alignment_bytes: tensors start at multiples of this many bytes; a positive
                multiple of the dtype's size.

        Raises:
            ValueError: alignment not a positive multiple of the element size.
        """
        self.dtype = np.dtype(dtype)
        if alignment_bytes <= 0 or alignment_bytes % self.dtype.itemsize:
            raise ValueError(f"alignment_bytes must be a positive multiple of the element "
                             f"size {self.dtype.itemsize}, got {alignment_bytes}")
        self.alignment = alignment_bytes // self.dtype.itemsize
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]
        self.sizes = np.array([int(np.prod(s, dtype=np.int64)) for s in self.shapes],
                              np.int64)
        aligned = -(-self.sizes // self.alignment) * self.alignment
        self.offsets = np.concatenate(([0], np.cumsum(aligned)[:-1])).astype(np.int64) \
            if len(self.shapes) else np.zeros(0, np.int64)
        self.total_size = int(aligned.sum())
        self.padding = [(int(o + n), int(o + a)) for o, n, a in
                        zip(self.offsets, self.sizes, aligned) if a > n]
        self.tasks = self._tasks()
        self.device_tables: dict[Any, Any] = {}
        self._last_views: tuple[Any, list[Any]] | None = None

    @classmethod
    def of(cls, arrays: Sequence[Any],
           alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES) -> FusionLayout:
        """The layout of ``arrays`` (anything with ``shape`` and ``dtype``), all of one dtype.

        Raises:
            ValueError: the arrays have different dtypes.
        """
        dtypes = {np.dtype(a.dtype) for a in arrays}
        if len(dtypes) > 1:
            raise ValueError(f"a fusion buffer holds one dtype, got {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        return cls([a.shape for a in arrays], dtype, alignment_bytes)

    @property
    def count(self) -> int:
        """Number of tensors."""
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        """Bytes in the buffer, padding included."""
        return self.total_size * self.dtype.itemsize

    def empty_buffer(self) -> np.ndarray:
        """A new host buffer for this layout, padding zeroed."""
        return np.zeros(self.total_size, self.dtype)

    def views(self, buffer: Any) -> list[Any]:
        """Each tensor's place in ``buffer``, as an array of its shape (no copy).

        The views of the last buffer asked about are kept: a fusion buffer is packed and
        unpacked every step, and slicing hundreds of views costs more than copying
        small tensors.
        """
        cached = self._last_views
        if cached is not None and cached[0] is buffer:
            return cached[1]
        views = [buffer[o:o + n].reshape(s)
                 for o, n, s in zip(self.offsets.tolist(), self.sizes.tolist(), self.shapes)]
        self._last_views = (buffer, views)
        return views

    def check(self, tensors: Sequence[Any], buffer: Any) -> None:
        """Raise ValueError unless ``tensors`` and ``buffer`` fit this layout."""
        if [tuple(t.shape) for t in tensors] == self.shapes and \
                all(t.dtype == self.dtype for t in tensors) and \
                tuple(buffer.shape) == (self.total_size,) and buffer.dtype == self.dtype:
            return
        if len(tensors) != self.count:
            raise ValueError(f"layout holds {self.count} tensors, got {len(tensors)}")
        for index, (tensor, shape) in enumerate(zip(tensors, self.shapes)):
            if tuple(tensor.shape) != shape or np.dtype(tensor.dtype) != self.dtype:
                raise ValueError(f"tensor {index}: layout expects {shape} {self.dtype}, got "
                                 f"{tuple(tensor.shape)} {np.dtype(tensor.dtype)}")
        if tuple(buffer.shape) != (self.total_size,) or np.dtype(buffer.dtype) != self.dtype:
            raise ValueError(f"buffer must be 1-D of {self.total_size} {self.dtype}, got "
                             f"{tuple(buffer.shape)} {np.dtype(buffer.dtype)}")

    def _tasks(self) -> np.ndarray:
        rows = []
        for tensor, size in enumerate(self.sizes.tolist()):
            for start in range(0, size, TASK_ELEMENTS):
                rows.append((tensor, start, min(TASK_ELEMENTS, size - start)))
        for start, stop in self.padding:
            for first in range(start, stop, TASK_ELEMENTS):
                rows.append((-1, first, min(TASK_ELEMENTS, stop - first)))
        return np.array(rows, np.int64).reshape(-1, 3)

    def __repr__(self) -> str:
        return (f"FusionLayout({self.count} tensors, {self.dtype}, {self.total_size} elements, "
                f"alignment {self.alignment})")
