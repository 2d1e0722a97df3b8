"""Adasum: Horovod's adaptive summation, on ringtrain's core ``Adasum`` allreduce.

Two vectors combine as ``adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``
(a coefficient stays 1 when its vector is zero), the ranks' vectors in a binary tree:
ranks (0, 1), (2, 3), ... first, then those results pairwise, and so on; each tensor of
a grouped allreduce on its own. ringtrain reduces it by recursive vector halving, the
schedule of Horovod's CPU Adasum (see docs/collectives.md).

What Horovod refuses is refused here: integer tensors (ValueError, before anything is
sent), and for GPU tensors a number of nodes that is not a power of two
(NotImplementedError, Horovod's GPU rule). Like Horovod's CPU Adasum, CPU tensors take
any number of ranks; process sets are accepted. GPU tensors are combined in a host copy.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import collectives as rtc
from ._handles import launch


def check_adasum(tensors: list[torch.Tensor]) -> None:
    """Refuse what Horovod's Adasum refuses: non-floating tensors, and GPU tensors on a
    number of nodes that is not a power of two."""
    for tensor in tensors:
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"rank {rtc.rank()}: Adasum needs floating-point tensors, "
                             f"got {tensor.dtype}")
    nodes = rtc.size() // rtc.local_size()
    if any(t.device.type != "cpu" for t in tensors) and nodes & (nodes - 1):
        raise NotImplementedError("Running GPU Adasum with non-power of 2 nodes is not "
                                  "supported yet.")


def adasum_parts(tensors: list[torch.Tensor], in_place: bool, key: str | None,
                 prescale_factor: float, postscale_factor: float,
                 process_set: rtc.ProcessSet | None, asynchronous: bool,
                 grouped: bool) -> tuple[list[Any], Any]:
    """Start ringtrain's Adasum allreduce of ``tensors`` (one, or a group with
    ``grouped``), in place or into new tensors; the finish step gives the output (a
    list when ``grouped``)."""
    check_adasum(tensors)
    hosts = [t.detach().cpu() for t in tensors]
    if grouped:
        functions = (rtc.grouped_allreduce_, rtc.grouped_allreduce_async_) if in_place \
            else (rtc.grouped_allreduce, rtc.grouped_allreduce_async)
    else:
        functions = (rtc.allreduce_, rtc.allreduce_async_) if in_place \
            else (rtc.allreduce, rtc.allreduce_async)
    part = launch(asynchronous, *functions, hosts if grouped else hosts[0], op=rtc.Adasum,
                  name=key, prescale_factor=prescale_factor,
                  postscale_factor=postscale_factor, process_set=process_set)

    def finish(results: list[Any]) -> Any:
        reduced = list(results[0]) if grouped else [results[0]]
        outputs = []
        for tensor, result in zip(tensors, reduced):
            if in_place:
                if result.data_ptr() != tensor.data_ptr():  # combined in a host copy
                    with torch.no_grad():
                        tensor.copy_(result)
                outputs.append(tensor)
            else:
                outputs.append(result.to(tensor.device))
        return outputs if grouped else outputs[0]

    return [part], finish
