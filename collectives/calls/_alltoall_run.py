"""Running planned alltoalls: the call validated into its body, the data phase after the
agreement, and the runs of a kept plan; the call forms declared (:data:`FORMS`)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any

import numpy as np

from ..agreement._agreement import agree
from ..algorithms import _native
from ..algorithms._selection import auto_choice
from ..base._buffers import device_tensor
from ..base._checks import byte_view, check_splits, flat, input_array
from ..base._group import Group
from ..config import Settings, current_settings
from ..memory._memory import AWARE, HOST, goes_direct
from ..memory._placement import memory_for, staged
from ..transport import _pairwise
from ..world._process_sets import ProcessSet
from ._alltoall_plan import AlltoallPlan, Movement, alltoall_plan, kept_alltoall_plan
from ._forms import CallForms


def _prepare(collective: str, tensor: Any, name: str | None, process_set: ProcessSet | None,
             splits: Any, algorithm: str | None) -> Callable[[], tuple[Any, np.ndarray]]:
    on_device = device_tensor(tensor, collective, name)
    if on_device is not None and not goes_direct(algorithm,
                                                 current_settings().alltoall_algorithm):
        return staged(on_device, False, lambda array: _prepare(
            collective, array, name, process_set, splits, algorithm))
    array = on_device if on_device is not None else input_array(tensor, collective, name)
    plan = alltoall_plan(array, name, process_set, algorithm, on_device is not None)
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


def _carried(plan: AlltoallPlan, send: np.ndarray, send_splits: np.ndarray,
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


def _even_blocks(plan: AlltoallPlan, send: np.ndarray, carried: np.ndarray | None,
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


def _movement(send_splits: np.ndarray, received_splits: np.ndarray, row_bytes: int,
              algorithm: str) -> Movement:
    return Movement((send_splits * row_bytes).tolist(),
                    (received_splits * row_bytes).tolist(), int(received_splits.sum()),
                    algorithm)


def _move(group: Group, send: Any, movement: Movement, memory: Any, like: Any) -> Any:
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


def _carried_run(plan: AlltoallPlan, collective: str, name: str | None, tensor: np.ndarray,
                 output: None, arguments: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The run of a kept plan whose splits ride in the agreement, with the even splits
    (see :class:`CallForms`): ``(received, received_splits)``."""
    return _carried(plan, byte_view(tensor), plan.even_splits, tensor)


FORMS = CallForms("alltoall", _prepare, kept_alltoall_plan, carried=_carried_run)
