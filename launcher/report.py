"""How each rank ended, sent from its supervisor to the launcher, and said in words.

A supervisor writes one record line to its stderr when its command has ended; the
stream reaches the launcher through ``mpiexec`` on every vendor and every node, so no
other channel is needed. The launcher takes the record lines out of the output and
names the first rank that failed.
"""

from __future__ import annotations

import dataclasses
import json
import signal

RECORD_TAG = b"@ringtrain-rank-exit "


@dataclasses.dataclass(frozen=True)
class RankExit:
    """How one rank's command ended.

    Attributes:
        rank: the rank (None when its MPI did not say).
        returncode: the exit code, or minus the signal number that killed it.
        exception: ``"ValueError: message"`` when an unhandled exception ended it.
    """

    rank: int | None
    returncode: int
    exception: str | None = None

    @property
    def failed(self) -> bool:
        """Whether the command exited with a non-zero code or was killed."""
        return self.returncode != 0

    @property
    def exit_code(self) -> int:
        """The exit code a shell would show: ``128 + N`` for a command killed by signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode


def signal_name(number: int) -> str:
    """``9 -> "SIGKILL"``; ``"unknown signal"`` for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def describe_exit(returncode: int) -> str:
    """``"was killed by signal 9 (SIGKILL)"`` or ``"exited with code 3"``."""
    if returncode < 0:
        return f"was killed by signal {-returncode} ({signal_name(-returncode)})"
    return f"exited with code {returncode}"


def describe(record: RankExit) -> str:
    """One sentence on how a rank ended, e.g. ``rank 1 was killed by signal 9 (SIGKILL)``."""
    who = "a rank" if record.rank is None else f"rank {record.rank}"
    if record.exception is not None:
        return (f"{who} raised {record.exception} (its traceback is above) and "
                f"{describe_exit(record.returncode)}")
    return f"{who} {describe_exit(record.returncode)}"


def encode(record: RankExit) -> bytes:
    """The record as one line, tag first, for the supervisor's stderr."""
    payload = {"rank": record.rank, "returncode": record.returncode,
               "exception": record.exception}
    return RECORD_TAG + json.dumps(payload).encode() + b"\n"


def decode(line: bytes) -> RankExit | None:
    """The record in a line written by :func:`encode`, or None if it holds none."""
    if not line.startswith(RECORD_TAG):
        return None
    try:
        payload = json.loads(line[len(RECORD_TAG):])
        rank, returncode = payload["rank"], payload["returncode"]
        exception = payload.get("exception")
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(returncode, int) or not (rank is None or isinstance(rank, int)):
        return None
    return RankExit(rank, returncode, exception if isinstance(exception, str) else None)
