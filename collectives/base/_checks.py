"""The checks every collective makes before it communicates: the caller's tensor as an
array, its dtype and shape, ops, scales, compression, roots and splits. Each raises the
library's own errors, naming the collective and the tensor."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels import BFLOAT16, Compressor, is_floating
from ..errors import InvalidArgumentError, UnsupportedDtypeError, subject
from ._buffers import is_torch_tensor, torch_view
from ._group import Group
from ._ops import REDUCE_DTYPES, ReduceOp, check_dtype, check_op_for_dtype


def input_array(tensor: Any, collective: str, name: str | None) -> np.ndarray:
    """The caller's tensor as a numpy array (no copy when it already is one, or a torch
    CPU tensor)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if is_torch_tensor(tensor):
        return torch_view(tensor, collective, name)
    try:
        return np.asarray(tensor)
    except (TypeError, ValueError) as error:
        raise UnsupportedDtypeError(
            f"{subject(collective, name)}: cannot use a "
            f"{type(tensor).__name__} as an array: {error}") from None


def in_place_array(tensor: Any, collective: str, name: str | None) -> np.ndarray:
    """The caller's tensor for an in-place collective: a writable numpy array (over a
    torch CPU tensor's memory for a tensor)."""
    if is_torch_tensor(tensor):
        return torch_view(tensor, collective, name)
    if not isinstance(tensor, np.ndarray):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: works in place and needs a numpy "
            f"array or a torch tensor, got {type(tensor).__name__}")
    if not tensor.flags.writeable:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: the array is read-only")
    return tensor


_BYTE = np.dtype(np.uint8)


def byte_view(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a 1-D uint8 view."""
    return (array if array.ndim == 1 else array.reshape(-1)).view(_BYTE)


def flat(array: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous array, or a contiguous 1-D copy of any other."""
    if array.flags.c_contiguous:
        return array.reshape(-1)
    return np.ascontiguousarray(array).reshape(-1)


def check_splittable(shape: tuple[int, ...], collective: str, name: str | None) -> None:
    """Refuse a 0-d tensor where a collective splits the first dimension among the ranks."""
    if len(shape) == 0:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: needs at least one dimension to split among "
            f"the ranks, got a 0-d array")


def check_scale_factors(dtype: np.dtype, prescale_factor: float, postscale_factor: float,
                        collective: str, name: str | None) -> None:
    """Scale factors other than 1 need a floating dtype (an integer result would be cut)."""
    if not is_floating(dtype) and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: prescale_factor/postscale_factor "
            f"need a floating dtype, got {dtype}")


def check_reduction(array: np.ndarray, op: ReduceOp, name: str | None,
                    prescale_factor: float, postscale_factor: float, collective: str) -> None:
    """Refuse what no reduction accepts: unsupported dtype, Average of integers, bad scales."""
    check_dtype(array.dtype, REDUCE_DTYPES, collective, name)
    check_op_for_dtype(op, array.dtype, collective, name)
    check_scale_factors(array.dtype, prescale_factor, postscale_factor, collective, name)


def check_compression(compression: Any, collective: str, name: str | None) -> Compressor:
    """``compression`` if it is a compressor, else InvalidArgumentError."""
    if not isinstance(compression, Compressor):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: compression must be Compression.none, .fp16, "
            f".bf16 or another Compressor, got {compression!r}")
    return compression


def active_compressor(compression: Compressor, dtype: np.dtype, op: ReduceOp,
                      collective: str, name: str | None) -> Compressor | None:
    """The compressor that will encode tensors of ``dtype``, or None when they travel as
    they are; a product of compressed values is refused (a scale would be raised to the
    power of the number of ranks), and so is a float16 wire for bfloat16 tensors: they
    already travel in 2 bytes, and float16 would narrow their range (``bf16``
    compression of bfloat16 tensors changes nothing)."""
    if np.dtype(dtype) == BFLOAT16 and compression.wire_dtype == np.float16:
        raise UnsupportedDtypeError(
            f"{subject(collective, name)}: {compression.name} compression casts float32 "
            f"tensors to float16; this tensor is bfloat16, already 2 bytes and of wider "
            f"range than float16: use Compression.none or Compression.bf16 (the same for "
            f"bfloat16 tensors)")
    if not compression.applies_to(dtype):
        return None
    if op in (ReduceOp.Product, ReduceOp.Adasum):
        raise InvalidArgumentError(
            f"{subject(collective, name)}: {compression.name} compression supports Sum, "
            f"Average, Min and Max, not {op.name}")
    if compression.error_feedback and name is None:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: {compression.name} compression with error "
            f"feedback keeps a residual per tensor name: give the tensor a name")
    return compression


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


def check_splits(splits: Any, rows: int, size: int, name: str | None,
                 collective: str = "alltoall") -> np.ndarray:
    """The rows of each rank (sent to it by an alltoall, kept by a reducescatter), as
    int64: ``splits`` checked, or, when it is None, ``rows`` cut as evenly as possible
    (the earlier ranks one more)."""
    if splits is None:
        base, extra = divmod(rows, size)
        return np.array([base + 1] * extra + [base] * (size - extra), np.int64)
    values = np.asarray(splits)
    if values.shape != (size,) or values.dtype.kind not in "iu" or (values < 0).any():
        raise InvalidArgumentError(
            f"{subject(collective, name)}: splits must be {size} non-negative "
            f"integers (one per rank), got {list(np.ravel(values))}")
    if int(values.sum()) != rows:
        raise InvalidArgumentError(
            f"{subject(collective, name)}: splits {values.tolist()} sum to "
            f"{int(values.sum())}, but the tensor has {rows} rows")
    return values.astype(np.int64)
