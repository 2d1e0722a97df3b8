"""The MPI library's own collectives, offered as the algorithm ``native``: each call
written once, for host arrays and for device memory handed to a CUDA-aware MPI alike."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from mpi4py import MPI
import numpy as np

from ...kernels import reduce_into
from ..base._group import Group
from ..base._ops import ReduceOp
from ..base._tracing import phase

MPI_OPS = {
    ReduceOp.Average: MPI.SUM,
    ReduceOp.Sum: MPI.SUM,
    ReduceOp.Min: MPI.MIN,
    ReduceOp.Max: MPI.MAX,
    ReduceOp.Product: MPI.PROD,
}
"""The MPI operation behind each op (Average sums; ringtrain divides afterwards)."""

_sixteen_bit_ops: dict[tuple[ReduceOp, str | None], MPI.Op] = {}


def sixteen_bit_op(op: ReduceOp, encoding: str | None) -> MPI.Op:
    """A user-defined MPI op reducing float16 (or, with ``encoding``, bfloat16) bits.

    MPI has no 16-bit float types: messages travel as ``MPI.UINT16_T`` and this op
    combines them with ringtrain's kernels (float32 arithmetic, rounded once).
    """
    key = (op, encoding)
    if key not in _sixteen_bit_ops:
        view = np.uint16 if encoding else np.float16

        def combine(incoming: Any, inout: Any, datatype: MPI.Datatype) -> None:
            target = np.frombuffer(inout, view)
            reduce_into(op.value, np.frombuffer(incoming, view), target, target, encoding)

        _sixteen_bit_ops[key] = MPI.Op.Create(combine, commute=True)
    return _sixteen_bit_ops[key]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each of consecutive blocks of ``sizes`` starts."""
    return [0, *accumulate(sizes)][:-1]


def allreduce(group: Group, send: Any, receive: Any, mpi_op: MPI.Op, nbytes: int,
              **phase_args: Any) -> None:
    """``MPI_Allreduce`` of ``send`` (or ``MPI.IN_PLACE``) into ``receive``: host arrays
    or device memory as MPI takes it."""
    with phase("MPI allreduce", bytes=nbytes, **phase_args):
        group.comm.Allreduce(send, receive, mpi_op)


def broadcast(group: Group, data: Any, root: int, nbytes: int, **phase_args: Any) -> None:
    """``MPI_Bcast`` of ``data`` (bytes) from group rank ``root``."""
    with phase("MPI broadcast", bytes=nbytes, **phase_args):
        group.comm.Bcast(data, root)


def allgather(group: Group, mine: Any, gathered: Any, sizes: Sequence[int],
              **phase_args: Any) -> None:
    """``MPI_Allgatherv`` of each rank's bytes ``mine`` into ``gathered``, rank r's
    ``sizes[r]`` bytes after those of the ranks before it (``MPI_Allgather`` when every
    rank sends as many: MPICH's is several times faster for large messages, see
    benchmarks/native_forms.py)."""
    with phase("MPI allgather", bytes=sum(sizes), **phase_args):
        if len(set(sizes)) == 1:
            group.comm.Allgather([mine, MPI.BYTE], [gathered, MPI.BYTE])
        else:
            group.comm.Allgatherv(mine, [gathered, list(sizes), offsets(sizes), MPI.BYTE])


def alltoall(group: Group, send: Any, sent: Sequence[int], receive: Any,
             received: Sequence[int], **phase_args: Any) -> None:
    """``MPI_Alltoallv`` of bytes: ``sent[r]`` bytes to rank r, ``received[r]`` from it,
    each block after the ones before it (``MPI_Alltoall`` when every block has the same
    size)."""
    with phase("MPI alltoall", bytes=sum(sent), **phase_args):
        if len(set(sent) | set(received)) == 1:
            group.comm.Alltoall([send, MPI.BYTE], [receive, MPI.BYTE])
        else:
            group.comm.Alltoallv([send, list(sent), offsets(sent), MPI.BYTE],
                                 [receive, list(received), offsets(received), MPI.BYTE])


def reducescatter(group: Group, send: Any, receive: Any, counts: Sequence[int], op: ReduceOp,
                  nbytes: int, encoding: str | None = None, **phase_args: Any) -> None:
    """``MPI_Reduce_scatter`` of ``send``: rank r receives the reduction of its
    ``counts[r]`` elements; with ``encoding`` (bfloat16), of the 16-bit values whose
    bits ``send`` and ``receive`` hold, by :func:`sixteen_bit_op`."""
    mpi_op = sixteen_bit_op(op, encoding) if encoding else MPI_OPS[op]
    with phase("MPI reducescatter", bytes=nbytes, **phase_args):
        group.comm.Reduce_scatter(send, receive, list(counts), mpi_op)
