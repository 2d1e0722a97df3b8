"""The sparsity schedule of gradual magnitude pruning (Zhu & Gupta, 2017).

The target sparsity rises from ``initial_sparsity`` at ``begin_step`` to
``final_sparsity`` at ``end_step``, fast at first and slowly at the end, when the
network has fewer redundant weights left to lose::

    s(t) = s_f + (s_i - s_f) * (1 - (t - t0) / (t1 - t0)) ** exponent    for t0 <= t <= t1

with ``exponent`` 3 in the paper. Before ``t0`` nothing is pruned; after ``t1`` the
sparsity stays ``s_f``. The masks are recomputed every ``frequency`` steps from ``t0``
on, and at ``t1`` itself.
"""

from __future__ import annotations

import dataclasses

from ..collectives.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class GradualSchedule:
    """Target sparsity by training step: the polynomial schedule of gradual pruning.

    Attributes:
        final_sparsity: the fraction of weights pruned from ``end_step`` on, in [0, 1).
        begin_step: the first step at which masks are computed (0 is the first step).
        end_step: the step at which ``final_sparsity`` is reached (>= ``begin_step``).
        frequency: masks are recomputed every this many steps between the two.
        initial_sparsity: the sparsity at ``begin_step``.
        exponent: the polynomial's degree (3 in Zhu & Gupta).

    Raises:
        InvalidArgumentError: sparsities outside [0, 1), steps out of order, a frequency
            or exponent below 1.
    """

    final_sparsity: float
    begin_step: int
    end_step: int
    frequency: int = 1
    initial_sparsity: float = 0.0
    exponent: float = 3.0

    def __post_init__(self) -> None:
        for field in ("final_sparsity", "initial_sparsity"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                    not 0.0 <= value < 1.0:
                raise InvalidArgumentError(f"{field} must be a number in [0, 1), got {value!r}")
        if self.initial_sparsity > self.final_sparsity:
            raise InvalidArgumentError(
                f"initial_sparsity {self.initial_sparsity} is above final_sparsity "
                f"{self.final_sparsity}: pruned weights never come back")
        for field in ("begin_step", "end_step", "frequency"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{field} must be an integer >= 0, got {value!r}")
        if self.end_step < self.begin_step:
            raise InvalidArgumentError(
                f"end_step {self.end_step} is before begin_step {self.begin_step}")
        if self.frequency < 1:
            raise InvalidArgumentError(f"frequency must be >= 1, got {self.frequency}")
        if not isinstance(self.exponent, (int, float)) or self.exponent < 1:
            raise InvalidArgumentError(f"exponent must be a number >= 1, got {self.exponent!r}")

    def sparsity_at(self, step: int) -> float:
        """The target sparsity at ``step``: 0 before ``begin_step``, the formula between,
        ``final_sparsity`` after ``end_step``."""
        if step < self.begin_step:
            return 0.0
        if step >= self.end_step:
            return float(self.final_sparsity)
        progress = (step - self.begin_step) / (self.end_step - self.begin_step)
        return float(self.final_sparsity + (self.initial_sparsity - self.final_sparsity)
                     * (1.0 - progress) ** self.exponent)

    def prunes_at(self, step: int) -> bool:
        """Whether the masks are recomputed at ``step``: every ``frequency`` steps from
        ``begin_step``, and at ``end_step``."""
        if step < self.begin_step or step > self.end_step:
            return False
        return step == self.end_step or (step - self.begin_step) % self.frequency == 0
