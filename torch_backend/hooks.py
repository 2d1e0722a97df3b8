"""DDP communication hooks that average each gradient bucket with ringtrain's compression.

::

    model = DistributedDataParallel(model)
    model.register_comm_hook(None, ringtrain.torch.fp16_hook)   # or bf16_hook

Unlike torch's ``fp16_compress_hook`` (a plain cast), :func:`fp16_hook` scales each
bucket by a power of two chosen from the largest magnitude over all ranks before the
cast, so that the sum cannot overflow float16 and small gradients are not flushed to
zero (see :mod:`ringtrain.kernels.compression`); the bucket travels and is summed as
16-bit values and arrives as float32 again, averaged. Buckets of other dtypes travel as
they are. The hooks run on groups of the ``"ringtrain"`` backend only.
"""

# No ``from __future__ import annotations``: DDP checks a hook's annotations as objects.
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import Average, Compression, Compressor, allreduce_async_
from .process_group import process_set_of


def fp16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks, sent as scaled float16.

    Args:
        state: the process group to average over (``None``: the default group), as
            ``register_comm_hook(state, hook)`` passes it.
        bucket: DDP's gradient bucket.

    Returns:
        A future completed with the averaged bucket.

    Raises:
        ValueError: ``state`` is a process group of another backend.
    """
    return _averaged(state, bucket, Compression.fp16)


def bf16_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the ranks, sent as bfloat16 (see :func:`fp16_hook`)."""
    return _averaged(state, bucket, Compression.bf16)


def _averaged(state: Any, bucket: dist.GradBucket,
              compression: Compressor) -> torch.futures.Future[torch.Tensor]:
    process_set = process_set_of(state)
    tensor = bucket.buffer()
    handle = allreduce_async_(tensor, op=Average, name=f"DDP bucket {bucket.index()}",
                              process_set=process_set, compression=compression)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def settle(done: Any) -> None:
        error = done.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(tensor)

    handle.add_done_callback(settle)
    return future
