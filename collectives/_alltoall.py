"""alltoall: each rank sends a block of rows to every rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from .agreement._agreement import agree
from .agreement._call import BYTES, Call
from .agreement._carried import CarriedGather
from .agreement._checked import CheckedCollective, checked_collective
from .algorithms import _native
from .algorithms._selection import auto_choice, requested
from .base._buffers import device_tensor
from .base._checks import byte_view, check_splits, check_splittable, flat, input_array
from .base._executor import Handle
from .base._group import Group
from .base._ops import COPY_DTYPES, check_dtype
from .calls._forms import CallForms
from .config import Settings, current_settings
from .memory._memory import AWARE, HOST, goes_direct
from .memory._placement import memory_for, staged
from .transport import _pairwise
from .transport._compiled_checked import ALLTOALL, MAILBOX_ALLTOALL
from .transport._mailboxes import mailboxes_of
from .world._plan_cache import PlanCache
from .world._process_sets import ProcessSet, resolve_group
from .world._topology import layout_of


def alltoall(tensor: np.ndarray, splits: Sequence[int] | np.ndarray | None = None,
             name: str | None = None, process_set: ProcessSet | None = None, *,
             algorithm: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send rows ``splits[j]`` of ``tensor`` to rank j; receive every rank's rows for us.

    Args:
        tensor: this rank's rows, at least 1-D.
        splits: how many rows go to each rank, in rank order, summing to
            ``tensor.shape[0]``; default: as even as possible, earlier ranks one more.
        name: names the tensor in error messages; the same on every rank.
        process_set: the ranks taking part (default: all).
        algorithm: ``recursive_doubling`` (small alltoalls, in the agreement's own
            messages), ``pairwise``, ``native`` or ``auto``.

    Returns:
        ``(received, received_splits)``: the rows from every rank concatenated in rank
        order, and how many rows came from each rank (int64).
    """
    return _FORMS.blocking(False, tensor, name, process_set, (splits, algorithm))


def alltoall_async(tensor: np.ndarray, splits: Sequence[int] | np.ndarray | None = None,
                   name: str | None = None, process_set: ProcessSet | None = None, *,
                   algorithm: str | None = None) -> Handle:
    """Start :func:`alltoall`; ``synchronize(handle)`` returns ``(received, received_splits)``."""
    return _FORMS.start(False, tensor, name, process_set, (splits, algorithm))


