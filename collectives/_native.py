"""The MPI library's own collectives, offered as the algorithm ``native``."""

from __future__ import annotations

from typing import Any

from mpi4py import MPI
import numpy as np

from ..kernels import reduce_into
from ._ops import ReduceOp

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
