"""Splitting a sequential model into pipeline stages: by the user's split points, or
automatically, balancing the layers' measured forward+backward time (or, without a
sample input, their parameter counts) across the stages.

The balanced split is the contiguous partition of the layers' costs into ``p`` parts
whose largest part is smallest (a step of the pipeline lasts as long as its slowest
stage), found exactly by dynamic programming over (layers, stages). Rank 0 measures
and decides; every rank uses its split, so the ranks never disagree on it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..collectives import broadcast_object, rank
from ..collectives.errors import InvalidArgumentError

TIMING_REPEATS = 3


def check_split_points(split_points: Sequence[int], layers: int, stages: int) -> list[int]:
    """``split_points`` (the index of the first layer of stages 1 to p-1), checked.

    Raises:
        InvalidArgumentError: not ``stages - 1`` strictly increasing points inside the
            model, or more stages than layers.
    """
    if stages > layers:
        raise InvalidArgumentError(
            f"pipeline: the model has {layers} layers; it cannot be split into {stages} "
            f"stages")
    points = [int(point) for point in split_points]
    bounds = [0, *points, layers]
    if len(points) != stages - 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise InvalidArgumentError(
            f"pipeline: split points {points} cannot split {layers} layers into {stages} "
            f"stages: give {stages - 1} strictly increasing indices between 1 and "
            f"{layers - 1}")
    return points


def balanced_split(costs: Sequence[float], stages: int) -> list[int]:
    """The split points of the contiguous partition of ``costs`` into ``stages`` parts
    whose largest part is smallest (ties: the earliest points)."""
    check_split_points(list(range(1, stages)), len(costs), stages)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    n = len(costs)
    # best[k][i]: the smallest largest part splitting the first i layers into k parts.
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                largest = max(best[k - 1][j], prefix[i] - prefix[j])
                if largest < best[k][i]:
                    best[k][i], cut[k][i] = largest, j
    points, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        points.append(i)
    return points[::-1]


def measured_costs(layers: Sequence[torch.nn.Module], sample: torch.Tensor) -> list[float]:
    """Each layer's forward+backward time in seconds (the median of a few runs), each
    layer fed the previous one's output for ``sample``."""
    costs = []
    inputs = sample.detach()
    for layer in layers:
        times = []
        for _ in range(TIMING_REPEATS):
            x = inputs.detach().requires_grad_(inputs.is_floating_point())
            start = time.perf_counter()
            y = layer(x)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(statistics.median(times))
        inputs = y.detach()
    return costs


def parameter_costs(layers: Sequence[torch.nn.Module]) -> list[float]:
    """Each layer's parameter count, plus one (layers without parameters still cost)."""
    return [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]


def automatic_split(layers: Sequence[torch.nn.Module], stages: int,
                    sample: Any = None) -> list[int]:
    """Split points balancing the layers' cost across ``stages``, decided by rank 0 and
    the same on every rank: measured time for ``sample`` (one micro-batch's input), or
    parameter counts without one. Collective over all ranks."""
    check_split_points(list(range(1, stages)), len(layers), stages)
    points = None
    if rank() == 0:
        costs = measured_costs(layers, sample) if sample is not None else \
            parameter_costs(layers)
        points = balanced_split(costs, stages)
    return broadcast_object(points, root_rank=0)
