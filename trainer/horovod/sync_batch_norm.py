"""Horovod's ``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

In training, each rank computes its per-channel count, mean and sum of squared
deviations, and one allgather gives every rank all of them; they combine into the
mean and variance of the global batch (the parallel form of Welford's method, in
float64). The backward pass needs two per-channel sums over the global batch, which
one allreduce provides. The weight and bias gradients stay local, as in Horovod: the
DistributedOptimizer averages them with the other gradients. Unlike Horovod's, this
one runs on CPU tensors as well as CUDA ones (the statistics travel through host memory).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ... import collectives


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` whose training statistics cover all ranks' batches.

    Args:
        num_features: the number of channels ``C`` of inputs shaped ``(N, C, ...)``.
        eps: added to the variance before its square root.
        momentum: the running statistics' update factor; ``None`` for a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics for evaluation; without them the
            batch statistics (over all ranks) are used in evaluation too.

    Every rank must call ``forward`` (and ``backward``) the same number of times: each
    training-mode call is a collective. A rank may bring an empty batch.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with the global batch's statistics (training) or the
        running ones (evaluation)."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        batch_statistics = self.training or self.running_mean is None
        if not batch_statistics or collectives.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, batch_statistics, factor, self.eps)
        update = self.training and self.running_mean is not None
        return _SyncBatchNorm.apply(input, self.weight, self.bias,
                                    self.running_mean if update else None,
                                    self.running_var if update else None, factor, self.eps)


class _SyncBatchNorm(torch.autograd.Function):
    """Batch normalization over the global batch, with its gradient."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, factor: float, eps: float) -> torch.Tensor:
        x = input.contiguous()
        channels = x.shape[1]
        local = _channels_last(x).double()
        count = local.shape[0]
        mean = local.mean(0) if count else local.new_zeros(channels)
        squares = ((local - mean) ** 2).sum(0)
        row = torch.cat([local.new_tensor([count]), mean, squares]).cpu().numpy()
        rows = collectives.allgather(row.reshape(1, -1), name="sync_batch_norm.statistics")
        counts, means, all_squares = rows[:, 0], rows[:, 1:1 + channels], rows[:, 1 + channels:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel when "
                             f"training over all ranks, got {int(total)}")
        global_mean = (counts[:, None] * means).sum(0) / total
        deviations = all_squares + counts[:, None] * (means - global_mean) ** 2
        squared = deviations.sum(0)
        device_mean = torch.from_numpy(global_mean).to(x.device)
        invstd = torch.from_numpy(1.0 / np.sqrt(squared / total + eps)).to(x.device)
        if running_mean is not None:
            unbiased = torch.from_numpy(squared / (total - 1)).to(x.device)
            running_mean.mul_(1 - factor).add_(factor * device_mean.to(running_mean.dtype))
            running_var.mul_(1 - factor).add_(factor * unbiased.to(running_var.dtype))
        ctx.save_for_backward(x, weight, device_mean, invstd)
        ctx.total = total
        return _affine(x, (device_mean, invstd), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        channels = x.shape[1]
        dy = _channels_last(grad_output.contiguous()).double()
        normalized = (_channels_last(x).double() - mean) * invstd
        sum_dy = dy.sum(0)
        sum_dy_normalized = (dy * normalized).sum(0)
        grad_input = None
        if ctx.needs_input_grad[0]:
            local = torch.cat([sum_dy, sum_dy_normalized]).cpu().numpy()
            total_sums = collectives.allreduce(local, op=collectives.Sum,
                                               name="sync_batch_norm.gradient_sums")
            sums = torch.from_numpy(total_sums).to(x.device)
            scale = invstd if weight is None else invstd * weight.double()
            flat = scale * (dy - sums[:channels] / ctx.total
                            - normalized * (sums[channels:] / ctx.total))
            grad_input = _from_channels_last(flat, x.shape).to(x.dtype)
        grad_weight = sum_dy_normalized.to(weight.dtype) \
            if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype) \
            if weight is not None and ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """``(N, C, ...)`` as rows of ``C`` values: ``(N * ..., C)``."""
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def _from_channels_last(rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of :func:`_channels_last`."""
    moved = (shape[0], *shape[2:], shape[1])
    return rows.reshape(moved).movedim(-1, 1).contiguous()


def _affine(x: torch.Tensor, statistics: tuple[torch.Tensor, torch.Tensor],
            weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``(x - mean) * invstd * weight + bias`` per channel, in ``x``'s dtype."""
    mean, invstd = statistics
    scale = invstd if weight is None else invstd * weight.double()
    shift = -mean * scale if bias is None else bias.double() - mean * scale
    view = (1, -1) + (1,) * (x.dim() - 2)
    return x * scale.to(x.dtype).view(view) + shift.to(x.dtype).view(view)
