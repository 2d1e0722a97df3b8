"""Merging the ranks' timelines into one trace, and where each rank writes its own.

Every rank of a job started with ``ringtrain-run --timeline PATH`` writes its own Chrome
trace-event file (:mod:`ringtrain.collectives.timeline`), named by :func:`rank_path`:
``PATH`` itself in a one-rank job, else ``<root>.rank<R><ext>`` (``t.json`` ->
``t.rank0.json``, ``t.rank1.json``, ...). When the job has ended the launcher merges
them into ``PATH`` and removes them; by hand::

    python -m ringtrain.launcher.timeline_merge OUT.json t.rank0.json t.rank1.json ...

The events keep their process id, which is the rank, so each rank is one process in the
viewer. Each rank counts time from the start of its own timeline; the merge shifts every
rank's events by the difference between its start and the earliest one (the wall-clock
start each file records in ``otherData.start_unix_us``), so the ranks line up (to the
precision of the hosts' clocks when they run on several hosts).

A rank's file is valid JSON at every moment, so the file of a rank that was killed is
merged with the events it had written. A file that is missing, empty or not a trace is
skipped with a warning line on stderr.

Standard library only: the launcher imports this module. The file format, the naming
rule and the merge, which the ranks share (they merge under a plain ``mpiexec``), are in
:mod:`ringtrain.common.timeline_format`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ..common.timeline_format import MERGE_PROG as PROG
from ..common.timeline_format import TIMELINE_VARIABLE, merge, merge_files, rank_path, read_trace

__all__ = ["TIMELINE_VARIABLE", "rank_path", "merge", "merge_files", "JobTimeline", "main"]


def _identity(path: str) -> tuple[int, int, int] | None:
    """What tells a file rewritten from the one there before: inode, size, modification."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_ino, status.st_size, status.st_mtime_ns


class JobTimeline:
    """The launcher's side of ``--timeline PATH``: clear the ranks' files before every start
    of the job, merge the last start's files into ``PATH`` after it.

    Args:
        path: the trace to write; made absolute (it is also what the ranks are given).
        prefix: what the warning lines start with.
    """

    def __init__(self, path: str, prefix: str = "ringtrain-run") -> None:
        self.path = os.path.abspath(path)
        self.prefix = prefix
        self.size: int | None = None
        self._sizes: set[int] = set()
        self._before = _identity(self.path)

    def before_start(self, size: int) -> None:
        """Before a start of ``size`` ranks: remove the per-rank files of earlier starts (and
        runs), so that only this start's files are merged."""
        self.size = size
        self._sizes.add(size)
        for earlier in self._sizes:
            for file in self.rank_files(earlier):
                try:
                    os.unlink(file)
                except FileNotFoundError:
                    pass

    def rank_files(self, size: int) -> list[str]:
        """The ranks' files of a start of ``size`` ranks (none with one rank: it writes
        ``path`` itself)."""
        return [] if size < 2 else [rank_path(self.path, rank, size) for rank in range(size)]

    def collect(self) -> str | None:
        """Merge the last start's files into ``path``, remove them, and return the
        launcher's line about it (without the ``ringtrain-run:`` prefix); None when the job
        was never started, or when this was done already.

        Raises:
            OSError: ``path`` cannot be written (the ranks' files are then kept).
        """
        size, self.size = self.size, None
        if size is None:
            return None
        if size == 1:
            if _identity(self.path) == self._before:
                return f"no timeline written: the rank wrote none to {self.path}"
            try:
                events, _ = read_trace(self.path)
            except (OSError, ValueError) as error:
                return f"the timeline {self.path} cannot be read: {error}"
            return f"timeline of 1 rank written to {self.path} ({len(events)} events)"
        files = self.rank_files(size)
        if not any(os.path.exists(file) for file in files):
            return f"no timeline written: no rank wrote its file ({files[0]}, ...)"
        events, merged = merge_files(files, self.path, self.prefix)
        for file in files:
            try:
                os.unlink(file)
            except FileNotFoundError:
                pass
        ranks = f"{size} ranks" if len(merged) == size \
            else f"{len(merged)} of {size} ranks"
        return f"timeline of {ranks} written to {self.path} ({events} events)"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ringtrain.launcher.timeline_merge OUT IN...``; returns the exit code."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) < 2 or arguments[0] in ("-h", "--help"):
        print(f"usage: {PROG} OUT IN...\n\nMerge the per-rank timeline files IN... of a "
              "ringtrain job into the one trace OUT.", file=sys.stderr)
        return 0 if arguments[:1] in (["-h"], ["--help"]) else 2
    out_path, rank_files = arguments[0], arguments[1:]
    try:
        events, merged = merge_files(rank_files, out_path)
    except OSError as error:
        print(f"{PROG}: error: cannot write {out_path}: {error.strerror or error}",
              file=sys.stderr)
        return 1
    print(f"{PROG}: {len(merged)} of {len(rank_files)} files merged into {out_path} "
          f"({events} events)", file=sys.stderr)
    return 0 if merged else 1


if __name__ == "__main__":
    sys.exit(main())
