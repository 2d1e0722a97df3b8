"""What this rank's collectives are doing, for the stall inspector and the debug log.

The collectives thread writes it (:func:`entered` as a collective's agreement starts,
:func:`agreed` when every rank has joined it); a point-to-point wait sets
``point_to_point`` while it waits for its peer; the stall inspector's thread only reads
it. Writing costs a few attribute stores per collective.
"""

from __future__ import annotations

import math
from time import monotonic
from typing import Any

import numpy as np

Record = tuple[int, tuple[int, ...], dict[str, Any], float]
"""A collective entered, as written on every call: the fields of its :class:`Entry`,
in order."""


class Entry:
    """One collective this rank entered.

    Attributes:
        number: how many collectives this rank had entered on these ranks, this one
            included (1 for the first): the same on every rank for the same call.
        world_ranks: the ranks taking part.
        fields: everything the ranks compare (collective, name, dtype, shape, ...).
        started: ``time.monotonic()`` when this rank entered.
    """

    __slots__ = ("number", "world_ranks", "fields", "started")

    def __init__(self, number: int, world_ranks: tuple[int, ...], fields: dict[str, Any],
                 started: float):
        self.number = number
        self.world_ranks = world_ranks
        self.fields = fields
        self.started = started

    @property
    def collective(self) -> str:
        """e.g. ``"allreduce"``."""
        return self.fields.get("collective", "?")

    @property
    def name(self) -> str | None:
        """The tensor's name, or None."""
        return self.fields.get("name")

    def describe(self) -> str:
        """``"allreduce of tensor 'w' (call 12 on ranks 0-3)"``."""
        label = "(unnamed)" if self.name is None else repr(self.name)
        return (f"{self.collective} of tensor {label} "
                f"(call {self.number} on {_ranks(self.world_ranks)})")

    @property
    def nbytes(self) -> int:
        """Bytes of the call's array(s), from its shape and dtype fields (0 if none)."""
        shapes, dtypes = self.fields.get("shape"), self.fields.get("dtype")
        if shapes is None or dtypes is None:
            return 0
        if not isinstance(dtypes, tuple):
            shapes, dtypes = (shapes,), (dtypes,)
        return sum(math.prod(shape) * np.dtype(dtype).itemsize
                   for shape, dtype in zip(shapes, dtypes))


class PeerWait(Entry):
    """A point-to-point call this rank waits in: ``world_ranks`` are this rank and the
    peer it waits for."""

    __slots__ = ()

    def describe(self) -> str:
        """``"recv of tensor 'x' from rank 1 (tag 0)"``."""
        label = "(unnamed)" if self.name is None else repr(self.name)
        peer = "any rank" if self.fields["peer"] == "any" else f"rank {self.fields['peer']}"
        return (f"{self.collective} of tensor {label} {self.fields['direction']} {peer} "
                f"(tag {self.fields['tag']})")


class Activity:
    """The collective in progress (``current``), the last one agreed (``last``), both as
    :data:`Record` (:meth:`entry` reads one), and how many were entered on each set of
    ranks."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new ``init``: every rank starts counting again)."""
        self.current: Record | None = None
        self.point_to_point: PeerWait | None = None
        self.last: Record | None = None
        self.entered_on: dict[tuple[int, ...], int] = {}

    def enter(self, world_ranks: tuple[int, ...], fields: dict[str, Any]) -> None:
        """This rank starts a collective's agreement."""
        entered = self.entered_on
        number = entered[world_ranks] = entered.get(world_ranks, 0) + 1
        self.current = (number, world_ranks, fields, monotonic())

    def resume(self, record: Record | None) -> None:
        """The collective ``record`` is in progress again (a call ran inside its agreement)."""
        self.current = record

    def agreed(self) -> None:
        """Every rank has entered the collective in progress (or it failed)."""
        self.last, self.current = self.current, None

    def status(self, world_ranks: tuple[int, ...]) -> dict[str, Any]:
        """What this rank tells a stalled rank: its collective in progress, if any, and
        how many it has entered on ``world_ranks``."""
        current, last, peer = entry(self.current), entry(self.last), self.point_to_point
        now = monotonic()
        return {
            "point_to_point": None if peer is None else
            (peer.describe(), now - peer.started),
            "current": None if current is None else
            (current.describe(), current.world_ranks, current.number, now - current.started),
            "entered": self.entered_on.get(world_ranks, 0),
            "last": None if last is None else (last.describe(), now - last.started),
        }


ACTIVITY = Activity()


def entry(record: Record | None) -> Entry | None:
    """The :class:`Entry` of ``record`` (None for None)."""
    return None if record is None else Entry(*record)


def _ranks(world_ranks: tuple[int, ...]) -> str:
    if len(world_ranks) > 1 and world_ranks == tuple(range(world_ranks[0],
                                                           world_ranks[-1] + 1)):
        return f"ranks {world_ranks[0]}-{world_ranks[-1]}"
    return "ranks " + ",".join(map(str, world_ranks)) if len(world_ranks) != 1 \
        else f"rank {world_ranks[0]}"
