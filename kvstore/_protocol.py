"""The async modes' messages between workers and servers (MPI point-to-point).

Every request is a 4-int64 header ``[operation, key index, part, argument]`` sent with
tag ``REQUEST``; the server receives headers from any source, in arrival order, and
then the request's data from that source with tag ``DATA``. Replies go back with tag
``REPLY``. MPI keeps the messages of one sender to one receiver in order, so a worker's
pull always sees its own earlier pushes.

Why point-to-point and not one-sided (RMA): see docs/kvstore.md (measured with
benchmarks/kvstore_transport.py).
"""

from __future__ import annotations

import zlib

import numpy as np

REQUEST, DATA, REPLY = 11, 12, 13

INIT = 1           # data: (key, dtype, count) pickled, then the part's values; reply: None
PUSH = 2           # data: the part's values, or its 2-bit words (argument: the threshold)
PULL = 3           # reply: the part's values
SET_OPTIMIZER = 4  # data: the optimizer, pickled; reply: None
GET_STATES = 5     # reply: {(key index, part): state}, pickled
SET_STATES = 6     # data: the same; reply: None
STOP = 7           # the worker is done

NAMES = {INIT: "init", PUSH: "push", PULL: "pull", SET_OPTIMIZER: "set_optimizer",
         GET_STATES: "save_optimizer_states", SET_STATES: "load_optimizer_states",
         STOP: "close"}


def header(operation: int, key_index: int = 0, part: int = 0, argument: int = 0) -> np.ndarray:
    """A request's header."""
    return np.array([operation, key_index, part, argument], np.int64)


def threshold_argument(threshold: float) -> int:
    """A 2-bit threshold carried in a header's argument (its float64 bits; 0: uncompressed)."""
    return int(np.float64(threshold).view(np.int64))


def threshold_of(argument: int) -> float:
    """The inverse of :func:`threshold_argument`."""
    return float(np.int64(argument).view(np.float64))


def parts(key: object, count: int, num_servers: int, bound: int) -> list[tuple[int, int, int]]:
    """Where a key's ``count`` elements live: ``(server, start, stop)`` for each part.

    A value of more than ``bound`` elements is split into ``num_servers`` nearly equal
    parts, part ``i`` on server ``i`` (MXNet's big-array split); a smaller one lives
    whole on the server the key hashes to (ints: the key itself; strings: CRC-32).
    """
    if count > bound and num_servers > 1:
        edges = [count * i // num_servers for i in range(num_servers + 1)]
        return [(i, edges[i], edges[i + 1]) for i in range(num_servers)]
    code = key if isinstance(key, int) else zlib.crc32(str(key).encode())
    return [(code % num_servers, 0, count)]
