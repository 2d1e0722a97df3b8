"""Horovod's collectives (``horovod.torch.mpi_ops``) on ringtrain's collectives.

Each function keeps Horovod's name, signature and return type and calls the matching
ringtrain collective with torch CPU tensors (zero-copy). What ringtrain does not do the
way Horovod does is done here, around the ringtrain call:

* integer tensors: an Average is a Sum divided with truncation toward zero; scale
  factors are applied in float64 and the result truncated back;
* float16 tensors with scale factors: scaled in float32;
* grouped allgather and grouped reducescatter: one ringtrain collective per tensor;
* Adasum: ringtrain's Adasum allreduce, GPU tensors through a host copy (see ``_adasum``);
* sparse allreduce: allgathers of the indices and the values.

Names: an operation's name is Horovod's, ``"<collective>.<name>"`` (e.g.
``"allreduce.w"``), in error messages and on the timeline. A name held by an
asynchronous operation still in flight on this rank cannot be used again (ValueError).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from ... import collectives as rtc
from ...collectives import timeline
from . import _autograd
from ._handles import Handle, HorovodInternalError, forget_all, launch, mark_timeline
from ._operations import (Adasum, Parts, allgather_parts, allreduce_parts, alltoall_parts,
                          broadcast_parts, grouped_allgather_parts, grouped_allreduce_parts,
                          grouped_reducescatter_parts, reducescatter_parts, run, set_size,
                          sub_key)
from .compression import Compression, Compressor

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "Handle",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "barrier", "poll", "synchronize",
]

Average = rtc.Average
Sum = rtc.Sum
Min = rtc.Min
Max = rtc.Max
Product = rtc.Product


# --------------------------------------------------------------------------- basics

def init(comm: MPI.Comm | Sequence[int] | None = None,
         process_sets: Sequence[rtc.ProcessSet] | None = None) -> None:
    """Start ringtrain (``ringtrain.init``); again while initialized, nothing happens.

    Args:
        comm: an mpi4py communicator whose ranks take part, or a list of ranks of
            ``MPI.COMM_WORLD`` (only those ranks call ``init``); default all ranks.
        process_sets: process sets to register right away (:func:`add_process_set`).
    """
    if not rtc.is_initialized():
        if comm is not None and not isinstance(comm, MPI.Comm):
            comm = _communicator_of(comm)
        rtc.init(comm)
    for process_set in process_sets or ():
        if _added.get(tuple(process_set.ranks)) is not process_set:
            add_process_set(process_set)


def _communicator_of(ranks: Sequence[int]) -> MPI.Comm:
    members = sorted(int(r) for r in ranks)
    world = MPI.COMM_WORLD
    if world.Get_rank() not in members:
        raise ValueError(f"init: rank {world.Get_rank()} is not among the ranks {members}")
    group = world.Get_group().Incl(members)
    try:
        return world.Create_group(group)
    finally:
        group.Free()


def shutdown() -> None:
    """Stop ringtrain (``ringtrain.shutdown``); process sets are forgotten."""
    forget_all()
    _added.clear()
    stop_timeline()
    rtc.shutdown()


def is_initialized() -> bool:
    """Whether :func:`init` was called (``ringtrain.is_initialized``)."""
    return rtc.is_initialized()


def size() -> int:
    """Number of ranks (``ringtrain.size``)."""
    return rtc.size()


def local_size() -> int:
    """Number of ranks on this node (``ringtrain.local_size``)."""
    return rtc.local_size()


def cross_size() -> int:
    """Number of nodes with a rank of this local rank (``ringtrain.cross_size``)."""
    return rtc.cross_size()


def rank() -> int:
    """This process's rank (``ringtrain.rank``)."""
    return rtc.rank()


def local_rank() -> int:
    """This process's rank on its node (``ringtrain.local_rank``)."""
    return rtc.local_rank()


def cross_rank() -> int:
    """This node's index (``ringtrain.cross_rank``)."""
    return rtc.cross_rank()


