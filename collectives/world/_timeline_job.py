"""One timeline file for a job started by a plain ``mpiexec``: the ranks' files merged.

With ``RINGTRAIN_TIMELINE=PATH`` (or ``HOROVOD_TIMELINE``) every rank writes its own file
(``timeline_format.rank_path``). Under ``ringtrain-run --timeline`` the launcher merges them
into ``PATH`` after the job; without it, rank 0 does, when ringtrain shuts down or the
process exits: every rank closes its file, the ranks wait for each other (at most
:data:`WAIT_SECONDS`, so a rank that died never holds the others' exit), and rank 0
merges the files into ``PATH`` and removes them.
"""

from __future__ import annotations

import atexit
import os
import time

from mpi4py import MPI

from ...common.timeline_format import merge_files, rank_path
from .. import timeline
from ..logs import LOGGER

WAIT_SECONDS = 10.0
"""How long ranks wait for each other before rank 0 merges what is there."""

_pending: str | None = None


def merge_at_exit(path: str) -> None:
    """Have the ranks' files of timeline ``path`` merged into it at :func:`finish` (called
    by ``shutdown``) or at exit, whichever comes first."""
    global _pending
    if _pending is None:
        atexit.register(finish)
    _pending = path


def finish() -> None:
    """Close this rank's timeline and, on rank 0, merge every rank's file (once)."""
    global _pending
    path, _pending = _pending, None
    if path is None or MPI.Is_finalized():
        return
    timeline.stop_timeline()
    world = MPI.COMM_WORLD
    arrived = world.Ibarrier()
    deadline = time.monotonic() + WAIT_SECONDS
    while not arrived.Test():
        if time.monotonic() > deadline:
            LOGGER.warning("timeline: not every rank closed its file within %.0f s; "
                           "merging what is there", WAIT_SECONDS)
            break
        time.sleep(0.001)
    if world.Get_rank() != 0:
        return
    files = [rank_path(path, rank, world.Get_size()) for rank in range(world.Get_size())]
    try:
        events, merged = merge_files(files, path, prefix="ringtrain")
    except OSError as error:
        LOGGER.warning("timeline: cannot write %s (%s); the ranks' files are kept", path,
                       error.strerror or error)
        return
    for file in merged:
        os.unlink(file)
    LOGGER.info("timeline of %d ranks written to %s (%d events)", len(merged), path, events)
