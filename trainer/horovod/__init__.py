"""Horovod's PyTorch API (``horovod.torch``) on ringtrain: change the import line and run.

``import ringtrain.horovod as hvd`` gives the names a Horovod script uses, with Horovod's
signatures, defaults and return types. Each one translates its arguments and calls
ringtrain's own collectives or trainer; nothing here is a second implementation.
What maps one to one, what differs and what is not supported: docs/horovod.md.
"""

from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (Adasum, Average, HorovodInternalError, Max, Min, Product, ProcessSet,
                      Sum, add_process_set, allgather, allgather_async, allreduce, allreduce_,
                      allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                      broadcast, broadcast_, broadcast_async, broadcast_async_, ccl_built,
                      cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled,
                      global_process_set, grouped_allgather, grouped_allgather_async,
                      grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, init, is_initialized, join, local_rank,
                      local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built,
                      poll, rank, reducescatter, reducescatter_async, remove_process_set,
                      rocm_built, shutdown, size, sparse_allreduce_async, start_timeline,
                      stop_timeline, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "mpi_threads_supported", "mpi_enabled", "mpi_built",
    "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
    "rocm_built", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
    "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_async", "broadcast_", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "barrier", "poll", "synchronize",
    "Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state",
    "broadcast_parameters", "DistributedOptimizer", "SyncBatchNorm",
]
