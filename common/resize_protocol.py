"""How ``ringtrain-run`` and the ranks agree on a resize: two files in the job's elastic
directory (``$RINGTRAIN_ELASTIC_DIR``).

1. While a job with a host discovery script runs, the launcher polls the script; when the
   hosts it offers give another placement than the job's, the launcher writes
   :data:`HOSTS_UPDATED` (and removes it if they change back before the job stops).
2. At every commit (``ringtrain.elastic.State.commit()``, or ``check_host_updates()``)
   rank 0 looks for that file; when it is there, every rank learns it, the commit is
   flushed to disk, rank 0 writes :data:`RESIZING`, and every rank exits with status 0.
3. The launcher, seeing :data:`RESIZING` after the job ended, removes both files and
   starts the job again on the new hosts, where it resumes from that commit. A resize is
   not a failure: it uses none of ``--max-restarts``.

Neither side imports the other: this module is all they share.
"""

from __future__ import annotations

import os

HOSTS_UPDATED = "hosts-updated"
"""Written by the launcher: the hosts changed; stop at the next commit."""

RESIZING = "resizing"
"""Written by rank 0: the job stopped at a commit to be started again on the new hosts."""


def path_in(directory: str | None, name: str) -> str | None:
    """``directory/name``, or None without a directory."""
    return None if not directory else os.path.join(directory, name)


def is_marked(directory: str | None, name: str) -> bool:
    """Whether the file ``name`` exists in ``directory``."""
    path = path_in(directory, name)
    return path is not None and os.path.exists(path)


def clear(directory: str | None, *names: str) -> None:
    """Remove the files ``names`` from ``directory`` (those that are there)."""
    for name in names:
        path = path_in(directory, name)
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
