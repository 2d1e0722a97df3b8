"""Adasum: Horovod's adaptive summation of gradients, built on ringtrain's allgather.

Two vectors combine as ``adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``
(a coefficient stays 1 when its vector is zero); the ranks' vectors combine pairwise in
a binary tree: ranks (0, 1), (2, 3), ... first, then those results pairwise, and so on.
Every rank gathers all vectors and evaluates the tree itself in float64, so the result
is bit-identical on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import collectives as rtc
from ._handles import Finish, launch

_ZERO_NORM = 1e-8


def check_adasum(process_set: Any, dtypes: list[torch.dtype]) -> None:
    """Refuse what Horovod's CPU Adasum refuses: a process set other than all ranks, a
    number of ranks that is not a power of two, a dtype that is not floating."""
    where = f"rank {rtc.rank()}: Adasum"
    if process_set is not None and process_set is not rtc.global_process_set:
        raise NotImplementedError(f"{where} runs over all ranks only, not over "
                                  f"process set {process_set.ranks}")
    size = rtc.size()
    if size & (size - 1):
        raise NotImplementedError(f"{where} needs a power of 2 ranks, not {size}; use op=Average")
    for dtype in dtypes:
        if not dtype.is_floating_point:
            raise ValueError(f"{where} needs floating-point tensors, got {dtype}")


def adasum_parts(tensor: torch.Tensor, output: torch.Tensor | None, key: str | None,
                 prescale_factor: float, postscale_factor: float,
                 asynchronous: bool) -> tuple[list[Any], Finish]:
    """Start the allgather of ``tensor`` (as one row); the finish step combines the rows.

    ``output`` receives the result when given (in place), else it is a new tensor.
    """
    row = tensor.detach().reshape(1, -1)
    part = launch(asynchronous, rtc.allgather, rtc.allgather_async, row, name=key)

    def finish(results: list[Any]) -> torch.Tensor:
        vectors = results[0].to(torch.float64)
        if prescale_factor != 1.0:
            vectors = vectors * prescale_factor
        combined = combine(list(vectors))
        if postscale_factor != 1.0:
            combined = combined * postscale_factor
        result = combined.to(tensor.dtype).reshape(tensor.shape)
        if output is None:
            return result
        output.copy_(result)
        return output

    return [part], finish


def combine(vectors: list[torch.Tensor]) -> torch.Tensor:
    """The binary tree of :func:`pair` over ``vectors`` (a power-of-two count)."""
    while len(vectors) > 1:
        vectors = [pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two vectors."""
    dot = torch.dot(a, b)
    a_coefficient = _coefficient(dot, torch.dot(a, a))
    b_coefficient = _coefficient(dot, torch.dot(b, b))
    return a_coefficient * a + b_coefficient * b


def _coefficient(dot: torch.Tensor, norm_squared: torch.Tensor) -> torch.Tensor | float:
    if norm_squared < _ZERO_NORM:
        return 1.0
    return 1.0 - dot / (2.0 * norm_squared)
