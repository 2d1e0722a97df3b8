"""Collectives over MPI for host arrays and device tensors (torch, CuPy, numba):
ringtrain's own algorithms, Horovod's names; and point-to-point tensors checked by the
pair."""

from ..kernels.compression import (BF16Compressor, Compression, Compressor, FP16Compressor,
                                   NoneCompressor)
from ._allgather import allgather, allgather_async
from ._allreduce import (allreduce, allreduce_, allreduce_async, allreduce_async_,
                         grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                         grouped_allreduce_async_)
from ._alltoall import alltoall, alltoall_async
from ._broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
from ._join import join
from ._objects import allgather_object, barrier, broadcast_object
from ._point_to_point import (ANY_SOURCE, RecvOp, SendOp, batch_isend_irecv, irecv, isend, recv,
                              send, sendrecv)
from ._reducescatter import reducescatter, reducescatter_async
from .base._executor import Handle
from .base._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .calls._calls import poll, synchronize
from .config import ALGORITHMS, Settings, configure, current_settings
from .errors import (CommunicationError, InvalidArgumentError, MessageMismatchError, MismatchError,
                     NonFiniteWarning, NotInitializedError, RingtrainError, UnsupportedDtypeError,
                     UsageError)
from .logs import set_log_level
from .timeline import start_timeline, stop_timeline
from .world._process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .world._world import (cross_rank, cross_size, init, is_initialized, local_rank, local_size,
                           rank, shutdown, size)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size",
    "ProcessSet", "add_process_set", "remove_process_set", "global_process_set",
    "ReduceOp", "Average", "Sum", "Min", "Max", "Product", "Adasum",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "reducescatter", "reducescatter_async", "alltoall", "alltoall_async",
    "barrier", "broadcast_object", "allgather_object", "join",
    "send", "isend", "recv", "irecv", "sendrecv", "batch_isend_irecv", "SendOp", "RecvOp",
    "ANY_SOURCE",
    "Handle", "poll", "synchronize",
    "Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor",
    "Settings", "ALGORITHMS", "configure", "current_settings",
    "start_timeline", "stop_timeline", "set_log_level",
    "RingtrainError", "MismatchError", "InvalidArgumentError", "UnsupportedDtypeError",
    "CommunicationError", "NotInitializedError", "NonFiniteWarning", "UsageError",
    "MessageMismatchError",
]
