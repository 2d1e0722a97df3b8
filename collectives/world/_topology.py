"""The node layout of a group, and the communicators the hierarchical algorithms run on.

A :class:`NodeLayout` says which ranks of a group share a node. It is computed without
communication from what :func:`~ringtrain.init` learnt once (every rank's node, from
MPI's shared-memory split) or, with the ``node_size`` setting, from the world ranks
alone; so every rank of a group computes the same layout, and a process set gets the
layout of its own ranks. Nodes are numbered by their lowest rank; within a node, ranks
are numbered (their *local index*) in group order.

For an allreduce the array is cut into ``width`` chunks, ``width`` being the size of
the largest node. On a node of ``n`` ranks, local index i owns chunks
``i*width//n .. (i+1)*width//n - 1`` (one chunk each when every node is full; several
on smaller nodes), so every chunk has exactly one owner per node. The ranks owning
chunk j, one per node, form the cross-node group of chunk j; the owners of chunk 0 are
the nodes' first ranks, the *leaders*.

The communicators (:class:`Hierarchy`) are built on first use from the group's
communicator, inside a collective's data phase: every rank of the group has agreed on
the same call, layout included, so all of them build them at the same moment.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from mpi4py import MPI

from ..base._group import Group
from ..config import Settings
from ..transport._mailboxes import mailboxes_of
from ._world import world

HIERARCHICAL = ("hierarchical", "node_leader")
"""The algorithms that run on a :class:`NodeLayout`."""


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks of a group share a node.

    Attributes:
        nodes: for each node, its ranks (group ranks, ascending); nodes in the order of
            their lowest rank.
        source: where the layout came from: ``shared memory`` or ``node_size=k``.
        shared_messages: whether the agreement's messages pass through shared memory
            (the group's mailboxes, see :mod:`._mailboxes`), or there are none to pass
            (a group of one rank).
    """

    nodes: tuple[tuple[int, ...], ...]
    source: str
    shared_messages: bool = True

    @cached_property
    def node_of(self) -> tuple[int, ...]:
        """For each group rank, the index of its node."""
        index = {rank: n for n, members in enumerate(self.nodes) for rank in members}
        return tuple(index[rank] for rank in range(len(index)))

    @property
    def width(self) -> int:
        """Ranks on the largest node: the number of allreduce chunks."""
        return max(len(members) for members in self.nodes)

    @property
    def uniform(self) -> bool:
        """Whether every node holds the same number of ranks."""
        return len({len(members) for members in self.nodes}) == 1

    @property
    def pays_off(self) -> bool:
        """Whether the hierarchical algorithms can save traffic between nodes: the ranks
        span several nodes and some node holds more than one of them."""
        return 1 < len(self.nodes) < len(self.node_of)

    def first_chunk(self, node: int, local: int) -> int:
        """The first allreduce chunk owned by local index ``local`` of ``node``."""
        return local * self.width // len(self.nodes[node])

    def describe(self) -> str:
        """``"2+2 (shared memory)"``: ranks per node, and the layout's source."""
        return f"{'+'.join(str(len(m)) for m in self.nodes)} ({self.source})"


def layout_of(group: Group, settings: Settings) -> NodeLayout:
    """The layout of ``group``'s ranks under ``settings`` (no communication)."""
    key = ("layout", settings.node_size)
    layout = group.state.get(key)
    if layout is None:
        if settings.node_size > 0:
            keys = [w - w % settings.node_size for w in group.world_ranks]
            source = f"node_size={settings.node_size}"
        else:
            node_keys = world().node_keys
            keys = [node_keys[w] for w in group.world_ranks]
            source = "shared memory"
        members: dict[int, list[int]] = {}
        for rank, node in enumerate(keys):
            members.setdefault(node, []).append(rank)
        layout = NodeLayout(tuple(tuple(m) for m in members.values()), source,
                            group.size == 1 or mailboxes_of(group) is not None)
        group.state[key] = layout
    return layout


class Hierarchy:
    """The communicators of one layout, seen from this rank.

    Attributes:
        layout: the layout.
        node: this rank's node index.
        local_index: this rank's index on its node.
        local: the ranks of this node (rank order = local index).
        chunks: this rank's allreduce chunks, ascending.
        cross: for each chunk in ``chunks``, the group of its owners (rank = node index).
        leaders: the nodes' first ranks (rank = node index), or None on other ranks.
    """

    def __init__(self, group: Group, layout: NodeLayout):
        self.layout = layout
        self.node = layout.node_of[group.rank]
        members = layout.nodes[self.node]
        self.local_index = members.index(group.rank)
        self.local = _subgroup(group, group.comm.Split(self.node, self.local_index), members)
        end = layout.first_chunk(self.node, self.local_index + 1) \
            if self.local_index + 1 < len(members) else layout.width
        self.chunks = tuple(range(layout.first_chunk(self.node, self.local_index), end))
        self.cross: list[Group] = []
        for chunk in range(layout.width):
            owners = tuple(_owner(layout, node, chunk) for node in range(len(layout.nodes)))
            mine = chunk in self.chunks
            comm = group.comm.Split(0 if mine else MPI.UNDEFINED, self.node)
            if mine:
                self.cross.append(_subgroup(group, comm, owners))
        self.leaders = self.cross[0] if self.local_index == 0 else None

    def chunk_bounds(self, count: int) -> list[int]:
        """Element offsets of the ``width`` allreduce chunks of ``count`` elements."""
        base, extra = divmod(count, self.layout.width)
        return [i * base + min(i, extra) for i in range(self.layout.width + 1)]

    def local_bounds(self, count: int) -> list[int]:
        """Element offsets of what each local index owns on this node."""
        bounds = self.chunk_bounds(count)
        size = len(self.layout.nodes[self.node])
        return [bounds[self.layout.first_chunk(self.node, i)] for i in range(size)] + \
            [bounds[-1]]


def _owner(layout: NodeLayout, node: int, chunk: int) -> int:
    """The group rank on ``node`` that owns ``chunk``."""
    members = layout.nodes[node]
    local = 0
    while local + 1 < len(members) and layout.first_chunk(node, local + 1) <= chunk:
        local += 1
    return members[local]


def _subgroup(parent: Group, comm: MPI.Comm, members: tuple[int, ...]) -> Group:
    child = Group(comm, tuple(parent.world_ranks[r] for r in members))
    parent.children.append(child)
    return child


def hierarchy_for(group: Group, layout: NodeLayout) -> Hierarchy:
    """The communicators of ``layout`` on ``group``, built on first use (collective over
    the group: call it from a collective's data phase, after agreement)."""
    key = ("hierarchy", layout)
    hierarchy = group.state.get(key)
    if hierarchy is None:
        hierarchy = group.state[key] = Hierarchy(group, layout)
    return hierarchy
