"""Horovod's operations on ringtrain's collectives, without autograd.

Each operation is built as parts (the ringtrain collectives it starts) and a finish
step (what makes Horovod's output of theirs), then run at once or left to a Handle.
:mod:`._autograd` makes the operations differentiable and :mod:`.mpi_ops` gives them
Horovod's names and signatures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ... import collectives as rtc
from ._adasum import adasum_parts
from ._handles import Finish, launch, reserve, start


Adasum = rtc.Adasum

_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
Parts = tuple[list[Any], Finish]


def set_size(process_set: rtc.ProcessSet | None) -> int:
    """The number of ranks of ``process_set`` (the global process set for None)."""
    return (process_set or rtc.global_process_set).size()


def _key(collective: str, name: str | None) -> str | None:
    return None if name is None else f"{collective}.{name}"


def sub_key(key: str | None, index: int) -> str | None:
    """The name of part ``index`` of the operation named ``key``."""
    return None if key is None else f"{key}.{index}"


def run(collective: str, name: str | None, asynchronous: bool,
        build: Callable[[str | None], Parts]) -> Any:
    """Check the name, start the ringtrain collectives ``build`` starts, and return a
    Handle (asynchronous) or the output."""
    key = _key(collective, name)
    reserve(key)
    parts, finish = build(key)
    return start(parts, finish, key, asynchronous)


def _first(results: list[Any]) -> Any:
    return results[0]


def _combined(pieces: list[Parts]) -> Parts:
    """One operation's parts from several: the finish step returns the list of outputs."""
    parts = [part for piece_parts, _ in pieces for part in piece_parts]

    def finish(results: list[Any]) -> list[Any]:
        outputs, at = [], 0
        for piece_parts, piece_finish in pieces:
            outputs.append(piece_finish(results[at:at + len(piece_parts)]))
            at += len(piece_parts)
        return outputs

    return parts, finish


def _scaled_here(dtype: Any, op: Any, prescale_factor: float, postscale_factor: float) -> bool:
    """Whether this layer divides for Average and applies the scale factors itself:
    integers (in float64, truncated back) and float16 scale factors (in float32)."""
    scaled = prescale_factor != 1.0 or postscale_factor != 1.0
    if dtype in _INTEGERS:
        return scaled or op is rtc.Average
    return dtype == torch.float16 and scaled


def _reducing(op: Any) -> Any:
    """The ringtrain op when this layer does the division of an Average itself."""
    return rtc.Sum if op is rtc.Average else op


def _prescaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """A new tensor: ``tensor`` times ``factor``, computed as Horovod does on the CPU."""
    tensor = tensor.detach()
    if factor == 1.0:
        return tensor.clone()
    if tensor.dtype in _INTEGERS:
        return (tensor.to(torch.float64) * factor).to(tensor.dtype)
    if tensor.dtype == torch.float16:
        return (tensor.float() * factor).half()
    return tensor * factor


def _postscaled(result: torch.Tensor, divisor: int, factor: float) -> torch.Tensor:
    """The reduced ``result`` divided by ``divisor`` (truncating integers) and scaled."""
    if result.dtype in _INTEGERS:
        if factor == 1.0:
            return result if divisor == 1 else torch.div(result, divisor, rounding_mode="trunc")
        return (result.to(torch.float64) * (factor / divisor)).to(result.dtype)
    if result.dtype == torch.float16:
        return (result.float() * (factor / divisor)).half()
    if divisor != 1:
        result = result / divisor
    return result * factor if factor != 1.0 else result


