"""Dynamic loss scaling for mixed precision, with the overflow check agreed by every rank.

fp16 gradients underflow unless the loss is multiplied by a large factor before
backward; too large a factor overflows to inf. The scaler starts high, halves the factor
and skips the step whenever any gradient on any rank is inf or NaN, and doubles it after
``growth_interval`` clean steps. The skip decision is an allreduce of one flag, so an
overflow on one rank skips the step on all ranks and the models never diverge.

It works with fp16 compression: the reduction's own power-of-two scaling keeps even
large scaled gradients inside fp16's range on the wire. Gradients may be float32,
float64, float16 or bfloat16 (16-bit ones are checked in float32 and unscaled in their
own dtype, exactly: the scale is a power of two); with master weights the scaler sees,
and unscales, the float32 copies' gradients.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from ..collectives import Max, allreduce_
from ..collectives.engine import is_torch_tensor
from ..collectives.errors import InvalidArgumentError
from ..kernels import (BFLOAT16, abs_max, decode_bfloat, decode_half, empty_like,
                       is_floating, scale_into)
from ..kernels.dispatch import dtype_of

_NAME = "loss scaler: overflow"


class DynamicLossScaler:
    """Scales the loss, unscales the reduced gradients, skips steps that overflowed.

    Args:
        init_scale: the first scale factor.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps.
        backoff_factor: multiplies the scale after an overflow.
        growth_interval: clean steps between growths.
        min_scale: the scale never drops below this.

    Example::

        scaler = DynamicLossScaler()
        loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(optimizer)        # synchronize, unscale, step unless inf/NaN anywhere

    Raises:
        InvalidArgumentError: factors out of range.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0):
        if not init_scale > 0 or not growth_factor > 1 or not 0 < backoff_factor < 1 or \
                not growth_interval >= 1 or not min_scale > 0:
            raise InvalidArgumentError(
                f"need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                f"growth_interval >= 1, min_scale > 0; got {init_scale}, {growth_factor}, "
                f"{backoff_factor}, {growth_interval}, {min_scale}")
        self._scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self._clean_steps = 0
        self.skipped_steps = 0
        self._flag = np.empty(1, np.int64)

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by now."""
        return self._scale

    def scale(self, loss: Any) -> Any:
        """``loss`` times the current scale (a torch tensor, numpy value or float)."""
        return loss * self._scale

    def step(self, optimizer: Any) -> bool:
        """Synchronize ``optimizer``'s gradients, check them on every rank, then either
        unscale them and step, or skip the step and lower the scale.

        Args:
            optimizer: a DistributedOptimizer (PyTorch or arrays).

        Returns:
            True if the optimizer stepped, False if the step was skipped (the same on
            every rank).
        """
        optimizer.synchronize()
        gradients = optimizer.gradient_arrays()
        overflow = any(_nonfinite(g) for g in gradients if math.prod(g.shape))
        if self._agreed_overflow(overflow, optimizer.reducer.process_set):
            self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            self._clean_steps = 0
            self.skipped_steps += 1
            return False
        for gradient in gradients:
            _unscale(gradient, 1.0 / self._scale)
        with optimizer.skip_synchronize():
            optimizer.step()
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._scale *= self.growth_factor
            self._clean_steps = 0
        return True

    def _agreed_overflow(self, overflow: bool, process_set: Any) -> bool:
        self._flag[0] = int(overflow)
        allreduce_(self._flag, op=Max, name=_NAME, process_set=process_set)
        return bool(self._flag[0])

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints."""
        return {"scale": self._scale, "clean_steps": self._clean_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self._scale}, skipped_steps={self.skipped_steps})"


def _nonfinite(gradient: Any) -> bool:
    """Whether ``gradient`` (an array, or a torch CUDA tensor) holds inf or NaN."""
    if is_torch_tensor(gradient):
        return not bool(sys.modules["torch"].isfinite(gradient).all())
    dtype = dtype_of(gradient)
    if dtype in (np.float32, np.float64):
        return abs_max(gradient)[1]
    if dtype in (np.float16, BFLOAT16):
        wide = empty_like(gradient, np.float32)
        (decode_half if dtype == np.float16 else decode_bfloat)(gradient, wide)
        return abs_max(wide)[1]
    return False  # integers are always finite


def _unscale(gradient: Any, factor: float) -> None:
    """Multiply a floating ``gradient`` by ``factor`` in place."""
    if is_torch_tensor(gradient):
        if gradient.is_floating_point():
            gradient.mul_(factor)
    elif is_floating(dtype_of(gradient)):
        scale_into(gradient, factor, gradient)
