"""broadcast and its in-place and asynchronous forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import _broadcast_algorithms, _hierarchical
from ._agreement import Call, agree
from ._buffers import device_tensor, results_like, returns_itself
from ._calls import execute, flat, in_place_array, input_array
from ._executor import Handle
from ._group import Group
from ._ops import COPY_DTYPES, check_dtype
from ._process_sets import ProcessSet, resolve_group
from ._selection import broadcast_algorithm
from ._topology import Layout, hierarchy_for, layout_of
from .config import current_settings
from .errors import InvalidArgumentError, subject


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
    return execute("broadcast", name, _prepare(tensor, root_rank, name, process_set,
                                               algorithm, in_place=False),
                   restore=results_like(tensor))


def broadcast_(tensor: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet | None = None, *,
               algorithm: str | None = None) -> np.ndarray:
    """In-place :func:`broadcast`: ``tensor`` receives the root's data and is returned."""
    return execute("broadcast_", name, _prepare(tensor, root_rank, name, process_set,
                                                algorithm, in_place=True),
                   restore=returns_itself(tensor))


def broadcast_async(tensor: np.ndarray, root_rank: int, name: str | None = None,
                    process_set: ProcessSet | None = None, *,
                    algorithm: str | None = None) -> Handle:
    """Start :func:`broadcast`; ``synchronize(handle)`` returns the new array."""
    return execute("broadcast", name, _prepare(tensor, root_rank, name, process_set,
                                               algorithm, in_place=False), asynchronous=True,
                   restore=results_like(tensor))


def broadcast_async_(tensor: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet | None = None, *,
                     algorithm: str | None = None) -> Handle:
    """Start :func:`broadcast_`."""
    return execute("broadcast_", name, _prepare(tensor, root_rank, name, process_set,
                                                algorithm, in_place=True), asynchronous=True,
                   restore=returns_itself(tensor))


def root_in_group(group: Group, root_rank: Any, collective: str, name: str | None) -> int:
    """Translate a world root rank into its rank in ``group``; refuse one outside it."""
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: root_rank must be an int, "
            f"got {root_rank!r}")
    if root_rank not in group.world_ranks:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: root_rank {root_rank} is not "
            f"among the ranks {list(group.world_ranks)}")
    return group.world_ranks.index(int(root_rank))


def broadcast_bytes(group: Group, data: np.ndarray, root: int, algorithm: str,
                    segment_bytes: int, layout: Layout | None = None,
                    inner: str = "pipeline") -> None:
    """The data phase of a broadcast, after agreement: 1-D uint8 ``data`` from ``root``.

    ``hierarchical`` needs the agreed ``layout``, and runs ``inner`` (``pipeline`` or
    ``binomial``) between and inside the nodes.
    """
    if group.size == 1 or data.nbytes == 0:
        return
    if algorithm == "hierarchical":
        _hierarchical.broadcast(hierarchy_for(group, layout), data, root, inner,
                                segment_bytes)
    elif algorithm == "pipeline":
        _broadcast_algorithms.pipeline(group, data, root, segment_bytes)
    elif algorithm == "binomial":
        _broadcast_algorithms.binomial(group, data, root)
    else:
        group.comm.Bcast(data, root)


def _prepare(tensor: Any, root_rank: Any, name: str | None, process_set: ProcessSet | None,
             algorithm: str | None, in_place: bool) -> Callable[[], np.ndarray]:
    collective = "broadcast_" if in_place else "broadcast"
    on_device = device_tensor(tensor, collective, name, in_place)
    if on_device is not None:
        from . import _device_calls  # loads numba.cuda: only for device tensors
        return _device_calls.broadcast(
            on_device, root_rank, name, process_set, algorithm, in_place,
            lambda array: _prepare(array, root_rank, name, process_set, algorithm, in_place))
    array = (in_place_array if in_place else input_array)(tensor, collective, name)
    check_dtype(array.dtype, COPY_DTYPES, collective, name)
    group = resolve_group(process_set, collective, name)
    root = root_in_group(group, root_rank, collective, name)
    settings = current_settings()
    layout = layout_of(group, settings)
    chosen = broadcast_algorithm(algorithm, array.nbytes, group.size, settings, name, layout)
    inner = "pipeline" if array.nbytes >= settings.broadcast_pipeline_min_bytes \
        else "binomial"
    hierarchical = chosen == "hierarchical"
    call = Call(collective="broadcast", name=name, root_rank=int(root_rank),
                dtype=array.dtype, shape=array.shape, algorithm=chosen,
                segment_bytes=settings.segment_bytes if chosen == "pipeline" or hierarchical
                else None,
                **({"layout": layout.describe(), "schedule": inner} if hierarchical else {}))

    def run() -> np.ndarray:
        agree(group, call)
        if in_place:
            output = array
            work = flat(array)
        else:
            output = array.copy() if group.rank == root else np.empty(array.shape, array.dtype)
            work = output.reshape(-1)
        broadcast_bytes(group, work.view(np.uint8), root, chosen, settings.segment_bytes,
                        layout, inner)
        if in_place and not array.flags.c_contiguous:
            array[...] = work.reshape(array.shape)
        return output

    return run