class _AlltoallPlan:
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
            self.even_move = _Movement(
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


_PLANS: PlanCache[_AlltoallPlan] = PlanCache()


def _prepare(collective: str, tensor: Any, name: str | None, process_set: ProcessSet | None,
             splits: Any, algorithm: str | None) -> Callable[[], tuple[Any, np.ndarray]]:
    on_device = device_tensor(tensor, collective, name)
    if on_device is not None and not goes_direct(algorithm,
                                                 current_settings().alltoall_algorithm):
        return staged(on_device, False, lambda array: _prepare(
            collective, array, name, process_set, splits, algorithm))
    array = on_device if on_device is not None else input_array(tensor, collective, name)
    key = _key(on_device is not None, array, name, process_set, algorithm)
    plan = _PLANS.get(key, process_set, collective, name) or _PLANS.keep(key, _AlltoallPlan(
        array, name, process_set, algorithm, on_device is not None))
    group, chosen = plan.group, plan.chosen
    send_splits = plan.even_splits if splits is None else \
        check_splits(splits, array.shape[0], group.size, name)
    if on_device is not None:
        memory, send = memory_for(AWARE, on_device.device), on_device.memory
    else:
        memory, send = HOST, flat(array).view(np.uint8)
    if plan.carried is not None:
        return lambda: _carried(plan, send, send_splits, array)

    def run() -> tuple[Any, np.ndarray]:
        with memory.entered(*([] if on_device is None else [on_device])):
            agree(group, plan.call)
            received_splits, algorithm = _exchange_splits(group, send_splits, plan.row_bytes,
                                                          chosen, plan.settings)
            movement = _movement(send_splits, received_splits, plan.row_bytes, algorithm)
            return _move(group, send, movement, memory, array), received_splits

    return run


def _key(on_device: bool, array: Any, name: str | None, process_set: ProcessSet | None,
         algorithm: str | None) -> tuple:
    """What an alltoall's plan is kept by."""
    return (on_device, array.shape, array.dtype, name, process_set, algorithm)


def _carried(plan: _AlltoallPlan, send: np.ndarray, send_splits: np.ndarray,
             array: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An alltoall whose splits ride in the agreement's own messages.

    Every rank's splits (the matrix), and its whole send buffer when it is small enough
    for ``auto`` to choose this way, ride in the agreement (:class:`CarriedGather`).
    When every rank sends the even splits (the usual case) every rank made the same
    choice: the rows have arrived, or they follow as the plan chose for their size;
    otherwise the ranks, all knowing the matrix now, move the rows as ``auto`` chooses
    for their mean size (the payloads, of different lengths, are not used). Where the
    plan has the compiled call (even splits sending as many rows to every rank, MPI's own
    alltoall or the pairwise exchange through the mailboxes moving them), the splits
    travel with the check and the rows follow in the same call, unless some rank's
    splits differ.
    """
    group, row_bytes = plan.group, plan.row_bytes
    size, rank, mine = group.size, group.rank, send.nbytes
    if plan.checked is not None and send_splits is plan.even_splits:
        output = HOST.new(array, (plan.even_move.rows, *array.shape[1:]))
        matrix = plan.checked.run(send, byte_view(output))
        if matrix is None:  # the even splits, every block of one size
            return output, plan.even_splits.copy()
        carried = None
    else:
        matrix, carried = plan.carried.run(send_splits, send)
        if matrix is None:  # every rank's splits are this rank's
            if send_splits is plan.even_splits:
                return _even_blocks(plan, send, carried, array), plan.even_received.copy()
            matrix = np.tile(send_splits, (size, 1))
    received_splits = matrix[:, rank].copy()
    rows = matrix.tolist()
    if rows == plan.even_matrix:
        return _even_blocks(plan, send, carried, array), received_splits
    if carried is not None and all(sum(row) * row_bytes == mine for row in rows):
        output = HOST.new(array, (sum(row[rank] for row in rows), *array.shape[1:]))
        target = output.reshape(-1).view(np.uint8)
        written = 0
        for source, row in enumerate(rows):
            start = plan.carried.data_offset + source * mine + sum(row[:rank]) * row_bytes
            length = row[rank] * row_bytes
            target[written:written + length] = carried[start:start + length]
            written += length
        return output, received_splits
    nbytes = int(matrix.sum()) * row_bytes // size
    algorithm = auto_choice("alltoall", nbytes, size, plan.settings, plan.layout)
    return _move(group, send, _movement(send_splits, received_splits, row_bytes, algorithm),
                 HOST, array), received_splits


def _even_blocks(plan: _AlltoallPlan, send: np.ndarray, carried: np.ndarray | None,
                 array: np.ndarray) -> np.ndarray:
    """The rows for this rank when every rank sent the even splits: its block of each
    rank's send buffer in ``carried`` (what :meth:`CarriedGather.run` returned: every
    rank's whole send buffer, as they rode in the agreement; copied out, or viewed where
    they lie one after the other), or moved as the plan chose where they did not ride."""
    if carried is None:
        return _move(plan.group, send, plan.even_move, HOST, array)
    start, length = plan.even_block
    itemsize = array.dtype.itemsize
    blocks = np.ndarray((plan.group.size, length // itemsize), array.dtype, carried,
                        plan.carried.data_offset + start, (send.nbytes, itemsize))
    return np.ascontiguousarray(blocks).reshape(plan.even_move.rows, *array.shape[1:])


@dataclass(frozen=True)
class _Movement:
    """An alltoall's data phase: the bytes sent to and received from each rank, the rows
    received in all, and the algorithm (``native`` or ``pairwise``)."""

    sent: list[int]
    received: list[int]
    rows: int
    algorithm: str


def _movement(send_splits: np.ndarray, received_splits: np.ndarray, row_bytes: int,
              algorithm: str) -> _Movement:
    return _Movement((send_splits * row_bytes).tolist(),
                     (received_splits * row_bytes).tolist(), int(received_splits.sum()),
                     algorithm)


def _move(group: Group, send: Any, movement: _Movement, memory: Any, like: Any) -> Any:
    """The data phase: every rank's rows for this one, concatenated in rank order; a new
    array of ``like``'s kind and row shape."""
    output = memory.new(like, (movement.rows, *like.shape[1:]))
    sent, received = movement.sent, movement.received
    if movement.algorithm == "native":
        _native.alltoall(group, memory.for_mpi(send, np.uint8), sent,
                         memory.for_mpi(output, np.uint8), received, **memory.phase_args)
    else:
        _pairwise.alltoall(group, send, [0, *accumulate(sent)],
                           output.reshape(-1).view(np.uint8), [0, *accumulate(received)])
    return output


def _exchange_splits(group: Group, send_splits: np.ndarray, row_bytes: int, chosen: str,
                     settings: Settings) -> tuple[np.ndarray, str]:
    """How many rows each rank sends us, and the algorithm: ``auto`` resolved from the
    mean send buffer, which every rank learns from the whole matrix of splits."""
    received_splits = np.empty(group.size, np.int64)
    if chosen != "auto":
        group.comm.Alltoall(send_splits, received_splits)
        return received_splits, chosen
    matrix = np.empty((group.size, group.size), np.int64)
    group.comm.Allgather(send_splits, matrix)
    received_splits[:] = matrix[:, group.rank]
    nbytes = int(matrix.sum()) * row_bytes // group.size
    return received_splits, auto_choice("alltoall", nbytes, group.size, settings)


def _kept(collective: str, tensor: np.ndarray, name: str | None,
          process_set: ProcessSet | None, arguments: tuple) -> _AlltoallPlan | None:
    """The plan of an alltoall with the even splits made before like this one, if still
    valid (only a small call's, whose splits ride in the agreement, runs by it)."""
    splits, algorithm = arguments
    if splits is not None:
        return None
    return _PLANS.get(_key(False, tensor, name, process_set, algorithm), process_set,
                      collective, name)


def _carried_run(plan: _AlltoallPlan, collective: str, name: str | None, tensor: np.ndarray,
                 output: None, arguments: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The run of a kept plan whose splits ride in the agreement, with the even splits
    (see :class:`CallForms`): ``(received, received_splits)``."""
    return _carried(plan, byte_view(tensor), plan.even_splits, tensor)


_FORMS = CallForms("alltoall", _prepare, _kept, carried=_carried_run)
