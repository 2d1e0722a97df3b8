"""The ``"ringtrain"`` process group: every torch.distributed call carried out by
ringtrain's own collectives, over a ringtrain process set.

torch calls a process group's methods with lists of tensors and an options object
(``opts``); each method here maps one call onto ringtrain's collectives:

============================================  ===============================================
torch                                         ringtrain
============================================  ===============================================
all_reduce, all_reduce_coalesced, reduce      ``allreduce_`` / ``grouped_allreduce_`` (reduce:
                                              the root in place, the others on a copy)
BAND, BOR, BXOR                               ``allgather``, then the bitwise reduction
broadcast                                     ``broadcast_``
all_gather, all_gather_into_tensor, ...       ``allgather`` of the flat tensor
reduce_scatter, reduce_scatter_tensor, ...    ``reducescatter`` (with splits for lists)
all_to_all, all_to_all_single                 ``alltoall`` with splits
gather, scatter                               ``alltoall``: only the root receives, or sends
barrier                                       ``barrier``
send, recv, recv from any rank                ``isend``, ``irecv``
============================================  ===============================================

A call made with ``async_op=False`` (``opts.asyncOp``) runs on the caller's thread and
returns completed work; one made with ``async_op=True``, or by torch's C++ (DDP's
buckets, whose options ask for asynchronous work), is queued on ringtrain's collectives
thread and its work completes when the collective has. Either way every collective goes
through ringtrain's agreement check, so ranks that disagree (shape, dtype, op, order)
raise the same :class:`~ringtrain.MismatchError` on every rank instead of hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from ..collectives import (ANY_SOURCE, ProcessSet, UnsupportedDtypeError, add_process_set,
                           allgather, allreduce_, alltoall, barrier, broadcast_,
                           global_process_set, grouped_allreduce_, init, irecv, isend, rank,
                           reducescatter, remove_process_set, size)
from ..collectives.engine import inside_a_call, submit
from ._name import BACKEND_NAME
from ._tensors import (Reduction, concatenated, contiguous, copy_into, flat, operand,
                       reduction, scatter_into)
from ._work import CompletedWork, WorkInFlight

Tensors = list[torch.Tensor]


class ProcessGroupRingtrain(dist.ProcessGroup):
    """A torch.distributed process group whose calls ringtrain carries out.

    Made by ``torch.distributed.init_process_group("ringtrain")`` and ``new_group``
    (and so by DeviceMesh), never directly.

    Args:
        group_rank: this process's rank in the group.
        group_size: the number of ranks in the group.
        process_set: the ringtrain process set of the group's ranks.
    """

    def __init__(self, group_rank: int, group_size: int, process_set: ProcessSet):
        super().__init__(group_rank, group_size)
        self._process_set = process_set
        self._world_ranks = process_set.ranks
        self._group_name = ""
        self._group_desc = ""
        self._blocking_done = CompletedWork([])

    @property
    def process_set(self) -> ProcessSet:
        """The ringtrain process set of this group (``process_set=`` of ringtrain's own
        calls)."""
        return self._process_set

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, description: str) -> None:  # noqa: N802
        self._group_desc = description

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupRingtrain(ranks={self._world_ranks}, rank={self.rank()})"

    # ------------------------------------------------------------------ running

    def _run(self, opts: Any, collective: str, body: Callable[..., Tensors],
             *args: Any) -> dist.Work:
        """``body(*args)`` now on this thread, or queued on the collectives thread when
        the caller asked for asynchronous work. A call made inside another, by a callback
        of a future that the collectives thread completes (PowerSGD's hook chains its
        calls so), runs at once: queued, it would wait behind the call it is made in."""
        if opts is not None and not opts.asyncOp or inside_a_call():
            return CompletedWork(body(*args))
        handle = submit(collective, None, lambda: body(*args), self._process_set)
        return WorkInFlight(handle, _same)

    def _world_rank(self, group_rank: int) -> int:
        return self._world_ranks[group_rank]

    # ------------------------------------------------------------------ reductions

    def allreduce(self, tensors: Tensors, opts: Any = None) -> dist.Work:
        if opts is not None and not opts.asyncOp and len(tensors) == 1:  # the common call
            self._reduce_in_place(tensors[0], reduction(opts.reduceOp, tensors[0].dtype))
            return self._blocking_done.holding(tensors)
        opts = _options(opts, c10d.AllreduceOptions)
        return self._run(opts, "allreduce", self._allreduce, tensors, opts.reduceOp)

    def allreduce_coalesced(self, tensors: Tensors, opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.AllreduceCoalescedOptions)
        return self._run(opts, "grouped_allreduce", self._allreduce, tensors, opts.reduceOp)

    def _allreduce(self, tensors: Tensors, op: Any) -> Tensors:
        if len(tensors) == 1:
            self._reduce_in_place(tensors[0], reduction(op, tensors[0].dtype))
            return tensors
        how = reduction(op, tensors[0].dtype)
        if how.bitwise is not None or any(contiguous(t) is not t for t in tensors):
            for tensor in tensors:
                self._reduce_in_place(tensor, reduction(op, tensor.dtype))
            return tensors
        grouped_allreduce_([operand(t, reduced=True) for t in tensors], op=how.op,
                           prescale_factor=how.prescale_factor,
                           process_set=self._process_set)
        return tensors

    def _reduce_in_place(self, tensor: torch.Tensor, how: Reduction) -> None:
        if how.bitwise is not None:
            copy_into(tensor, self._bitwise(flat(tensor), how))
            return
        target = contiguous(tensor)
        allreduce_(operand(target, reduced=True), op=how.op,
                   prescale_factor=how.prescale_factor, process_set=self._process_set)
        if target is not tensor:
            tensor.copy_(target)

    def _bitwise(self, data: torch.Tensor, how: Reduction) -> Any:
        """``data`` (1-D) reduced bitwise over the ranks: gathered, then reduced here."""
        rows = allgather(operand(data), process_set=self._process_set)
        if data.is_floating_point() or data.is_complex():
            raise UnsupportedDtypeError(
                f"rank {rank()}: torch.distributed reduction {how.bitwise.__name__} of a "
                f"{data.dtype} tensor: bitwise ops take integer and bool tensors")
        if isinstance(rows, torch.Tensor):
            rows = rows.cpu().numpy()
        return how.bitwise.reduce(rows.reshape(self.size(), -1), axis=0)

    def reduce(self, tensors: Tensors, opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.ReduceOptions)
        return self._run(opts, "reduce", self._reduce, tensors, opts.reduceOp, opts.rootRank)

    def _reduce(self, tensors: Tensors, op: Any, root: int) -> Tensors:
        tensor = tensors[0]
        how = reduction(op, tensor.dtype)
        if self.rank() == root:
            self._reduce_in_place(tensor, how)
        else:  # the others' tensors stay as they were
            self._reduce_in_place(tensor.clone(), how)
        return tensors

    def reduce_scatter(self, outputs: Tensors, inputs: list[Tensors],
                       opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.ReduceScatterOptions)
        return self._run(opts, "reducescatter", self._reduce_scatter, outputs[0], inputs[0],
                         opts.reduceOp)

    def _reduce_scatter(self, output: torch.Tensor, pieces: Tensors, op: Any) -> Tensors:
        self._share(output, concatenated(pieces), [p.numel() for p in pieces], op)
        return [output]

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.ReduceScatterOptions)
        return self._run(opts, "reducescatter", self._reduce_scatter_single, output, input,
                         opts.reduceOp)

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                               op: Any) -> Tensors:
        self._share(output, flat(input), [output.numel()] * self.size(), op)
        return [output]

    def reduce_scatter_single_coalesced(self, outputs: Tensors, inputs: Tensors,
                                        opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.ReduceScatterOptions)
        return self._run(opts, "reducescatter", self._reduce_scatter_each, outputs, inputs,
                         opts.reduceOp)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_each(self, outputs: Tensors, inputs: Tensors, op: Any) -> Tensors:
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_single(output, input, op)
        return outputs

    def _share(self, output: torch.Tensor, data: torch.Tensor, splits: list[int],
               op: Any) -> None:
        """Reduce the 1-D ``data`` over the ranks and copy this rank's share (``splits``
        elements each) into ``output``."""
        how = reduction(op, data.dtype)
        if how.bitwise is not None:
            start = sum(splits[:self.rank()])
            copy_into(output, self._bitwise(data, how)[start:start + splits[self.rank()]])
            return
        share = reducescatter(operand(data, reduced=True), op=how.op,
                              prescale_factor=how.prescale_factor,
                              process_set=self._process_set, splits=splits)
        copy_into(output.view(torch.uint8) if output.dtype is torch.bool else output, share)

    # ------------------------------------------------------------------ moving data

    def broadcast(self, tensors: Tensors, opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.BroadcastOptions)
        return self._run(opts, "broadcast", self._broadcast, tensors,
                         self._world_rank(opts.rootRank))

    def _broadcast(self, tensors: Tensors, root: int) -> Tensors:
        for tensor in tensors:
            target = contiguous(tensor)
            broadcast_(operand(target), root_rank=root, process_set=self._process_set)
            if target is not tensor:
                tensor.copy_(target)
        return tensors

    def allgather(self, outputs: list[Tensors], inputs: Tensors,
                  opts: Any = None) -> dist.Work:
        """``outputs[i][r]`` receives rank r's ``inputs[i]``."""
        opts = _options(opts, c10d.AllgatherOptions)
        return self._run(opts, "allgather", self._allgather_lists, outputs, inputs)

    def allgather_coalesced(self, outputs: list[Tensors], inputs: Tensors,
                            opts: Any = None) -> dist.Work:
        """``outputs[r][i]`` receives rank r's ``inputs[i]`` (the other way round)."""
        opts = _options(opts, c10d.AllgatherOptions)
        by_input = [[outputs[r][i] for r in range(len(outputs))] for i in range(len(inputs))]
        return self._run(opts, "allgather", self._allgather_lists, by_input, inputs)

    def _allgather_lists(self, outputs: list[Tensors], inputs: Tensors) -> Tensors:
        for pieces, input in zip(outputs, inputs):
            scatter_into(pieces, allgather(operand(flat(input)),
                                           process_set=self._process_set))
        return [piece for pieces in outputs for piece in pieces]

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.AllgatherOptions)
        return self._run(opts, "allgather", self._allgather_each, [output], [input])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Tensors, inputs: Tensors,
                                    opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.AllgatherOptions)
        return self._run(opts, "allgather", self._allgather_each, outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _allgather_each(self, outputs: Tensors, inputs: Tensors) -> Tensors:
        for output, input in zip(outputs, inputs):
            copy_into(output, allgather(operand(flat(input)), process_set=self._process_set))
        return outputs

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int], input_split_sizes: Sequence[int],
                          opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.AllToAllOptions)
        return self._run(opts, "alltoall", self._all_to_all_single, output, input,
                         list(output_split_sizes), list(input_split_sizes))

    alltoall_base = all_to_all_single

    def _all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                           output_splits: list[int], input_splits: list[int]) -> Tensors:
        data = contiguous(input)
        received, received_splits = alltoall(operand(data), splits=input_splits or None,
                                             process_set=self._process_set)
        if output_splits and [int(s) for s in received_splits] != output_splits:
            raise ValueError(
                f"rank {rank()}: torch.distributed all_to_all_single: the ranks sent "
                f"{[int(s) for s in received_splits]} rows, output_split_sizes says "
                f"{output_splits}")
        copy_into(output, received)
        return [output]

    def alltoall(self, outputs: Tensors, inputs: Tensors, opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.AllToAllOptions)
        return self._run(opts, "alltoall", self._alltoall, outputs, inputs)

    def _alltoall(self, outputs: Tensors, inputs: Tensors) -> Tensors:
        received, _ = alltoall(operand(concatenated(inputs)),
                               splits=[t.numel() for t in inputs],
                               process_set=self._process_set)
        scatter_into(outputs, received)
        return outputs

    def gather(self, outputs: list[Tensors], inputs: Tensors, opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.GatherOptions)
        return self._run(opts, "gather", self._gather, outputs, inputs[0], opts.rootRank)

    def _gather(self, outputs: list[Tensors], input: torch.Tensor, root: int) -> Tensors:
        data = flat(input)
        splits = [0] * self.size()
        splits[root] = data.numel()
        received, _ = alltoall(operand(data), splits=splits, process_set=self._process_set)
        if self.rank() != root:
            return []
        scatter_into(outputs[0], received)
        return outputs[0]

    def scatter(self, outputs: Tensors, inputs: list[Tensors], opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.ScatterOptions)
        return self._run(opts, "scatter", self._scatter, outputs[0], inputs, opts.rootRank)

    def _scatter(self, output: torch.Tensor, inputs: list[Tensors], root: int) -> Tensors:
        if self.rank() == root:
            data = concatenated(inputs[0])
            splits = [t.numel() for t in inputs[0]]
        else:
            data = torch.empty(0, dtype=output.dtype, device=output.device)
            splits = [0] * self.size()
        received, _ = alltoall(operand(data), splits=splits, process_set=self._process_set)
        copy_into(output, received)
        return [output]

    def barrier(self, opts: Any = None) -> dist.Work:
        opts = _options(opts, c10d.BarrierOptions)
        return self._run(opts, "barrier", self._barrier)

    def _barrier(self) -> Tensors:
        barrier(process_set=self._process_set)
        return []

    # ------------------------------------------------------------------ point to point

    def send(self, tensors: Tensors, dst: int, tag: int) -> dist.Work:
        tensor = tensors[0]
        data = contiguous(tensor)
        handle = isend(operand(data), dst=self._world_rank(dst), tag=tag,
                       process_set=self._process_set)
        return WorkInFlight(handle, lambda _: [tensor])

    def recv(self, tensors: Tensors, src: int, tag: int) -> dist.Work:
        return self._receive(tensors[0], self._world_rank(src), tag)

    def recv_anysource(self, tensors: Tensors, tag: int) -> dist.Work:
        return self._receive(tensors[0], ANY_SOURCE, tag)

    def _receive(self, tensor: torch.Tensor, src: int, tag: int) -> dist.Work:
        target = contiguous(tensor)
        handle = irecv(operand(target), src=src, tag=tag, process_set=self._process_set)

        def finish(_: Any) -> Tensors:
            if target is not tensor:
                tensor.copy_(target)
            return [tensor]

        return WorkInFlight(handle, finish,
                            lambda: self._world_ranks.index(handle.source))

    # ------------------------------------------------------------------ lifetime

    def _start_coalescing(self, device: torch.device) -> None:
        """Calls between this and :meth:`_end_coalescing` run as they come."""

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        return CompletedWork([])

    def shutdown(self) -> None:
        """Release the group's communicator (its ranks call it together)."""
        if self._process_set is not global_process_set:
            remove_process_set(self._process_set)

    def abort(self) -> None:
        """Release the group's communicator (its ranks call it together)."""
        self.shutdown()


