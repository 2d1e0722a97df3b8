"""Reduction operations and the dtypes each collective accepts."""

from __future__ import annotations

import enum

import numpy as np

from ...kernels import BFLOAT16, is_floating
from ..errors import InvalidArgumentError, UnsupportedDtypeError, subject


class ReduceOp(enum.Enum):
    """How an allreduce or reducescatter combines the ranks' values (Adasum: allreduce
    only, floating dtypes)."""

    Average = "average"
    Sum = "sum"
    Min = "min"
    Max = "max"
    Product = "product"
    Adasum = "adasum"

    def __repr__(self) -> str:
        return f"ringtrain.{self.name}"

    __str__ = __repr__
    __hash__ = object.__hash__  # members are singletons; enum's own hash runs Python code


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product
Adasum = ReduceOp.Adasum

REDUCE_DTYPES = tuple(np.dtype(t) for t in (
    np.float16, BFLOAT16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32,
    np.int64))
"""dtypes every reducing collective accepts (bfloat16 is ``ml_dtypes.bfloat16``)."""

COPY_DTYPES = REDUCE_DTYPES + (np.dtype(np.bool_),)
"""dtypes the collectives that only move data (broadcast, allgather, alltoall) accept."""

_OP_BY_NAME = {op.value: op for op in ReduceOp} | {op.name.lower(): op for op in ReduceOp}


def resolve_op(op: ReduceOp | str, collective: str, tensor_name: str | None) -> ReduceOp:
    """Return ``op`` as a :class:`ReduceOp`, accepting names like ``"sum"``."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.lower() in _OP_BY_NAME:
        return _OP_BY_NAME[op.lower()]
    known = ", ".join(o.name for o in ReduceOp)
    raise InvalidArgumentError(
        f"{subject(collective, tensor_name)}: unknown op {op!r}; "
        f"use one of {known}")


def check_dtype(dtype: np.dtype, allowed: tuple[np.dtype, ...], collective: str,
                tensor_name: str | None) -> None:
    """Raise :class:`UnsupportedDtypeError` unless ``dtype`` is in ``allowed``."""
    if dtype not in allowed:
        names = ", ".join(d.name for d in allowed)
        raise UnsupportedDtypeError(
            f"{subject(collective, tensor_name)}: dtype {dtype} is not supported; "
            f"supported dtypes are {names}")


def check_op_for_dtype(op: ReduceOp, dtype: np.dtype, collective: str,
                       tensor_name: str | None) -> None:
    """Refuse an Average of integers (its result is not an integer) and an Adasum of
    anything but floating values (it scales vectors by their dot products)."""
    if op is ReduceOp.Average and dtype.kind in "iu":
        raise InvalidArgumentError(
            f"{subject(collective, tensor_name)}: op Average is not defined for "
            f"integer dtype {dtype}; use Sum (and divide yourself) or a floating dtype")
    if op is ReduceOp.Adasum and not is_floating(dtype):
        raise UnsupportedDtypeError(
            f"{subject(collective, tensor_name)}: op Adasum needs a floating dtype "
            f"(float16, bfloat16, float32, float64), got {dtype}")
