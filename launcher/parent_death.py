"""Tie a child process's life to its parent's (Linux ``prctl(PR_SET_PDEATHSIG)``)."""

from __future__ import annotations

import ctypes

_PR_SET_PDEATHSIG = 1

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:
    _libc = None


def signal_on_parent_death(signal_number: int) -> None:
    """In a child, before exec: receive ``signal_number`` when the parent dies.

    Does nothing where ``prctl`` is not available (not Linux).
    """
    if _libc is not None and hasattr(_libc, "prctl"):
        _libc.prctl(_PR_SET_PDEATHSIG, signal_number, 0, 0, 0)