def mpi_threads_supported() -> bool:
    """Whether MPI was initialized with ``MPI_THREAD_MULTIPLE``."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_built() -> bool:
    """True: ringtrain runs on MPI."""
    return True


def mpi_enabled() -> bool:
    """True: ringtrain runs on MPI."""
    return True


def gloo_built() -> bool:
    """False: there is no Gloo controller."""
    return False


def gloo_enabled() -> bool:
    """False: there is no Gloo controller."""
    return False


def nccl_built() -> int:
    """0 (Horovod's NCCL version number): the collectives do not use NCCL."""
    return 0


def ddl_built() -> bool:
    """False: no IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL."""
    return False


def cuda_built() -> bool:
    """False: the collectives take CPU tensors."""
    return False


def rocm_built() -> bool:
    """False: no ROCm."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start ringtrain's timeline (``ringtrain.start_timeline``) in ``file_path``.

    As in Horovod, rank 0 writes the file (the other ranks record nothing). Besides
    ringtrain's phases it holds Horovod's event names for the operations started here:
    ``NEGOTIATE_<OP>`` when one starts, ``<OP>`` until it completes, and with
    ``mark_cycles`` a ``CYCLE_START`` before each.
    """
    if rtc.rank() != 0:
        return
    rtc.start_timeline(file_path, rank=0, size=1)
    mark_timeline(True, mark_cycles)
    timeline.ACTIVE.instant("horovod", "TIMELINE_START",
                            start_time_since_epoch_in_micros=time.time_ns() // 1000)


def stop_timeline() -> None:
    """Stop the timeline (``ringtrain.stop_timeline``)."""
    mark_timeline(False)
    rtc.stop_timeline()


# --------------------------------------------------------------------------- process sets

class ProcessSet(rtc.ProcessSet):
    """Horovod's ProcessSet: ranks that run collectives together (``ringtrain.ProcessSet``).

    Args:
        ranks_or_comm: the world ranks of the members, or an mpi4py communicator whose
            ranks (translated to ``MPI.COMM_WORLD``) are the members.
    """

    def __init__(self, ranks_or_comm: Sequence[int] | MPI.Comm) -> None:
        if isinstance(ranks_or_comm, MPI.Comm):
            comm = ranks_or_comm
            ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                              MPI.COMM_WORLD.Get_group())
        else:
            try:
                ranks = list(ranks_or_comm)
            except TypeError:
                raise ValueError("a ProcessSet takes a list of ranks or an mpi4py "
                                 "communicator") from None
            if any(not isinstance(r, (int, np.integer)) or isinstance(r, bool) for r in ranks):
                raise ValueError(f"a ProcessSet takes integer ranks, got {ranks}")
        super().__init__(ranks)


global_process_set = rtc.global_process_set

_added: dict[tuple[int, ...], rtc.ProcessSet] = {}


def add_process_set(process_set: rtc.ProcessSet | Sequence[int]) -> rtc.ProcessSet:
    """Register a process set (``ringtrain.add_process_set``); every rank calls it.

    Raises:
        ValueError: a rank is out of range, or a process set of the same ranks exists
            (the global one included).
    """
    if not isinstance(process_set, rtc.ProcessSet):
        process_set = ProcessSet(process_set)
    ranks = tuple(process_set.ranks)
    world_size = rtc.size()
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise ValueError(f"process set ranks {outside} are outside 0..{world_size - 1}")
    if ranks in _added or ranks == tuple(range(world_size)):
        raise ValueError(f"a process set of the ranks {list(ranks)} exists already")
    rtc.add_process_set(process_set)
    _added[ranks] = process_set
    return process_set


def remove_process_set(process_set: rtc.ProcessSet) -> bool:
    """Unregister a process set (``ringtrain.remove_process_set``); every rank calls it.

    Returns:
        Whether it was registered (the global process set never is removed).
    """
    ranks = tuple(process_set.ranks)
    if _added.get(ranks) is not process_set:
        return False
    del _added[ranks]
    rtc.remove_process_set(process_set)
    return True


# --------------------------------------------------------------------------- helpers

def _resolve_op(op: Any, average: bool | None) -> Any:
    """``op``, or the deprecated ``average`` as Average/Sum; Average when neither is given."""
    if op is not None:
        if average is not None:
            raise ValueError("give op or the deprecated average, not both")
        return op
    if average is not None:
        warnings.warn("average= is deprecated: use op=Average or op=Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


# --------------------------------------------------------------------------- allreduce

def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: rtc.ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks into a new tensor (``ringtrain.allreduce``).

    ``op`` is Average (default), Sum, Min, Max, Product or Adasum; ``average`` is
    deprecated. Differentiable: the gradient is the same allreduce of the gradient.
    """
    op = _resolve_op(op, average)
    compressed, context = compression.compress(tensor)
    result = _autograd.allreduce(compressed, name, op, prescale_factor, postscale_factor,
                                 process_set)
    return compression.decompress(result, context)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`allreduce` (``ringtrain.allreduce_async``); synchronize gives the tensor."""
    op = _resolve_op(op, average)
    return run("allreduce", name, True, lambda key: allreduce_parts(
        tensor, None, key, op, prescale_factor, postscale_factor, process_set, True))


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: rtc.ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce` (``ringtrain.allreduce_``); returns ``tensor``."""
    op = _resolve_op(op, average)
    return run("allreduce", name, False, lambda key: allreduce_parts(
        tensor, tensor, key, op, prescale_factor, postscale_factor, process_set, False))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`allreduce_` (``ringtrain.allreduce_async_``)."""
    op = _resolve_op(op, average)
    return run("allreduce", name, True, lambda key: allreduce_parts(
        tensor, tensor, key, op, prescale_factor, postscale_factor, process_set, True))


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: type[Compressor] = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: rtc.ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce a list of tensors in one fused operation (``ringtrain.grouped_allreduce``).

    Arguments as :func:`allreduce`; returns the list of new tensors. Differentiable.
    """
    op = _resolve_op(op, average)
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors \
        else ((), ())
    results = _autograd.grouped_allreduce(compressed, name, op, prescale_factor,
                                          postscale_factor, process_set)
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`grouped_allreduce` (``ringtrain.grouped_allreduce_async``)."""
    op = _resolve_op(op, average)
    return run("grouped_allreduce", name, True, lambda key: grouped_allreduce_parts(
        tensors, False, key, op, prescale_factor, postscale_factor, process_set, True))


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: rtc.ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce` (``ringtrain.grouped_allreduce_``)."""
    op = _resolve_op(op, average)
    return run("grouped_allreduce", name, False, lambda key: grouped_allreduce_parts(
        tensors, True, key, op, prescale_factor, postscale_factor, process_set, False))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`grouped_allreduce_` (``ringtrain.grouped_allreduce_async_``)."""
    op = _resolve_op(op, average)
    return run("grouped_allreduce", name, True, lambda key: grouped_allreduce_parts(
        tensors, True, key, op, prescale_factor, postscale_factor, process_set, True))


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start the allreduce of a sparse COO tensor: allgathers of its indices and values
    (``ringtrain.allgather_async``). Synchronizing (or calling) the handle gives the
    sparse sum, or average for Average, with the gathered entries uncoalesced."""
    if op is not Sum and op is not Average:
        raise ValueError(f"sparse allreduce supports Sum and Average, not {op!r}")

    def build(key: str | None) -> Parts:
        indices = tensor._indices().t().contiguous()
        parts = [launch(True, rtc.allgather, rtc.allgather_async, data, name=sub_key(key, part),
                        process_set=process_set)
                 for part, data in ((0, indices), (1, tensor._values()))]

        def finish(results: list[Any]) -> torch.Tensor:
            gathered_indices, values = results
            if op is Average:
                values = values / set_size(process_set)
            return torch.sparse_coo_tensor(gathered_indices.t(), values, tensor.size(),
                                           check_invariants=False)

        return parts, finish

    return run("sparse_allreduce", name, True, build)


# --------------------------------------------------------------------------- allgather

def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: rtc.ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0 (``ringtrain.allgather``).

    Differentiable: the gradient is this rank's rows of the averaged gradient.
    """
    return _autograd.allgather(tensor, name, process_set)


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`allgather` (``ringtrain.allgather_async``)."""
    return run("allgather", name, True,
               lambda key: allgather_parts(tensor, key, process_set, True))


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: rtc.ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor of a list (one ``ringtrain.allgather`` each).

    Differentiable.
    """
    return _autograd.grouped_allgather(tensors, name, process_set)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`grouped_allgather` (``ringtrain.allgather_async`` per tensor)."""
    return run("grouped_allgather", name, True,
               lambda key: grouped_allgather_parts(tensors, key, process_set, True))


# --------------------------------------------------------------------------- broadcast

def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: rtc.ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding ``root_rank``'s ``tensor`` on every rank (``ringtrain.broadcast``).

    Differentiable: the root gets the averaged gradient, the other ranks zeros.
    """
    return _autograd.broadcast(tensor, root_rank, name, process_set)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`broadcast` (``ringtrain.broadcast_async``)."""
    return run("broadcast", name, True, lambda key: broadcast_parts(
        tensor, False, root_rank, key, process_set, True))


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: rtc.ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast` (``ringtrain.broadcast_``); returns ``tensor``."""
    return run("broadcast", name, False, lambda key: broadcast_parts(
        tensor, True, root_rank, key, process_set, False))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`broadcast_` (``ringtrain.broadcast_async_``)."""
    return run("broadcast", name, True, lambda key: broadcast_parts(
        tensor, True, root_rank, key, process_set, True))


# --------------------------------------------------------------------------- alltoall

def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: rtc.ProcessSet = global_process_set) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j, receive every rank's rows for this
    one (``ringtrain.alltoall``).

    Without ``splits`` the first dimension is divided evenly (it must divide). Returns
    the received rows, and with ``splits`` also the received splits (a tensor of the
    splits' dtype, int32 for a list). Differentiable.
    """
    return _autograd.alltoall(tensor, splits, name, process_set)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: rtc.ProcessSet = global_process_set) -> Handle:
    """Start :func:`alltoall` (``ringtrain.alltoall_async``); synchronize gives
    ``(received rows, received splits)``."""
    return run("alltoall", name, True,
               lambda key: alltoall_parts(tensor, splits, key, process_set, True))


# --------------------------------------------------------------------------- reducescatter

def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: rtc.ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce ``tensor`` over the ranks and keep this rank's share of dimension 0
    (``ringtrain.reducescatter``; earlier ranks get the extra rows).

    ``op`` is Average (default), Sum, Min, Max or Product. Differentiable.
    """
    compressed, context = compression.compress(tensor)
    result = _autograd.reducescatter(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(result, context)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average,
                        process_set: rtc.ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start :func:`reducescatter` (``ringtrain.reducescatter_async``)."""
    return run("reducescatter", name, True, lambda key: reducescatter_parts(
        tensor, key, op, process_set, prescale_factor, postscale_factor, True))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: Any = Average,
                          process_set: rtc.ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor of a list (one ``ringtrain.reducescatter``
    each). Differentiable."""
    compressed, contexts = zip(*[compression.compress(t) for t in tensors]) if tensors \
        else ((), ())
    results = _autograd.grouped_reducescatter(compressed, name, op, process_set,
                                              prescale_factor, postscale_factor)
    return [compression.decompress(r, c) for r, c in zip(results, contexts)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: Any = Average,
                                process_set: rtc.ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start :func:`grouped_reducescatter` (``ringtrain.reducescatter_async`` per tensor)."""
    return run("grouped_reducescatter", name, True, lambda key: grouped_reducescatter_parts(
        tensors, key, op, process_set, prescale_factor, postscale_factor, True))


# --------------------------------------------------------------------------- the rest

def join(device: int = -1) -> int:
    """Wait for every rank to join, contributing zeros to the others' allreduces meanwhile
    (``ringtrain.join``); returns the rank that joined last. ``device`` is unused."""
    try:
        return rtc.join()
    except rtc.CommunicationError as error:
        raise HorovodInternalError(str(error)) from error


def barrier(process_set: rtc.ProcessSet = global_process_set) -> None:
    """Wait until every rank of ``process_set`` has called it (``ringtrain.barrier``)."""
    try:
        rtc.barrier(process_set)
    except rtc.CommunicationError as error:
        raise HorovodInternalError(str(error)) from error


def poll(handle: Handle | rtc.Handle) -> bool:
    """Whether the operation of ``handle`` has completed (``ringtrain.poll``)."""
    if isinstance(handle, Handle):
        return handle.done()
    return rtc.poll(handle)


def synchronize(handle: Handle | rtc.Handle) -> Any:
    """Wait for the operation of ``handle`` and return its output (``ringtrain.synchronize``).

    Raises:
        HorovodInternalError: MPI failed while the collective moved data.
        MismatchError: ranks called it with different arguments (a RuntimeError).
    """
    if isinstance(handle, Handle):
        return handle.wait()
    try:
        return rtc.synchronize(handle)
    except rtc.CommunicationError as error:
        raise HorovodInternalError(str(error)) from error
