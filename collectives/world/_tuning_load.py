"""Loading the tuning table at ``init``: every rank reads the file itself, the ranks
compare what they read, and all of them use it or none.

Each rank reads the file at :func:`~ringtrain.common.environment.tuning_file` and says what it
found (a digest of the bytes, ``missing`` or ``unreadable``) in the one allgather that
``init`` makes anyway. Ranks that found different things get a
:class:`~ringtrain.MismatchError` naming them and their paths. When all found the same
file, each parses it alike: a malformed file, or one tuned for another job (another MPI
library, node layout or world size), is ignored with one RuntimeWarning on every rank,
and all use the built-in table.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from mpi4py import MPI

from ...common.environment import TUNING_FILE, tuning_file
from ..errors import MismatchError
from ..logs import LOGGER
from ..tuning import TableError, TuningKey, TuningTable, digest, install, key_of, parse_table

MISSING = "missing"

HINT = (f"Every rank must find the same tuning file: copy it to every node, point "
        f"{TUNING_FILE.name} at one they share, or set {TUNING_FILE.name} empty to use "
        f"none.")


@dataclasses.dataclass(frozen=True)
class Found:
    """What one rank found at its tuning path.

    Attributes:
        path: where it looked (None: tables are switched off).
        identity: ``sha256 <digest>`` of the file, ``missing`` or ``unreadable (why)``.
        data: the file's bytes (None when there are none to read).
    """

    path: str | None
    identity: str
    data: bytes | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def exchanged(self) -> tuple[str | None, str]:
        """What the ranks exchange of it."""
        return self.path, self.identity


def job_key(node_keys: Sequence[int]) -> TuningKey:
    """This job's key: the MPI library loaded, and each rank's node (``node_keys``)."""
    return key_of(MPI.Get_library_version().strip().splitlines()[0], node_keys)


def read_tuning_file() -> Found:
    """Read this rank's tuning file (no communication)."""
    path = tuning_file()
    if path is None:
        return Found(None, MISSING)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return Found(path, MISSING)
    except OSError as error:
        return Found(path, f"unreadable ({error.strerror or error})")
    return Found(path, f"sha256 {digest(data)}", data)


def agree_on_table(mine: Found, everyone: Sequence[tuple[str | None, str]],
                   key: TuningKey) -> TuningTable | None:
    """The table every rank uses, installed for ``auto`` (None: the built-in one).

    Args:
        mine: what this rank found.
        everyone: each rank's :attr:`Found.exchanged`, in rank order.
        key: this job's key.

    Raises:
        MismatchError: ranks found different files (or one found none); the same on
            every rank.
    """
    identities = {identity for _, identity in everyone}
    if len(identities) > 1:
        paths = {rank: path or f"none ({TUNING_FILE.name} empty)"
                 for rank, (path, _) in enumerate(everyone)}
        found = {rank: identity for rank, (_, identity) in enumerate(everyone)}
        raise MismatchError("init", None, {"tuning file": paths, "contents": found}, HINT)
    table = None
    if mine.data is not None:
        try:
            table = parse_table(mine.data)
        except TableError as error:
            _ignore(mine.path, f"malformed: {error}")
        else:
            differences = key.differences(table.key)
            if differences:
                _ignore(mine.path, "tuned for another job: " + "; ".join(differences))
                table = None
            else:
                LOGGER.info("tuning table from %s (%s)", mine.path, table.command or "?")
    elif mine.identity != MISSING:
        _ignore(mine.path, mine.identity)
    install(table)
    return table


def _ignore(path: str | None, why: str) -> None:
    warnings.warn(f"ignoring the tuning file {path}: {why}; auto uses the built-in table",
                  RuntimeWarning, stacklevel=2)
