"""The MPI library's own collectives, offered as the algorithm ``native``."""

from __future__ import annotations

from mpi4py import MPI

from ._ops import ReduceOp

MPI_OPS = {
    ReduceOp.Average: MPI.SUM,
    ReduceOp.Sum: MPI.SUM,
    ReduceOp.Min: MPI.MIN,
    ReduceOp.Max: MPI.MAX,
    ReduceOp.Product: MPI.PROD,
}
"""The MPI operation behind each op (Average sums; ringtrain divides afterwards)."""
