"""The rule that turns measured speeds into integer shares of a global batch.

Given each rank's seconds per sample ``t_r`` (0: no measurement), the shares in use, the
global batch ``B``, the smallest share ``m`` and each rank's cap ``c_r`` (None: none):

1. **Speeds.** ``v_r = 1 / t_r``; a rank without a measurement is taken to be as fast as
   the median of the measured ranks (when no rank measured anything the shares stay).
2. **Proportional shares.** ``x_r = clip(λ·v_r, m, c_r)`` with the ``λ`` that makes them
   sum to ``B`` (water-filling: a rank held at its cap or at ``m`` leaves the rest to
   the others, in proportion to their speeds). Unclipped, ``x_r = B·v_r / Σv``: every
   rank then needs ``x_r·t_r = B / Σv`` seconds, the same time.
3. **Integers.** ``floor(x_r)``, and the samples left over go one each to the ranks with
   the largest fractional parts (ties: the lower rank first), never past a cap.
4. **Hysteresis.** A split's predicted step time is ``max_r s_r·t_r`` (the slowest rank
   sets the pace). The shares move only when the proportional ones predict a step at
   least ``hysteresis`` (a fraction) shorter than the shares in use; otherwise they
   stay, so noise in the measurements does not move samples back and forth.
5. **Part of the way.** When they move, they move the fraction ``correction`` of the way
   from the shares in use to the proportional ones (``s + correction·(x - s)``, made
   integers as in 3; all the way when that rounds to the shares in use), so a
   measurement that was off moves them only part of the way, and fixed costs per step
   (which make a rank with fewer samples look slower per sample) do not make them
   overshoot. The fixed point is the same: equal step times on every rank.

Every rank computes the same shares from the same numbers: the arithmetic is IEEE 754
double precision on Python floats, in a fixed order (sums by :func:`math.fsum`, which
rounds once), with no library whose summation order could depend on the machine.

Importing this module imports neither mpi4py nor numpy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["balanced_shares", "predicted_step_seconds", "proportional_shares",
           "split_batch"]


def proportional_shares(speeds: Sequence[float], total: int, *, min_share: int = 1,
                        caps: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """Integer shares of ``total`` in proportion to ``speeds``, within the bounds.

    Args:
        speeds: one positive number per rank (samples per second, or any weights).
        total: what the shares sum to.
        min_share: the least any rank gets (0 or more).
        caps: the most each rank may get (None: no cap), or None for no caps at all.

    Returns:
        One share per rank, summing to ``total``, each in ``[min_share, cap]``.

    Raises:
        ValueError: no ranks, a speed that is not a positive finite number, a cap below
            ``min_share``, or bounds that no split of ``total`` meets.
    """
    size = len(speeds)
    caps = [None] * size if caps is None else list(caps)
    _check_bounds(size, total, min_share, caps)
    for speed in speeds:
        if not (isinstance(speed, (int, float)) and math.isfinite(speed) and speed > 0):
            raise ValueError(f"speeds must be positive finite numbers, got {list(speeds)}")
    return _rounded(_real_shares(speeds, total, min_share, caps), total, min_share, caps)


def balanced_shares(seconds_per_sample: Sequence[float], current: Sequence[int],
                    global_batch_size: int, *, min_share: int = 1,
                    caps: Sequence[int | None] | None = None,
                    hysteresis: float = 0.05, correction: float = 1.0) -> tuple[int, ...]:
    """The shares the ranks should take next, from their measured seconds per sample.

    Args:
        seconds_per_sample: each rank's measured compute time per sample; 0 (or any
            value that is not a positive finite number) for a rank without a measurement.
        current: the shares in use (one per rank).
        global_batch_size: what the shares sum to.
        min_share: the least any rank gets (1 or more in training).
        caps: each rank's largest share (None: no cap), or None for no caps.
        hysteresis: the fraction by which the predicted step time must fall for the
            shares to change (0: change whenever the split differs; infinity: never,
            unless the shares in use do not fit the bounds).
        correction: the fraction of the way from ``current`` to the proportional shares
            that a change moves, in (0, 1].

    Returns:
        The new shares, or ``tuple(current)`` when they stay (see the module's rule).
        Shares in use that do not fit the bounds (another sum, a share past a cap) are
        replaced whatever the hysteresis.

    Raises:
        ValueError: a length that differs from ``current``'s, a negative hysteresis, a
            correction outside (0, 1], or bounds that no split meets.
    """
    size = len(current)
    if len(seconds_per_sample) != size:
        raise ValueError(f"{len(seconds_per_sample)} measurements for {size} shares")
    if not hysteresis >= 0:  # infinity keeps the shares (unless they do not fit)
        raise ValueError(f"hysteresis must be a number >= 0, got {hysteresis!r}")
    if not 0 < correction <= 1:
        raise ValueError(f"correction must be in (0, 1], got {correction!r}")
    caps = [None] * size if caps is None else list(caps)
    _check_bounds(size, global_batch_size, min_share, caps)
    current = tuple(int(s) for s in current)
    measured = [float(t) if _is_measurement(t) else 0.0 for t in seconds_per_sample]
    known = [1.0 / t for t in measured if t > 0]
    fits = sum(current) == global_batch_size and all(
        min_share <= s and (cap is None or s <= cap) for s, cap in zip(current, caps))
    if not known:
        if fits:
            return current
        return proportional_shares([1.0] * size, global_batch_size, min_share=min_share,
                                   caps=caps)
    typical = statistics.median(known)
    speeds = [1.0 / t if t > 0 else typical for t in measured]
    real = _real_shares(speeds, global_batch_size, min_share, caps)
    proposed = _rounded(real, global_batch_size, min_share, caps)
    if not fits:
        return proposed
    seconds = [1.0 / v for v in speeds]
    before = predicted_step_seconds(current, seconds)
    if proposed == current or predicted_step_seconds(proposed, seconds) >= \
            before * (1.0 - hysteresis):
        return current
    # Part of the way: between two splits within the bounds, so within them too.
    partial = [s + correction * (x - s) for s, x in zip(current, real)]
    moved = _rounded(partial, global_batch_size, min_share, caps)
    return proposed if moved == current else moved


def predicted_step_seconds(shares: Sequence[int], seconds_per_sample: Sequence[float]) -> float:
    """The compute time of a step with ``shares``: the slowest rank's ``share × seconds
    per sample`` (the others wait for it)."""
    return max(s * t for s, t in zip(shares, seconds_per_sample))


def split_batch(count: int, shares: Sequence[int]) -> tuple[int, ...]:
    """Split a batch of ``count`` samples (at most ``sum(shares)``) in proportion to
    ``shares``: each rank at most its share, and at least 1 when ``count`` allows one
    for every rank. Used for the last, smaller global batch of an epoch.

    Raises:
        ValueError: ``count`` outside ``[0, sum(shares)]``.
    """
    total = sum(shares)
    if not 0 <= count <= total:
        raise ValueError(f"cannot split {count} samples by shares {list(shares)}")
    if count == total:
        return tuple(shares)
    if count == 0:
        return (0,) * len(shares)
    least = 1 if count >= len(shares) else 0
    return proportional_shares([float(s) for s in shares], count, min_share=least,
                               caps=list(shares))


def _real_shares(speeds: Sequence[float], total: int, min_share: int,
                 caps: list[int | None]) -> list[float]:
    """Step 2 of the rule: real shares in proportion to ``speeds`` within the bounds."""
    low = [float(min_share)] * len(speeds)
    high = [math.inf if cap is None else float(cap) for cap in caps]
    scale = _water_level([float(v) for v in speeds], low, high, float(total))
    return [min(max(scale * v, lo), hi) for v, lo, hi in zip(speeds, low, high)]


def _is_measurement(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_bounds(size: int, total: int, min_share: int, caps: list[int | None]) -> None:
    if size < 1:
        raise ValueError("no ranks to share among")
    if len(caps) != size:
        raise ValueError(f"{len(caps)} caps for {size} ranks")
    if min_share < 0:
        raise ValueError(f"min_share must be >= 0, got {min_share}")
    for rank, cap in enumerate(caps):
        if cap is not None and cap < min_share:
            raise ValueError(f"rank {rank}'s cap {cap} is below the least share {min_share}")
    if size * min_share > total:
        raise ValueError(f"{total} samples cannot give {size} ranks at least {min_share} each")
    if all(cap is not None for cap in caps) and sum(caps) < total:  # type: ignore[arg-type]
        raise ValueError(f"the caps {caps} sum to {sum(caps)}, "  # type: ignore[arg-type]
                         f"less than the {total} samples to share")


def _water_level(speeds: list[float], low: list[float], high: list[float],
                 total: float) -> float:
    """The ``λ`` with ``Σ clip(λ·v_r, low_r, high_r) = total``.

    The sum is piecewise linear and non-decreasing in ``λ``, with a corner where a rank
    leaves its lower bound (``low_r/v_r``) or reaches its cap (``high_r/v_r``). Find the
    first corner where it reaches ``total`` and solve the linear piece before it.
    """
    corners = sorted({0.0, *(lo / v for lo, v in zip(low, speeds)),
                      *(hi / v for hi, v in zip(high, speeds) if math.isfinite(hi))})

    def filled(level: float) -> float:
        return math.fsum(min(max(level * v, lo), hi) for v, lo, hi in zip(speeds, low, high))

    previous, following = corners[0], None
    for corner in corners[1:]:
        if filled(corner) >= total:
            following = corner
            break
        previous = corner
    # The ranks between their bounds on this piece: judged at a point inside it, where
    # rounding cannot put a rank that leaves a bound at the corner on the wrong side.
    inside = 2.0 * previous + 1.0 if following is None else (previous + following) / 2.0
    slope = math.fsum(v for v, lo, hi in zip(speeds, low, high) if lo < inside * v < hi)
    if slope == 0.0:
        return previous
    return previous + (total - filled(previous)) / slope


def _rounded(real: list[float], total: int, min_share: int,
             caps: list[int | None]) -> tuple[int, ...]:
    """Integers near ``real`` that sum to ``total`` within the bounds: floors, then the
    samples left over one each by largest fractional part (ties: the lower rank)."""
    size = len(real)
    shares = [max(min_share, math.floor(x)) for x in real]
    shares = [s if cap is None else min(s, cap) for s, cap in zip(shares, caps)]
    by_fraction = sorted(range(size), key=lambda r: (-(real[r] - math.floor(real[r])), r))
    left = total - sum(shares)
    while left > 0:
        for rank in by_fraction:
            if left and (caps[rank] is None or shares[rank] < caps[rank]):
                shares[rank] += 1
                left -= 1
    while left < 0:  # floors above the real shares only through rounding of x itself
        for rank in reversed(by_fraction):
            if left and shares[rank] > min_share:
                shares[rank] -= 1
                left += 1
    return tuple(shares)
