"""ringtrain.kvstore: MXNet's KVStore over ringtrain, with parameter servers.

``kv = ringtrain.kvstore.create("dist_sync")``; ``kv.init(key, value)``,
``kv.push(key, grad)``, ``kv.pull(key, out=weight)``. The modes: ``local`` and
``device`` (one process), ``dist_sync``, ``dist_device_sync`` and ``horovod`` (every
worker holds every key; pushes summed with ringtrain's allreduce), ``dist_async`` and
``dist_device_async`` (server ranks hold the keys and apply each push as it arrives).
See docs/kvstore.md.
"""

from . import optimizer
from ._create import MODES, create, server_count
from ._store import KVStore

__all__ = ["KVStore", "MODES", "create", "optimizer", "server_count"]
