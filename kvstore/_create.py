"""``create(name)``: the store of a mode, and how many ranks serve in the async modes."""

from __future__ import annotations

import sys

from ringtrain.common.environment import KV_BIGARRAY_BOUND, KV_SERVERS

from ..collectives import InvalidArgumentError
from ._store import KVStore, LocalStore

LOCAL_MODES = ("local", "device")
SYNC_MODES = ("dist_sync", "dist_device_sync", "horovod")
ASYNC_MODES = ("dist_async", "dist_device_async")
MODES = LOCAL_MODES + SYNC_MODES + ASYNC_MODES
"""Every name :func:`create` takes."""


def server_count(num_servers: int | None = None) -> int:
    """How many ranks serve in an async mode: ``num_servers``, else
    ``RINGTRAIN_KV_SERVERS`` (``ringtrain-run --servers K``), else 1."""
    count = num_servers if num_servers is not None else KV_SERVERS.read()
    count = 1 if count is None else count
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"kvstore create: the number of servers must be an int "
                                   f">= 1, got {count!r}")
    return count


def create(name: str = "local", *, num_servers: int | None = None,
           bigarray_bound: int | None = None, exit_server: bool = True) -> KVStore | None:
    """The store of mode ``name`` (MXNet's ``mx.kv.create``).

    In the distributed modes every rank of the job calls ``create``. In the async modes
    the last ``num_servers`` ranks serve: there ``create`` serves the keys until every
    worker has closed its store, then exits the process (status 0), so that one script
    is both worker and server; with ``exit_server=False`` it returns None instead.

    Args:
        name: one of :data:`MODES`.
        num_servers: async modes: how many ranks serve (see :func:`server_count`).
        bigarray_bound: async modes: values of more elements than this are split across
            all servers (default ``RINGTRAIN_KV_BIGARRAY_BOUND``, 1,000,000 as MXNet's
            ``MXNET_KVSTORE_BIGARRAY_BOUND``).
        exit_server: on a server rank, exit the process when serving is done.

    Raises:
        InvalidArgumentError: an unknown mode (the message lists them), a bad number of
            servers, or as many servers as ranks.
    """
    if name not in MODES:
        raise InvalidArgumentError(f"kvstore create: unknown mode {name!r}; the modes are "
                                   f"{', '.join(MODES)}")
    if name in LOCAL_MODES:
        return LocalStore(name)
    if name in SYNC_MODES:
        from ._sync import SyncStore
        return SyncStore(name)
    from ._async import AsyncStore, open_async
    bound = KV_BIGARRAY_BOUND.read() if bigarray_bound is None else int(bigarray_bound)
    store = open_async(name, server_count(num_servers), bound)
    if isinstance(store, AsyncStore):
        return store
    if exit_server:
        sys.exit(0)
    return None
