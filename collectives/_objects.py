"""Python objects across ranks (pickled), and the barrier."""

from __future__ import annotations

import pickle
from itertools import accumulate
from typing import Any

import numpy as np

from .calls._allgather_run import gather_rows
from .calls._broadcast_run import broadcast_bytes
from .agreement._agreement import agree
from .agreement._call import Call
from .algorithms._selection import broadcast_algorithm
from .base._checks import root_in_group
from .calls._calls import execute
from .config import current_settings
from .world._process_sets import ProcessSet, resolve_group


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet | None = None) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (pickled on the root).

    Args:
        obj: any picklable object on the root; ignored elsewhere.
        root_rank: world rank of the sender.
        name: names the call in error messages.
        process_set: the ranks taking part (default: all).

    Returns:
        The root's object (the root gets ``obj`` itself, the others a copy).
    """
    group = resolve_group(process_set, "broadcast_object", name)
    root = root_in_group(group, root_rank, "broadcast_object", name)
    payload, pickling = _pickle(obj) if group.rank == root else (b"", "ok")
    call = Call(collective="broadcast_object", name=name, root_rank=int(root_rank),
                pickling=pickling)
    settings = current_settings()

    def run() -> Any:
        agree(group, call)
        if group.size == 1:
            return obj
        length = np.array([len(payload)], np.int64)
        broadcast_bytes(group, length.view(np.uint8), root, "binomial", settings.segment_bytes)
        data = np.frombuffer(payload, np.uint8).copy() if group.rank == root \
            else np.empty(int(length[0]), np.uint8)
        algorithm = broadcast_algorithm(None, data.nbytes, group.size, settings, name)
        broadcast_bytes(group, data, root, algorithm, settings.segment_bytes)
        return obj if group.rank == root else pickle.loads(data.tobytes())

    return execute("broadcast_object", name, run)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet | None = None) -> list[Any]:
    """Return the list of every rank's ``obj``, in rank order (pickled).

    Args:
        obj: any picklable object.
        name: names the call in error messages.
        process_set: the ranks taking part (default: all).
    """
    group = resolve_group(process_set, "allgather_object", name)
    mine, pickling = _pickle(obj)
    call = Call(collective="allgather_object", name=name, pickling=pickling)

    def run() -> list[Any]:
        agree(group, call)
        data, counts = gather_rows(group, np.frombuffer(mine, np.uint8), (), "ring")
        offsets = [0, *accumulate(counts.tolist())]
        return [pickle.loads(data[offsets[r]:offsets[r + 1]].tobytes())
                for r in range(group.size)]

    return execute("allgather_object", name, run)


def _pickle(obj: Any) -> tuple[bytes, str]:
    """Pickle ``obj``; a failure becomes part of the call, so every rank raises, none hangs."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), "ok"
    except Exception as error:  # whatever pickling raises, the other ranks must hear of it
        return b"", f"failed ({type(error).__name__}: {error})"


def barrier(process_set: ProcessSet | None = None) -> None:
    """Return once every rank of the process set has called ``barrier``.

    Args:
        process_set: the ranks taking part (default: all).
    """
    group = resolve_group(process_set, "barrier", None)
    call = Call(collective="barrier", name=None)
    execute("barrier", None, lambda: agree(group, call))


def end_of_sequence(name: str, process_set: ProcessSet | None = None) -> None:
    """A last call every rank makes after a run of collectives whose length could differ.

    A rank that made one call more than another meets this one there instead, so every
    rank raises a MismatchError naming the extra call (a barrier would wait for it).
    """
    group = resolve_group(process_set, "end of " + name, None)
    call = Call(collective="end of " + name, name=None)
    execute("end of " + name, None, lambda: agree(group, call))
