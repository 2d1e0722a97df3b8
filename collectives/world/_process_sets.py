"""Process sets: collectives over a subset of the ranks."""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from ..base._group import Group
from ..errors import InvalidArgumentError, subject
from ..transport._mailboxes import open_mailboxes
from ..transport._p2p_channels import open_channels
from ._world import World, world


class ProcessSet:
    """A subset of ranks that collectives can run over (``process_set=``).

    Its communicator is built on first use, collectively over its member ranks, so
    every member must use (or :func:`add_process_set`) process sets in the same order.

    Args:
        ranks: world ranks of the members; ``None`` means all ranks.
    """

    def __init__(self, ranks: Iterable[int] | None = None):
        if ranks is None:
            self._ranks: tuple[int, ...] | None = None
        else:
            listed = [int(r) for r in ranks]
            duplicates = sorted({r for r in listed if listed.count(r) > 1})
            if duplicates:
                raise InvalidArgumentError(f"process set ranks repeat {duplicates}: {listed}")
            if not listed:
                raise InvalidArgumentError("a process set needs at least one rank")
            self._ranks = tuple(sorted(listed))
        self._group: Group | None = None
        self._generation = 0

    @property
    def ranks(self) -> list[int]:
        """World ranks of the members, ascending."""
        if self._ranks is None:
            return list(range(world().group.size))
        return list(self._ranks)

    def included(self) -> bool:
        """Whether this process is a member."""
        return world().group.rank in self.ranks

    def rank(self) -> int:
        """This process's rank within the set; raises if it is not a member."""
        me = world().group.rank
        if me not in self.ranks:
            raise InvalidArgumentError(f"rank {me} is not a member of process set {self.ranks}")
        return self.ranks.index(me)

    def size(self) -> int:
        """Number of member ranks."""
        return len(self.ranks)

    def group(self, collective: str, tensor_name: str | None = None) -> Group:
        """The group collectives run over; built on first use by the members.

        Raises:
            InvalidArgumentError: this rank is not a member, or a rank is out of range.
        """
        state = world()
        if self._ranks is None:
            return state.group
        if self._group is not None and self._generation == state.generation:
            return self._group
        self._check_ranks(state, collective, tensor_name)
        if state.group.rank not in self._ranks:
            raise InvalidArgumentError(
                f"{subject(collective, tensor_name)}: this rank "
                f"is not a member of process set {list(self._ranks)}")
        # Built in turn with the collectives: its messages travel on ringtrain's communicator.
        return state.executor.run(self._build, (state,), "add_process_set", None)

    def _build(self, state: World) -> Group:
        if self._group is not None and self._generation == state.generation:
            return self._group  # another thread built it first
        members = state.group.comm.Get_group().Incl(list(self._ranks))
        tag = zlib.crc32(repr(self._ranks).encode()) % 32768
        comm = state.group.comm.Create_group(members, tag)
        members.Free()
        self._group = Group(comm, self._ranks)
        open_channels(self._group)
        open_mailboxes(self._group)
        self._generation = state.generation
        state.process_set_groups.append(self._group)
        return self._group

    def _check_ranks(self, state: World, collective: str, tensor_name: str | None) -> None:
        outside = [r for r in self._ranks if not 0 <= r < state.group.size]
        if outside:
            raise InvalidArgumentError(
                f"{subject(collective, tensor_name)}: process set ranks "
                f"{outside} are outside 0..{state.group.size - 1}")

    def __repr__(self) -> str:
        if self._ranks is None:
            return "ProcessSet(all ranks)"
        return f"ProcessSet({list(self._ranks)})"


global_process_set = ProcessSet()
"""The process set of all ranks: the default of every collective."""


def add_process_set(process_set: ProcessSet | Iterable[int]) -> ProcessSet:
    """Register a process set and build its communicator now.

    Every rank calls it with the same ranks, in the same order as other process sets.

    Args:
        process_set: a :class:`ProcessSet` or the world ranks of its members.

    Returns:
        The process set, ready to pass as ``process_set=``.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.included():
        process_set.group("add_process_set")
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Release a process set's communicator (collective over its members).

    Returns:
        True if a communicator was released on this rank.
    """
    group = process_set._group
    if group is None or process_set is global_process_set:
        return False
    state = world()
    if group in state.process_set_groups:
        state.process_set_groups.remove(group)
        group.free()
    process_set._group = None
    return True


def resolve_group(process_set: ProcessSet | None, collective: str,
                  tensor_name: str | None) -> Group:
    """The group a collective runs over (all ranks when ``process_set`` is None)."""
    if process_set is None:
        return world().group
    if not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(
            f"{subject(collective, tensor_name)}: process_set must be a "
            f"ProcessSet, got {type(process_set).__name__}")
    return process_set.group(collective, tensor_name)
