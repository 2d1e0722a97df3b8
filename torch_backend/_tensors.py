"""torch tensors and reduce ops as ringtrain's collectives take them.

A contiguous CPU tensor of a dtype numpy has is handed over as a numpy array over its
memory (no copy; bfloat16 as ``ml_dtypes.bfloat16``), which takes the collectives'
planned paths; a CUDA tensor goes as it is (the collectives' device path). Anything
else also goes as it is, so that the collective refuses it on every rank, never on one
alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..collectives import Average, Max, Min, Product, ReduceOp, Sum, UnsupportedDtypeError
from ..collectives.engine import torch_view

VIEWED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64,
                           torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                           torch.bool})
"""The torch dtypes the collectives take (the others are refused on every rank)."""
_NUMPY_VIEWED = VIEWED_DTYPES - {torch.bfloat16, torch.bool}
"""Those whose tensors ``numpy()`` views as they are."""

_RED = dist.ReduceOp.RedOpType


class Reduction(NamedTuple):
    """How ringtrain carries out a torch reduce op on one dtype.

    Attributes:
        op: ringtrain's op (None for a bitwise op).
        prescale_factor: PREMUL_SUM's factor, 1.0 otherwise.
        bitwise: the numpy reduction of a bitwise op (done on the gathered values of
            integer and bool tensors), else None.
    """

    op: ReduceOp | None
    prescale_factor: float = 1.0
    bitwise: Any = None


_BITWISE = {_RED.BAND: np.bitwise_and, _RED.BOR: np.bitwise_or, _RED.BXOR: np.bitwise_xor}
_PLAIN = {_RED.SUM: Sum, _RED.AVG: Average, _RED.PRODUCT: Product, _RED.MIN: Min,
          _RED.MAX: Max}
# A bool sum is an "or" and a product an "and", as torch's other backends define them.
_OF_BOOLS = {_RED.SUM: Max, _RED.AVG: Average, _RED.PRODUCT: Min, _RED.MIN: Min,
             _RED.MAX: Max}
_REDUCTIONS = {kind.value: Reduction(op) for kind, op in _PLAIN.items()} | \
    {kind.value: Reduction(None, bitwise=how) for kind, how in _BITWISE.items()}
_BOOL_REDUCTIONS = _REDUCTIONS | {kind.value: Reduction(op) for kind, op in _OF_BOOLS.items()}
_PREMUL_SUM = _RED.PREMUL_SUM.value


def reduction(op: Any, dtype: torch.dtype) -> Reduction:
    """The ringtrain reduction of torch ``op`` (a ``ReduceOp``, as torch's options hold
    it) on tensors of ``dtype``."""
    kind = op.op.value
    if kind == _PREMUL_SUM:
        factor = op.factor
        return Reduction(Sum, float(factor.item() if isinstance(factor, torch.Tensor)
                                    else factor))
    return (_BOOL_REDUCTIONS if dtype is torch.bool else _REDUCTIONS)[kind]


def contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if it is contiguous, else a contiguous copy.

    Raises:
        UnsupportedDtypeError: a sparse (or other non-strided) tensor.
    """
    if tensor.layout is not torch.strided:
        raise UnsupportedDtypeError(
            f"torch.distributed on the 'ringtrain' backend: a {tensor.layout} tensor; the "
            f"collectives take dense (strided) tensors")
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def operand(tensor: torch.Tensor, reduced: bool = False) -> Any:
    """What a ringtrain collective takes for ``tensor`` (see the module's docstring); a
    bool tensor that is ``reduced`` as uint8 (its values stay 0 and 1: the reductions of
    bools are Min and Max)."""
    dtype = tensor.dtype
    if dtype in _NUMPY_VIEWED and tensor.is_cpu and tensor.is_contiguous() \
            and not tensor.requires_grad:  # the common case, in the fewest steps
        return tensor.numpy()
    if tensor.is_cpu and dtype in VIEWED_DTYPES and tensor.is_contiguous():
        if reduced and dtype is torch.bool:
            tensor = tensor.view(torch.uint8)
        return torch_view(tensor, "torch.distributed", None)
    if reduced and dtype is torch.bool:
        return tensor.view(torch.uint8)
    return tensor


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor of ``tensor``'s elements (a view where it can be)."""
    return contiguous(tensor).reshape(-1)


def copy_into(target: torch.Tensor, source: Any) -> None:
    """Copy a collective's result (numpy array or tensor of the same number of elements)
    into ``target``, whatever its layout."""
    if isinstance(source, np.ndarray):
        if target.is_cpu and target.is_contiguous() and target.dtype in VIEWED_DTYPES:
            np.copyto(torch_view(target, "copy", None).reshape(-1), source.reshape(-1),
                      casting="no")
            return
        source = _as_tensor(source)
    target.copy_(source.reshape(target.shape))


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def concatenated(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The elements of ``tensors``, one after the other, in one 1-D tensor."""
    if len(tensors) == 1:
        return flat(tensors[0])
    return torch.cat([t.reshape(-1) for t in tensors])


def scatter_into(targets: Sequence[torch.Tensor], source: Any) -> None:
    """Copy consecutive pieces of the 1-D result ``source`` into ``targets``, each
    taking as many elements as it has."""
    start = 0
    for target in targets:
        count = target.numel()
        copy_into(target, source[start:start + count])
        start += count
    if start != len(source):
        raise ValueError(f"the result has {len(source)} elements, the output tensors "
                         f"{start}")
