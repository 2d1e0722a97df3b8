"""ringtrain's log: the ``ringtrain`` logger of the standard :mod:`logging` module, with
the rank in every line.

``RINGTRAIN_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING`` (default), ``ERROR``) sets its
level when :func:`ringtrain.init` runs; :func:`set_log_level` changes it later. Unless the
application gave the logger handlers of its own, ringtrain adds one writing to stderr::

    r1 | WARNING | allreduce of tensor 'w' (call 12 on ranks 0-3) has waited 60 s ...

At ``DEBUG`` every collective logs one line when it ends (a per-call trace)::

    r0 | DEBUG | allreduce 'grad' 4096 B peers 3,1 ring 0.112 ms
    r2 | DEBUG | broadcast 'w' 80 B root 0 binomial 0.031 ms

(``peers``: the ranks this rank exchanges data with directly, ``MPI`` for the library's
own collectives; for broadcasts the root. The time includes waiting for the other
ranks.) Checking the level costs one attribute test per call when it is off.
"""

from __future__ import annotations

import logging
import sys

from ..common.environment import LOG_LEVEL, LOG_LEVELS, parse_log_level
from .base._activity import Entry

LOGGER = logging.getLogger("ringtrain")
LOG_LEVEL_VARIABLE = LOG_LEVEL.name
_LEVELS: dict[str, int] = {name: getattr(logging, name) for name in LOG_LEVELS}


class _RankFilter(logging.Filter):
    """Puts the rank into every record ringtrain logs (``%(rank)s``)."""

    def __init__(self) -> None:
        super().__init__()
        self.rank = "?"

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


_RANK_FILTER = _RankFilter()
_HANDLER = logging.StreamHandler(sys.stderr)
_HANDLER.setFormatter(logging.Formatter("r%(rank)s | %(levelname)s | %(message)s"))
LOGGER.addFilter(_RANK_FILTER)


def configure_logging(rank: int) -> None:
    """Tag records with ``rank``, apply ``RINGTRAIN_LOG_LEVEL`` and, unless the
    application configured the logger itself, write to stderr (called by ``init``)."""
    _RANK_FILTER.rank = str(rank)
    level = LOG_LEVEL.read()
    if level is not None:
        set_log_level(level)
    elif LOGGER.level == logging.NOTSET:
        LOGGER.setLevel(logging.WARNING)
    if not LOGGER.handlers:
        LOGGER.addHandler(_HANDLER)
        LOGGER.propagate = False


def set_log_level(level: str | int) -> None:
    """Set the level of ringtrain's log: a name (``"DEBUG"``, ...) or a number.

    Raises:
        ValueError: an unknown level name.
    """
    if isinstance(level, str):
        level = _LEVELS[parse_log_level(level)]
    LOGGER.setLevel(level)


def log_call(entry: Entry | None, rank: int, seconds: float) -> None:
    """The per-call DEBUG line for the collective ``entry`` (the last one agreed)."""
    if entry is None:
        return
    label = "(unnamed)" if entry.name is None else repr(entry.name)
    algorithm = entry.fields.get("algorithm") or "-"
    if isinstance(algorithm, tuple):
        algorithm = ",".join(sorted(set(algorithm)))
    root = entry.fields.get("root_rank")
    partners = f"root {root}" if root is not None else \
        f"peers {peers(algorithm, entry.world_ranks, rank)}"
    LOGGER.debug("%s %s %d B %s %s %.3f ms", entry.collective, label, entry.nbytes,
                 partners, algorithm, seconds * 1e3)


def peers(algorithm: str, world_ranks: tuple[int, ...], rank: int) -> str:
    """The ranks a rank exchanges data with directly under ``algorithm``."""
    size = len(world_ranks)
    if rank not in world_ranks or size == 1:
        return "-"
    if algorithm == "native":
        return "MPI"
    me = world_ranks.index(rank)
    if algorithm == "ring":
        return f"{world_ranks[(me - 1) % size]},{world_ranks[(me + 1) % size]}"
    if algorithm == "recursive_doubling":
        return ",".join(str(world_ranks[r]) for r in _doubling_partners(me, size))
    return "all"


def _doubling_partners(me: int, size: int) -> list[int]:
    """Group ranks ``me`` exchanges with in the recursive doubling of ``_recursive_doubling``."""
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    if me < 2 * rem and me % 2 == 0:
        return [me + 1]
    partners = [me - 1] if me < 2 * rem else []
    new_rank = me // 2 if me < 2 * rem else me - rem
    mask = 1
    while mask < p2:
        partner_new = new_rank ^ mask
        partners.append(partner_new * 2 + 1 if partner_new < rem else partner_new + rem)
        mask <<= 1
    return partners
