"""The collectives as differentiable functions, with Horovod's gradients.

* allreduce: the same allreduce (op and scale factors) of the gradient;
* allgather: the gradient averaged over the ranks, this rank's rows of it;
* broadcast: the gradient averaged over the ranks on the root, zeros elsewhere;
* alltoall: the gradient sent back with the received splits;
* reducescatter: the gradient allgathered, times the number of ranks for Sum and
  times the scale factors.

The functions named after the collectives run one through its Function when a tensor
needs a gradient, else directly; the backward passes call them too, so gradients of
gradients are computed the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ... import collectives as rtc
from ._operations import (allgather_now, allreduce_now, alltoall_now, broadcast_now,
                          grouped_allgather_now, grouped_allreduce_now,
                          grouped_reducescatter_now, reducescatter_now)


def _set(process_set: rtc.ProcessSet | None) -> rtc.ProcessSet:
    return process_set or rtc.global_process_set


class Allreduce(torch.autograd.Function):
    """allreduce; the gradient is the same allreduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any,
                prescale_factor: float, postscale_factor: float,
                process_set: rtc.ProcessSet | None) -> torch.Tensor:
        ctx.arguments = op, prescale_factor, postscale_factor, process_set
        return allreduce_now(tensor, name, op, prescale_factor, postscale_factor, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, prescale_factor, postscale_factor, process_set = ctx.arguments
        reduced = allreduce(grad, None, op, prescale_factor, postscale_factor, process_set)
        return reduced, None, None, None, None, None


class GroupedAllreduce(torch.autograd.Function):
    """grouped_allreduce; the gradients are the same grouped allreduce of the gradients."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, prescale_factor: float,
                postscale_factor: float, process_set: rtc.ProcessSet | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.arguments = op, prescale_factor, postscale_factor, process_set
        return tuple(grouped_allreduce_now(tensors, name, op, prescale_factor,
                                           postscale_factor, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, prescale_factor, postscale_factor, process_set = ctx.arguments
        reduced = grouped_allreduce(list(grads), None, op, prescale_factor, postscale_factor,
                                    process_set)
        return (None, None, None, None, None, *reduced)


def _own_rows(grads: list[torch.Tensor], shapes: list[torch.Size],
              process_set: rtc.ProcessSet | None) -> list[torch.Tensor]:
    """This rank's rows of each averaged gradient of a (grouped) allgather."""
    averaged = grouped_allreduce(grads, None, rtc.Average, 1.0, 1.0, process_set)
    rows = [shape[0] if len(shape) else 1 for shape in shapes]
    counts = allgather(torch.tensor([rows], dtype=torch.int64), None, process_set)
    offsets = counts[:_set(process_set).rank()].sum(dim=0)
    return [a.narrow(0, int(offset), n).reshape(shape)
            for a, offset, n, shape in zip(averaged, offsets, rows, shapes)]


class Allgather(torch.autograd.Function):
    """allgather; the gradient is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None,
                process_set: rtc.ProcessSet | None) -> torch.Tensor:
        ctx.shape, ctx.process_set = tensor.shape, process_set
        return allgather_now(tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _own_rows([grad], [ctx.shape], ctx.process_set)[0], None, None


class GroupedAllgather(torch.autograd.Function):
    """grouped_allgather; each gradient is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: rtc.ProcessSet | None,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.shapes, ctx.process_set = [t.shape for t in tensors], process_set
        return tuple(grouped_allgather_now(tensors, name, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, *_own_rows(list(grads), ctx.shapes, ctx.process_set))


class Broadcast(torch.autograd.Function):
    """broadcast; the root's gradient is the averaged gradient, the others' zero."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: rtc.ProcessSet | None) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return broadcast_now(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = allreduce(grad, None, rtc.Average, 1.0, 1.0, ctx.process_set)
        if rtc.rank() != ctx.root_rank:
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


class Alltoall(torch.autograd.Function):
    """alltoall; the gradient goes back with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: rtc.ProcessSet | None) -> Any:
        output, received_splits = alltoall_now(tensor, splits, name, process_set)
        ctx.received_splits, ctx.process_set = received_splits, process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        returned, _ = alltoall(grad, ctx.received_splits, None, ctx.process_set)
        return returned, None, None, None


def _scattered_grad(grad: torch.Tensor, op: Any, process_set: rtc.ProcessSet | None,
                    prescale_factor: float, postscale_factor: float) -> torch.Tensor:
    factor = prescale_factor * postscale_factor
    if op is rtc.Sum:
        factor *= _set(process_set).size()
    return grad * factor if factor != 1.0 else grad


class Reducescatter(torch.autograd.Function):
    """reducescatter; the gradient is the allgather of the (scaled) gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: Any,
                process_set: rtc.ProcessSet | None, prescale_factor: float,
                postscale_factor: float) -> torch.Tensor:
        ctx.arguments = op, process_set, prescale_factor, postscale_factor
        return reducescatter_now(tensor, name, op, process_set, prescale_factor,
                                 postscale_factor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        process_set = ctx.arguments[1]
        gathered = allgather(_scattered_grad(grad, *ctx.arguments), None, process_set)
        return gathered, None, None, None, None, None


class GroupedReducescatter(torch.autograd.Function):
    """grouped_reducescatter; each gradient is the allgather of the (scaled) gradient."""

    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, process_set: rtc.ProcessSet | None,
                prescale_factor: float, postscale_factor: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.arguments = op, process_set, prescale_factor, postscale_factor
        return tuple(grouped_reducescatter_now(tensors, name, op, process_set,
                                               prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        process_set = ctx.arguments[1]
        scaled = [_scattered_grad(g, *ctx.arguments) for g in grads]
        return (None, None, None, None, None,
                *grouped_allgather(scaled, None, process_set))


# --------------------------------------------------------------------------- the collectives

def _needs_grad(*tensors: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def allreduce(tensor: torch.Tensor, name: str | None, op: Any, prescale_factor: float,
              postscale_factor: float, process_set: rtc.ProcessSet | None) -> torch.Tensor:
    """The allreduce of ``tensor`` into a new tensor; differentiable."""
    if _needs_grad(tensor):
        return Allreduce.apply(tensor, name, op, prescale_factor, postscale_factor,
                               process_set)
    return allreduce_now(tensor, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], name: str | None, op: Any,
                      prescale_factor: float, postscale_factor: float,
                      process_set: rtc.ProcessSet | None) -> Sequence[torch.Tensor]:
    """The fused allreduce of ``tensors`` into new tensors; differentiable."""
    if _needs_grad(*tensors):
        return GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor,
                                      process_set, *tensors)
    return grouped_allreduce_now(tensors, name, op, prescale_factor, postscale_factor,
                                 process_set)


def allgather(tensor: torch.Tensor, name: str | None,
              process_set: rtc.ProcessSet | None) -> torch.Tensor:
    """The allgather of ``tensor``; differentiable."""
    if _needs_grad(tensor):
        return Allgather.apply(tensor, name, process_set)
    return allgather_now(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None,
                      process_set: rtc.ProcessSet | None) -> list[torch.Tensor]:
    """One allgather per tensor of ``tensors``; differentiable."""
    if _needs_grad(*tensors):
        return list(GroupedAllgather.apply(name, process_set, *tensors))
    return grouped_allgather_now(tensors, name, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None,
              process_set: rtc.ProcessSet | None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` in a new tensor on every rank; differentiable."""
    if _needs_grad(tensor):
        return Broadcast.apply(tensor, root_rank, name, process_set)
    return broadcast_now(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Any, name: str | None,
             process_set: rtc.ProcessSet | None) -> Any:
    """The alltoall of ``tensor``: the received rows, and with ``splits`` also the
    received splits; differentiable."""
    if _needs_grad(tensor):
        return Alltoall.apply(tensor, splits, name, process_set)
    output, received_splits = alltoall_now(tensor, splits, name, process_set)
    return output if splits is None else (output, received_splits)


def reducescatter(tensor: torch.Tensor, name: str | None, op: Any,
                  process_set: rtc.ProcessSet | None, prescale_factor: float,
                  postscale_factor: float) -> torch.Tensor:
    """The reducescatter of ``tensor``; differentiable."""
    if _needs_grad(tensor):
        return Reducescatter.apply(tensor, name, op, process_set, prescale_factor,
                                   postscale_factor)
    return reducescatter_now(tensor, name, op, process_set, prescale_factor, postscale_factor)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None, op: Any,
                          process_set: rtc.ProcessSet | None, prescale_factor: float,
                          postscale_factor: float) -> Sequence[torch.Tensor]:
    """One reducescatter per tensor of ``tensors``; differentiable."""
    if _needs_grad(*tensors):
        return GroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                          postscale_factor, *tensors)
    return grouped_reducescatter_now(tensors, name, op, process_set, prescale_factor,
                                     postscale_factor)
