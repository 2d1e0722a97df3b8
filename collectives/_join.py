"""join: a rank out of data waits for the others, taking part in their allreduces with zeros.

A joined rank loops on rounds of the agreement (see :func:`._agreement.agree_joined`).
Each round meets the others' next call on all ranks: an allreduce (or grouped allreduce,
or a gradient bucket) is made again here with zeros of the agreed shapes and dtypes, so
its result on the other ranks is the sum over the ranks that still have data (an
Average still divides by the number of all ranks); a barrier is entered; any other
collective fails on the ranks that made it. The loop ends when every rank has joined.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels.compression import Compression
from .calls._allreduce_run import prepare, prepare_grouped
from .agreement._agreement import agree, agree_joined
from .agreement._call import Call
from .agreement._resolution import resolve
from .base._group import Group
from .calls._calls import execute
from .world._world import world

_COMPRESSORS = {c.name: c for c in (Compression.none, Compression.fp16, Compression.bf16)}


def join() -> int:
    """Wait until every rank has called ``join``; meanwhile take part in the others'
    allreduces with zeros.

    For uneven data: a rank that runs out of batches calls ``join()``; the ranks still
    training go on calling allreduce (directly or through a DistributedOptimizer), and
    this rank contributes zeros to each. Barriers work too. Other collectives (allgather,
    broadcast, ...) raise :class:`UsageError` on the ranks that call them while some rank
    has joined. Only collectives over all ranks (not process sets) see joined ranks.

    Returns:
        The rank that joined last, the same on every rank (the highest such rank when
        several joined in the same round).
    """
    group = world().group
    return execute("join", None, lambda: _wait_joined(group))


def _wait_joined(group: Group) -> int:
    rounds = 0
    while True:
        everyone = agree_joined(group, Call(collective="join", name=None, rounds=rounds))
        if everyone is None:  # every rank joined in the same round
            return group.world_ranks[-1]
        outcome = resolve(everyone)
        if len(outcome.joined) == group.size:
            return _last_joined(group, everyone)
        if outcome.replay is not None:
            _replay(group, outcome.replay)
        rounds += 1


def _last_joined(group: Group, everyone: list[dict[str, Any]]) -> int:
    """The rank that spent fewest rounds joined (the highest of them on a tie)."""
    fewest = min(fields["rounds"] for fields in everyone)
    return max(group.world_ranks[r] for r, fields in enumerate(everyone)
               if fields["rounds"] == fewest)


def _replay(group: Group, fields: dict[str, Any]) -> None:
    """Make the call described by ``fields`` with zeros in place of this rank's data."""
    collective = fields["collective"]
    if collective == "barrier":
        agree(group, Call(collective="barrier", name=None))
        return
    compressor = _COMPRESSORS[fields["compression"]]
    zeros = _zeros_on_device if "memory" in fields else np.zeros
    if collective == "allreduce":
        prepare("allreduce_", zeros(fields["shape"], fields["dtype"]), fields["name"], None,
                fields["op"], 1.0, 1.0, fields["algorithm"], compressor)()
        return
    zeros_list = [zeros(shape, dtype) for shape, dtype in zip(fields["shape"], fields["dtype"])]
    algorithms = set(fields["algorithm"])
    algorithm = algorithms.pop() if len(algorithms) == 1 else None
    prepare_grouped("grouped_allreduce_", zeros_list, fields["name"], None, fields["op"], 1.0,
                    1.0, algorithm, compressor)()


def _zeros_on_device(shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """Zeros in GPU memory, for a call the others make on device tensors: it then travels
    the way theirs does (through host memory in the same segments, or to MPI directly)."""
    from ..kernels import device
    with device.on_device(world().gpu.device or 0):
        return device.zeros(None, shape, dtype)
