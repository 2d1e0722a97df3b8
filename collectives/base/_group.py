"""A communicator as the algorithms see it: rank, size, world ranks, scratch memory."""

from __future__ import annotations

from typing import Protocol

from mpi4py import MPI
import numpy as np


class Releasable(Protocol):
    """What a group frees with itself: a communicator or window built on its ranks."""

    def free(self) -> None:
        """Release it (collective over the ranks it was built on)."""


class Scratch:
    """Reusable temporary byte buffers, one per purpose, grown on demand and kept.

    The algorithms use a fixed small number of purposes (two ring segments, the
    recursive-doubling message pair), so temporary memory stays bounded by a few
    segments however large the arrays are.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def get(self, purpose: str, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` bytes reserved for ``purpose``."""
        buffer = self._buffers.get(purpose)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._buffers[purpose] = buffer
        return buffer

    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(buffer.nbytes for buffer in self._buffers.values())


class Group:
    """The ranks one collective runs over.

    Attributes:
        comm: the MPI communicator ringtrain owns for these ranks.
        rank: this process's rank in ``comm``.
        size: number of ranks in ``comm``.
        world_ranks: for each rank of ``comm``, its rank in ringtrain's world, used in
            every message so users see the ranks they know.
        scratch: temporary buffers of this group.
        state: per-group objects the algorithms keep between calls, by algorithm.
        children: what was built on this group's ranks (the hierarchical algorithms'
            node and cross-node groups, a node's shared-memory window), freed with it
            in reverse order of creation.
    """

    def __init__(self, comm: MPI.Comm, world_ranks: tuple[int, ...]):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.world_ranks = world_ranks
        self.scratch = Scratch()
        self.state: dict[str, object] = {}
        self.children: list[Releasable] = []

    @property
    def world_rank(self) -> int:
        """This process's rank in ringtrain's world."""
        return self.world_ranks[self.rank]

    def free(self) -> None:
        """Release the communicator and its children's (collective over the group)."""
        for child in reversed(self.children):
            child.free()
        self.children.clear()
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
