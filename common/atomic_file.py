"""Writing a file so that a reader sees the old one or the new one, never a part.

Standard library only: the launcher, the collectives and the trainer all use it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def write_atomically(path: str, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Put ``data`` at ``path`` so that a reader sees the old file or the new, never part.

    The bytes (or what ``data(file)`` writes) go to a temporary file in the same
    directory, which is flushed, synced and renamed onto ``path`` (``os.replace``, atomic
    on POSIX); then the directory is synced, so the rename survives a crash of the
    machine too.

    Raises:
        OSError: the file cannot be written; ``path`` is left as it was and the
            temporary file is removed.
    """
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.",
                                             suffix=".tmp", dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    directory_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_descriptor)
    finally:
        os.close(directory_descriptor)