def _same(outputs: Tensors) -> Tensors:
    return outputs


def _options(opts: Any, kind: type) -> Any:
    """torch's options object; a caller that passed none gets the defaults (asynchronous
    work, as torch's C++ asks)."""
    return kind() if opts is None else opts


def create(options: Any, backend_options: Any = None) -> ProcessGroupRingtrain:
    """The process group torch asks for (``register_backend``'s extended creator).

    The default group must be ringtrain's world: the rank and size torch was given
    (from the variables or ``init_process_group``'s arguments) must be MPI's.

    Raises:
        RuntimeError: the process was not started by MPI's launcher with the others
            (e.g. by torchrun), or torch's rank or size differs from MPI's.
    """
    init()
    group_rank, group_size = int(options.group_rank), int(options.group_size)
    ranks = [int(r) for r in options.global_ranks_in_group]
    if not ranks:
        _check_world(group_rank, group_size)
        return ProcessGroupRingtrain(group_rank, group_size, global_process_set)
    process_set = add_process_set(ranks)
    if process_set.ranks[group_rank] != rank():
        raise RuntimeError(f"rank {rank()}: torch.distributed gave group rank {group_rank} "
                           f"in group {ranks}, which is rank {process_set.ranks[group_rank]}")
    return ProcessGroupRingtrain(group_rank, group_size, process_set)


def _check_world(group_rank: int, group_size: int) -> None:
    if group_size != size():
        raise RuntimeError(
            f"the torch.distributed backend 'ringtrain' runs on MPI's processes: torch was "
            f"told of {group_size} processes, MPI knows {size()} (was this one started "
            f"without MPI, e.g. by torchrun?); launch with `mpiexec -n {group_size} python "
            f"...` or `ringtrain-run -np {group_size} python ...`")
    if group_rank != rank():
        raise RuntimeError(
            f"rank {rank()}: torch.distributed was given rank {group_rank} (RANK or "
            f"init_process_group's rank=) but MPI says {rank()}: leave RANK unset under "
            f"mpiexec or ringtrain-run, or set it to MPI's rank")


def process_set_of(group: Any = None) -> ProcessSet:
    """The ringtrain process set of a torch.distributed group of this backend.

    Args:
        group: a process group made on the ``"ringtrain"`` backend (default: the
            default group).

    Raises:
        ValueError: the group is of another backend.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(group, ProcessGroupRingtrain):
        raise ValueError(f"{group!r} is not a process group of the 'ringtrain' backend")
    return group.process_set