def _into(output: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if output is None:
        return value
    output.copy_(value)
    return output


def allreduce_parts(tensor: torch.Tensor, output: torch.Tensor | None, key: str | None,
                    op: Any, prescale_factor: float, postscale_factor: float,
                    process_set: rtc.ProcessSet | None, asynchronous: bool) -> Parts:
    """Start the allreduce of ``tensor`` into ``output`` (in place) or a new tensor."""
    if op is Adasum:
        return adasum_parts([tensor], output is not None, key, prescale_factor,
                            postscale_factor, process_set, asynchronous, grouped=False)
    if not _scaled_here(tensor.dtype, op, prescale_factor, postscale_factor):
        if output is None:
            functions = rtc.allreduce, rtc.allreduce_async
        else:
            functions = rtc.allreduce_, rtc.allreduce_async_
        part = launch(asynchronous, *functions, tensor, op=op, name=key,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set)
        return [part], _first
    work = _prescaled(tensor, prescale_factor)
    part = launch(asynchronous, rtc.allreduce_, rtc.allreduce_async_, work, op=_reducing(op),
                  name=key, process_set=process_set)
    divisor = set_size(process_set) if op is rtc.Average else 1
    return [part], lambda results: _into(output, _postscaled(results[0], divisor,
                                                             postscale_factor))


def allreduce_now(tensor: torch.Tensor, name: str | None, op: Any, prescale_factor: float,
                  postscale_factor: float, process_set: rtc.ProcessSet | None) -> torch.Tensor:
    """The allreduce of ``tensor`` into a new tensor, run at once."""
    return run("allreduce", name, False, lambda key: allreduce_parts(
        tensor, None, key, op, prescale_factor, postscale_factor, process_set, False))


def grouped_allreduce_parts(tensors: Sequence[torch.Tensor], in_place: bool, key: str | None,
                            op: Any, prescale_factor: float, postscale_factor: float,
                            process_set: rtc.ProcessSet | None, asynchronous: bool) -> Parts:
    """Start the fused allreduce of ``tensors``, in place or into new tensors."""
    tensors = list(tensors)
    if op is Adasum:
        return adasum_parts(tensors, in_place, key, prescale_factor, postscale_factor,
                            process_set, asynchronous, grouped=True)
    if not any(_scaled_here(t.dtype, op, prescale_factor, postscale_factor) for t in tensors):
        if in_place:
            functions = rtc.grouped_allreduce_, rtc.grouped_allreduce_async_
        else:
            functions = rtc.grouped_allreduce, rtc.grouped_allreduce_async
        part = launch(asynchronous, *functions, tensors, op=op, name=key,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set)
        return [part], lambda results: list(results[0])
    works = [_prescaled(t, prescale_factor) for t in tensors]
    part = launch(asynchronous, rtc.grouped_allreduce_, rtc.grouped_allreduce_async_, works,
                  op=_reducing(op), name=key, process_set=process_set)
    divisor = set_size(process_set) if op is rtc.Average else 1

    def finish(results: list[Any]) -> list[torch.Tensor]:
        return [_into(t if in_place else None, _postscaled(r, divisor, postscale_factor))
                for t, r in zip(tensors, results[0])]

    return [part], finish


def grouped_allreduce_now(tensors: Sequence[torch.Tensor], name: str | None, op: Any,
                          prescale_factor: float, postscale_factor: float,
                          process_set: rtc.ProcessSet | None) -> list[torch.Tensor]:
    """The fused allreduce of ``tensors`` into new tensors, run at once."""
    return run("grouped_allreduce", name, False, lambda key: grouped_allreduce_parts(
        tensors, False, key, op, prescale_factor, postscale_factor, process_set, False))


def allgather_parts(tensor: torch.Tensor, key: str | None,
                    process_set: rtc.ProcessSet | None, asynchronous: bool) -> Parts:
    """Start the allgather of ``tensor``."""
    part = launch(asynchronous, rtc.allgather, rtc.allgather_async, tensor, name=key,
                  process_set=process_set)
    return [part], _first


def allgather_now(tensor: torch.Tensor, name: str | None,
                  process_set: rtc.ProcessSet | None) -> torch.Tensor:
    """The allgather of ``tensor``, run at once."""
    return run("allgather", name, False,
               lambda key: allgather_parts(tensor, key, process_set, False))


def grouped_allgather_parts(tensors: Sequence[torch.Tensor], key: str | None,
                            process_set: rtc.ProcessSet | None, asynchronous: bool) -> Parts:
    """Start one allgather per tensor of ``tensors``."""
    return _combined([allgather_parts(t, sub_key(key, i), process_set, asynchronous)
                      for i, t in enumerate(tensors)])


def grouped_allgather_now(tensors: Sequence[torch.Tensor], name: str | None,
                          process_set: rtc.ProcessSet | None) -> list[torch.Tensor]:
    """The allgathers of ``tensors``, run at once."""
    return run("grouped_allgather", name, False,
               lambda key: grouped_allgather_parts(tensors, key, process_set, False))


def broadcast_parts(tensor: torch.Tensor, in_place: bool, root_rank: int, key: str | None,
                    process_set: rtc.ProcessSet | None, asynchronous: bool) -> Parts:
    """Start the broadcast of ``root_rank``'s ``tensor``, in place or into a new tensor."""
    if in_place:
        functions = rtc.broadcast_, rtc.broadcast_async_
    else:
        functions = rtc.broadcast, rtc.broadcast_async
    part = launch(asynchronous, *functions, tensor, root_rank, name=key,
                  process_set=process_set)
    return [part], _first


def broadcast_now(tensor: torch.Tensor, root_rank: int, name: str | None,
                  process_set: rtc.ProcessSet | None) -> torch.Tensor:
    """The broadcast of ``root_rank``'s ``tensor`` into a new tensor, run at once."""
    return run("broadcast", name, False, lambda key: broadcast_parts(
        tensor, False, root_rank, key, process_set, False))


def alltoall_parts(tensor: torch.Tensor, splits: Any, key: str | None,
                   process_set: rtc.ProcessSet | None, asynchronous: bool) -> Parts:
    """Start the alltoall of ``tensor``; the finish step gives the received rows and splits."""
    splits_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
    if splits is None:
        ranks = set_size(process_set)
        if tensor.dim() > 0 and tensor.shape[0] % ranks:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by "
                             f"the number of ranks ({ranks}), got {tensor.shape[0]}")
    elif isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    part = launch(asynchronous, rtc.alltoall, rtc.alltoall_async, tensor, splits, name=key,
                  process_set=process_set)

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        output, received_splits = results[0]
        return output, received_splits.to(splits_dtype)

    return [part], finish


