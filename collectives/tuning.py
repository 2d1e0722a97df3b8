"""Tuning tables: which algorithm ``auto`` picks, per collective and message size.

A table maps, for each collective, ascending size ranges to an algorithm. A *tuned*
table is measured on the job's own ranks by ``ringtrain-bench --tune`` and saved as JSON
(see docs/collectives.md); it is keyed by the MPI library, the node layout and the
world size, and holds one set of ranges per group size measured. Without one (or for a
group size it lacks, or a size beyond its ranges) ``auto`` follows the *built-in* table
of :func:`default_ranges`, made of the same ranges, so both are looked up by the one
:func:`pick`.

The file format (``ringtrain-tuning/1``)::

    {"format": "ringtrain-tuning/1",
     "key": {"mpi_library": "MPICH Version: 5.0.2", "nodes": 1, "ranks_per_node": 2,
             "world_size": 2},
     "command": "ringtrain-bench --tune -e 64M",
     "groups": {"2": {"allreduce": [{"max_bytes": 4096, "algorithm": "recursive_doubling",
                                     "segment_bytes": 262144},
                                    {"max_bytes": 67108864, "algorithm": "native"}],
                      "broadcast": [...], ...}}}

A range covers the sizes above the previous range's ``max_bytes`` up to its own
(inclusive; ``null``: no bound, last range only). ``segment_bytes`` is the segment size
the range was measured with (ringtrain's algorithms only). Sizes follow nccl-tests:
the whole buffer of an allreduce or broadcast, the whole gathered output of an
allgather, the whole input of a reducescatter, one rank's whole send buffer of an
alltoall.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from ..common.environment import ALGORITHMS
from .config import Settings

__all__ = ["FORMAT", "Range", "TableError", "TuningKey", "TuningTable", "default_ranges",
           "install", "installed", "parse_table", "pick"]

FORMAT = "ringtrain-tuning/1"
"""The ``format`` field of a tuning file this version reads and writes."""

TUNABLE = ("allreduce", "broadcast", "allgather", "reducescatter", "alltoall")
"""The collectives a table covers."""

SMALL_MESSAGE_BYTES = 4096
"""Up to this size the built-in table keeps ringtrain's own algorithms (the small-message
path, whose cost is the agreement check)."""

CARRIED_BROADCAST_MAX_BYTES = 128 * 1024
"""Up to this size (what the agreement's messages carry) the built-in table's broadcast
over a power of two of ranks (4 or more) rides in the agreement: through the node's
mailboxes that is faster than MPI's own from 8 KiB up to it at 4 ranks on one node,
where the check followed by MPI's own costs a synchronisation of every rank
(docs/lab/2026-11-28-riding-in-the-agreement.md); where the ranks span nodes or their
messages do not pass through shared memory, ``auto`` takes MPI's own above
:data:`SMALL_MESSAGE_BYTES` (see :mod:`._selection`)."""

PAIR_CARRIED_BROADCAST_MAX_BYTES = 16 * 1024
""":data:`CARRIED_BROADCAST_MAX_BYTES` for 2 ranks, where MPI's own broadcast copies once,
from the root's buffer, and riding copies twice through a mailbox: above 16 KiB riding is
fast or slow with where the two cores lie, at times far behind the check followed by
MPI's own, whose speed does not swing so; up to 16 KiB the worst case of either is near
the other's (docs/lab/2026-11-28-broadcast-out-of-place-and-riding-on-two-ranks.md)."""

FOLDED_CARRIED_BROADCAST_MAX_BYTES = 16 * 1024
""":data:`CARRIED_BROADCAST_MAX_BYTES` for other numbers of ranks, whose fold adds two
hops to the bytes' way (at 3 ranks, in place, riding was slower than MPI's own from
32 KiB)."""

CARRIED_ALLGATHER_MAX_BYTES = 64 * 1024
"""Up to this size (the gathered output) the built-in table's allgather rides in the
agreement: through the node's mailboxes, each message carrying the rows its sender has
gathered so far, it is about as fast as MPI's own allgather alone, and well ahead of the
check followed by MPI's own, at 2, 3 and 4 ranks on one node
(docs/lab/2026-11-28-riding-in-the-agreement.md)."""

CARRIED_REDUCESCATTER_MAX_BYTES = 32 * 1024
"""Up to this size the built-in table's reducescatter over 3 or more ranks rides in the
agreement, and takes the ring above (checked and run in one compiled call); over 2 ranks
the ring takes over above :data:`PAIR_CARRIED_REDUCESCATTER_MAX_BYTES`. Both beat MPI's
own reduce-scatter behind the check, which the table took before from 4 to 64 KiB, on
one node: riding about as fast as MPI's own alone at 3 and 4 ranks up to 32 KiB, the ring
faster than MPI's own alone at 2 ranks from 16 KiB
(docs/lab/2026-11-28-riding-in-the-agreement.md)."""

PAIR_CARRIED_REDUCESCATTER_MAX_BYTES = 16 * 1024
""":data:`CARRIED_REDUCESCATTER_MAX_BYTES` for 2 ranks: up to 16 KiB riding's worst case is
better than the ring's, above it the ring is faster
(docs/lab/2026-11-28-broadcast-out-of-place-and-riding-on-two-ranks.md)."""

PAIRWISE_ALLTOALL_MAX_BYTES = 64 * 1024
"""Up to this size (one rank's send buffer) the built-in table's alltoall over 2 ranks
above :data:`SMALL_MESSAGE_BYTES` takes the pairwise exchange, which passes the blocks
through the node's mailboxes, checked and run in one compiled call; MPI's own above.
Up to this size the exchange is faster than MPI's own alltoall behind the check, which
the table took before; above it the mailboxes' two copies of each block are as fast as
MPI's single copy in some phases of a machine and several times slower in others
(docs/lab/2026-11-28-allgather-and-alltoall-through-the-mailboxes.md). Where the ranks
span nodes or their messages do not pass through shared memory, ``auto`` takes MPI's own
instead (see :mod:`._selection`)."""

WIDE_PAIRWISE_ALLTOALL_MAX_BYTES = 128 * 1024
""":data:`PAIRWISE_ALLTOALL_MAX_BYTES` over 3 or more ranks, where MPI's own alltoall
takes more steps too."""

PAIRWISE_ALLGATHER_MAX_BYTES = 512 * 1024
"""Up to this size (the gathered output) the built-in table's allgather over 2 ranks
above :data:`CARRIED_ALLGATHER_MAX_BYTES` takes the pairwise exchange through the node's
mailboxes, as alltoall does (see :data:`PAIRWISE_ALLTOALL_MAX_BYTES`); MPI's own above.
On one node up to this size the exchange is at or above MPI's own allgather alone, and
ahead of MPI's own behind the check; beyond it MPI's own is faster
(docs/lab/2026-11-28-allgather-and-alltoall-through-the-mailboxes.md)."""

WIDE_PAIRWISE_ALLGATHER_MAX_BYTES = 1024 * 1024
""":data:`PAIRWISE_ALLGATHER_MAX_BYTES` over 3 or more ranks, where MPI's own allgather
takes more steps too: up to 1 MiB the exchange stays ahead of MPI's own behind the check
(the same lab note)."""

_NOT_TABULATED = ("auto", "ipc")


class TableError(ValueError):
    """A tuning table that cannot be used: the message says why."""


@dataclasses.dataclass(frozen=True)
class Range:
    """Sizes up to ``max_bytes`` (inclusive; None: any) use ``algorithm``.

    Attributes:
        segment_bytes: the segment size the range was measured with (None: not
            recorded, or MPI's own algorithm).
    """

    max_bytes: int | None
    algorithm: str
    segment_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The range as a JSON object."""
        entry: dict[str, Any] = {"max_bytes": self.max_bytes, "algorithm": self.algorithm}
        if self.segment_bytes is not None:
            entry["segment_bytes"] = self.segment_bytes
        return entry


@dataclasses.dataclass(frozen=True)
class TuningKey:
    """What a tuned table is valid for.

    Attributes:
        mpi_library: the first line of ``MPI.Get_library_version()``.
        nodes: the number of nodes of the world.
        ranks_per_node: ranks on each node (one number when every node has as many).
        world_size: the number of ranks.
    """

    mpi_library: str
    nodes: int
    ranks_per_node: int | tuple[int, ...]
    world_size: int

    def to_json(self) -> dict[str, Any]:
        """The key as a JSON object."""
        ranks = self.ranks_per_node
        return {"mpi_library": self.mpi_library, "nodes": self.nodes,
                "ranks_per_node": list(ranks) if isinstance(ranks, tuple) else ranks,
                "world_size": self.world_size}

    def differences(self, other: TuningKey) -> list[str]:
        """``"field: mine vs other's"`` for each field that differs."""
        return [f"{field.name} {getattr(other, field.name)!r}, this job "
                f"{getattr(self, field.name)!r}"
                for field in dataclasses.fields(self)
                if getattr(self, field.name) != getattr(other, field.name)]


def key_of(mpi_library: str, node_keys: Sequence[int]) -> TuningKey:
    """The key of a job whose ranks are on the nodes ``node_keys`` (for each rank, a
    number naming its node, such as the lowest rank there)."""
    sizes = tuple(Counter(node_keys).values())
    ranks = sizes[0] if len(set(sizes)) == 1 else sizes
    return TuningKey(mpi_library.strip(), len(sizes), ranks, len(node_keys))


@dataclasses.dataclass(frozen=True)
class TuningTable:
    """A tuned table.

    Attributes:
        key: the job it was measured on.
        groups: for each group size measured, each collective's ranges.
        command: the command that measured it.
    """

    key: TuningKey
    groups: Mapping[int, Mapping[str, tuple[Range, ...]]]
    command: str = ""

    def ranges(self, collective: str, group_size: int) -> tuple[Range, ...]:
        """The ranges of ``collective`` for a group of ``group_size`` ranks (none when the
        table has no entry for that size or collective)."""
        return self.groups.get(group_size, {}).get(collective, ())

    def to_json(self) -> dict[str, Any]:
        """The table as the JSON document of a tuning file."""
        return {"format": FORMAT, "key": self.key.to_json(), "command": self.command,
                "groups": {str(size): {collective: [r.to_json() for r in ranges]
                                       for collective, ranges in by_collective.items()}
                           for size, by_collective in sorted(self.groups.items())}}

    def dumps(self) -> str:
        """The tuning file's text: JSON, one line per collective's ranges."""
        document = self.to_json()
        groups = ",\n".join(
            f"  {json.dumps(size)}: {{\n" + ",\n".join(
                f"   {json.dumps(collective)}: {json.dumps(ranges)}"
                for collective, ranges in by_collective.items()) + "\n  }"
            for size, by_collective in document.pop("groups").items())
        head = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in document.items())
        return f"{{\n{head},\n \"groups\": {{\n{groups}\n }}\n}}\n"


def pick(ranges: Sequence[Range], nbytes: int) -> Range | None:
    """The first range holding ``nbytes``; None beyond the last one."""
    for entry in ranges:
        if entry.max_bytes is None or nbytes <= entry.max_bytes:
            return entry
    return None


def default_ranges(collective: str, group_size: int, settings: Settings) -> tuple[Range, ...]:
    """The built-in table: ``auto``'s choice without a tuned table.

    Allreduce: recursive doubling up to ``recursive_doubling_max_bytes``, the ring above
    (checked and run in one compiled call, it is faster than MPI's own from 256 KiB at 2,
    3 and 4 ranks on one node: docs/lab/2026-11-26-the-ring-in-compiled-code.md).
    The other collectives: up to :data:`SMALL_MESSAGE_BYTES` ``recursive_doubling``, the
    data in the agreement's own messages (broadcast up to :data:`CARRIED_BROADCAST_MAX_BYTES`,
    :data:`PAIR_CARRIED_BROADCAST_MAX_BYTES` or :data:`FOLDED_CARRIED_BROADCAST_MAX_BYTES`,
    but the binomial tree or the pipeline up to :data:`SMALL_MESSAGE_BYTES` where
    ``broadcast_pipeline_min_bytes`` is set below it; allgather up to
    :data:`CARRIED_ALLGATHER_MAX_BYTES`, reducescatter up to
    :data:`CARRIED_REDUCESCATTER_MAX_BYTES` or :data:`PAIR_CARRIED_REDUCESCATTER_MAX_BYTES`);
    MPI's own above, which was measured faster on one node, but for reducescatters, which
    take the ring as allreduces do, and allgathers and alltoalls up to
    :data:`PAIRWISE_ALLGATHER_MAX_BYTES` and :data:`PAIRWISE_ALLTOALL_MAX_BYTES`
    (:data:`WIDE_PAIRWISE_ALLGATHER_MAX_BYTES`, :data:`WIDE_PAIRWISE_ALLTOALL_MAX_BYTES`
    over 3 or more ranks), which take the pairwise exchange. (Where the ranks span
    nodes, ``auto`` takes MPI's own instead of this table's allreduce ring, of riding
    above :data:`SMALL_MESSAGE_BYTES` and of the pairwise exchange: see
    :mod:`._selection`.)
    """
    own = SMALL_MESSAGE_BYTES
    if collective == "allreduce":
        return (Range(settings.recursive_doubling_max_bytes, "recursive_doubling"),
                Range(None, "ring"))
    if collective == "broadcast":
        start = settings.broadcast_pipeline_min_bytes
        if group_size <= 2 or start > own:
            carried = PAIR_CARRIED_BROADCAST_MAX_BYTES if group_size == 2 else \
                CARRIED_BROADCAST_MAX_BYTES if group_size & (group_size - 1) == 0 else \
                FOLDED_CARRIED_BROADCAST_MAX_BYTES
            return (Range(carried, "recursive_doubling"), Range(None, "native"))
        tree = (Range(start - 1, "binomial"),) if start > 0 else ()
        return (*tree, Range(own, "pipeline"), Range(None, "native"))
    if collective == "reducescatter":
        carried = PAIR_CARRIED_REDUCESCATTER_MAX_BYTES if group_size <= 2 else \
            CARRIED_REDUCESCATTER_MAX_BYTES
        return (Range(carried, "recursive_doubling"), Range(None, "ring"))
    if collective == "allgather":
        pairwise = PAIRWISE_ALLGATHER_MAX_BYTES if group_size <= 2 else \
            WIDE_PAIRWISE_ALLGATHER_MAX_BYTES
        return (Range(CARRIED_ALLGATHER_MAX_BYTES, "recursive_doubling"),
                Range(pairwise, "pairwise"), Range(None, "native"))
    pairwise = PAIRWISE_ALLTOALL_MAX_BYTES if group_size <= 2 else \
        WIDE_PAIRWISE_ALLTOALL_MAX_BYTES
    return (Range(own, "recursive_doubling"), Range(pairwise, "pairwise"),
            Range(None, "native"))


# --------------------------------------------------------------------------- the file

def parse_table(text: str | bytes) -> TuningTable:
    """The table in a tuning file's text.

    Raises:
        TableError: not JSON, another format, or a field missing or wrong (the message
            names it).
    """
    try:
        document = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise TableError(f"not JSON: {error}") from None
    if not isinstance(document, dict):
        raise TableError("not a JSON object")
    if document.get("format") != FORMAT:
        raise TableError(f"format {document.get('format')!r}, expected {FORMAT!r}")
    return TuningTable(_parse_key(document.get("key")), _parse_groups(document.get("groups")),
                       str(document.get("command", "")))


def _parse_key(key: Any) -> TuningKey:
    if not isinstance(key, dict):
        raise TableError("'key' is not an object")
    library = key.get("mpi_library")
    if not isinstance(library, str):
        raise TableError("key.mpi_library is not a string")
    nodes, world_size = (_whole(key.get(f), f"key.{f}", 1) for f in ("nodes", "world_size"))
    ranks = key.get("ranks_per_node")
    if isinstance(ranks, list):
        ranks = tuple(_whole(r, "key.ranks_per_node", 1) for r in ranks)
    else:
        ranks = _whole(ranks, "key.ranks_per_node", 1)
    return TuningKey(library, nodes, ranks, world_size)


def _parse_groups(groups: Any) -> dict[int, dict[str, tuple[Range, ...]]]:
    if not isinstance(groups, dict):
        raise TableError("'groups' is not an object")
    parsed: dict[int, dict[str, tuple[Range, ...]]] = {}
    for size_text, by_collective in groups.items():
        if not str(size_text).isdigit() or int(size_text) < 1:
            raise TableError(f"group size {size_text!r} is not a whole number >= 1")
        if not isinstance(by_collective, dict):
            raise TableError(f"groups.{size_text} is not an object")
        parsed[int(size_text)] = {
            collective: _parse_ranges(collective, ranges, f"groups.{size_text}.{collective}")
            for collective, ranges in by_collective.items()}
    return parsed


def _parse_ranges(collective: str, ranges: Any, where: str) -> tuple[Range, ...]:
    if collective not in TUNABLE:
        raise TableError(f"{where}: unknown collective; one of {', '.join(TUNABLE)}")
    if not isinstance(ranges, list):
        raise TableError(f"{where} is not a list")
    allowed = tuple(a for a in ALGORITHMS[collective] if a not in _NOT_TABULATED)
    parsed, previous = [], -1
    for index, entry in enumerate(ranges):
        at = f"{where}[{index}]"
        if not isinstance(entry, dict):
            raise TableError(f"{at} is not an object")
        if entry.get("algorithm") not in allowed:
            raise TableError(f"{at}: algorithm {entry.get('algorithm')!r} is not one of "
                             f"{', '.join(allowed)}")
        bound = entry.get("max_bytes")
        if bound is None:
            if index != len(ranges) - 1:
                raise TableError(f"{at}: only the last range may have max_bytes null")
        elif _whole(bound, f"{at}.max_bytes", 0) <= previous:
            raise TableError(f"{at}: max_bytes {bound} does not exceed the previous range's")
        segment = entry.get("segment_bytes")
        if segment is not None:
            _whole(segment, f"{at}.segment_bytes", 1)
        parsed.append(Range(bound, entry["algorithm"], segment))
        previous = -1 if bound is None else bound
    return tuple(parsed)


def _whole(value: Any, field: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TableError(f"{field} is {value!r}, not a whole number >= {least}")
    return value


def digest(data: bytes) -> str:
    """What ranks compare of the tuning files they read: a hash of the bytes."""
    return hashlib.sha256(data).hexdigest()[:16]


# --------------------------------------------------------------------------- in force

_installed: TuningTable | None = None


def install(table: TuningTable | None) -> None:
    """Make ``table`` the one ``auto`` follows in this process (None: the built-in one).
    ``ringtrain.init`` installs the tuned table every rank loaded, ``shutdown`` removes
    it; all ranks must have the same one (init checks that)."""
    global _installed
    _installed = table


def installed() -> TuningTable | None:
    """The tuned table in force, or None."""
    return _installed


def choose(collective: str, nbytes: int, group_size: int, settings: Settings) -> str:
    """``auto``'s algorithm for ``nbytes`` of ``collective`` on ``group_size`` ranks: the
    tuned table's where it has a range for them, else the built-in table's."""
    tuned = tuned_choice(collective, nbytes, group_size)
    if tuned is not None:
        return tuned
    return default_choice(collective, nbytes, group_size, settings)


def tuned_choice(collective: str, nbytes: int, group_size: int) -> str | None:
    """The tuned table's algorithm, or None where it has none."""
    found = None if _installed is None else \
        pick(_installed.ranges(collective, group_size), nbytes)
    return None if found is None else found.algorithm


def default_choice(collective: str, nbytes: int, group_size: int, settings: Settings) -> str:
    """The built-in table's algorithm."""
    found = pick(default_ranges(collective, group_size, settings), nbytes)
    assert found is not None, "the built-in table's last range has no bound"
    return found.algorithm
