"""Horovod's PyTorch API (``horovod.torch``) on ringtrain: change the import line and run.

``import ringtrain.horovod as hvd`` gives the names a Horovod script uses, with Horovod's
signatures, defaults and return types. Each one translates its arguments and calls
ringtrain's own collectives or trainer; nothing here is a second implementation.
What maps one to one, what differs and what is not supported: docs/horovod.md.
"""

from . import elastic, mpi_ops
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import *  # noqa: F401,F403 (the names in mpi_ops.__all__)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    *(name for name in mpi_ops.__all__ if name != "Handle"),
    "Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "DistributedOptimizer", "SyncBatchNorm", "elastic",
]