def alltoall_now(tensor: torch.Tensor, splits: Any, name: str | None,
                 process_set: rtc.ProcessSet | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The alltoall of ``tensor``: the received rows and splits, run at once."""
    return run("alltoall", name, False,
               lambda key: alltoall_parts(tensor, splits, key, process_set, False))


def reducescatter_parts(tensor: torch.Tensor, key: str | None, op: Any,
                        process_set: rtc.ProcessSet | None, prescale_factor: float,
                        postscale_factor: float, asynchronous: bool) -> Parts:
    """Start the reducescatter of ``tensor``."""
    if op is Adasum:
        raise NotImplementedError("reducescatter does not support Adasum")
    functions = rtc.reducescatter, rtc.reducescatter_async
    if not _scaled_here(tensor.dtype, op, prescale_factor, postscale_factor):
        part = launch(asynchronous, *functions, tensor, op=op, name=key,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                      process_set=process_set)
        return [part], _first
    work = _prescaled(tensor, prescale_factor)
    part = launch(asynchronous, *functions, work, op=_reducing(op), name=key,
                  process_set=process_set)
    divisor = set_size(process_set) if op is rtc.Average else 1
    return [part], lambda results: _postscaled(results[0], divisor, postscale_factor)


def reducescatter_now(tensor: torch.Tensor, name: str | None, op: Any,
                      process_set: rtc.ProcessSet | None, prescale_factor: float,
                      postscale_factor: float) -> torch.Tensor:
    """The reducescatter of ``tensor``, run at once."""
    return run("reducescatter", name, False, lambda key: reducescatter_parts(
        tensor, key, op, process_set, prescale_factor, postscale_factor, False))


def grouped_reducescatter_parts(tensors: Sequence[torch.Tensor], key: str | None, op: Any,
                                process_set: rtc.ProcessSet | None, prescale_factor: float,
                                postscale_factor: float, asynchronous: bool) -> Parts:
    """Start one reducescatter per tensor of ``tensors``."""
    return _combined([reducescatter_parts(t, sub_key(key, i), op, process_set, prescale_factor,
                                          postscale_factor, asynchronous)
                      for i, t in enumerate(tensors)])


def grouped_reducescatter_now(tensors: Sequence[torch.Tensor], name: str | None, op: Any,
                              process_set: rtc.ProcessSet | None, prescale_factor: float,
                              postscale_factor: float) -> list[torch.Tensor]:
    """The reducescatters of ``tensors``, run at once."""
    return run("grouped_reducescatter", name, False, lambda key: grouped_reducescatter_parts(
        tensors, key, op, process_set, prescale_factor, postscale_factor, False))
