"""Pipeline schedules: the order in which one stage runs its micro-batches' forward and
backward passes.

With ``p`` stages and ``m`` micro-batches, stage ``s`` (0 first):

- **GPipe** runs all ``m`` forwards, then all ``m`` backwards: it holds the activations
  of all ``m`` micro-batches at once::

      stage 0   F0 F1 F2 F3 .. .. .. .. .. .. B0 B1 B2 B3
      stage 1   .. F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3

- **1F1B** runs ``p - s - 1`` forwards to fill the pipeline (the warm-up), then
  alternates one forward and one backward, then drains the last backwards: stage ``s``
  holds at most ``p - s`` micro-batches' activations (never more than ``p``), whatever
  ``m`` is::

      stage 0   F0 F1 .. B0 F2 B1 F3 B2 .. B3
      stage 1   .. F0 F1 B0 F2 B1 F3 B2 B3

Both have the same idle time, the bubble: a fraction ``(p - 1) / (m + p - 1)`` of a
step (each stage waits ``p - 1`` slots of a forward plus a backward).
"""

from __future__ import annotations

from collections.abc import Iterator

SCHEDULES = ("gpipe", "1f1b")
FORWARD, BACKWARD = "forward", "backward"


def schedule(kind: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The passes stage ``stage`` runs, in order: ``(FORWARD or BACKWARD, micro-batch)``.

    Args:
        kind: ``"gpipe"`` or ``"1f1b"``.
        stage: this stage, from 0.
        stages: the number of stages.
        microbatches: the number of micro-batches of a step.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "gpipe":
        return [(FORWARD, m) for m in range(microbatches)] + \
            [(BACKWARD, m) for m in range(microbatches)]
    if kind == "1f1b":
        return list(_one_forward_one_backward(stage, stages, microbatches))
    raise ValueError(f"unknown pipeline schedule {kind!r}; choose one of {SCHEDULES}")


def _one_forward_one_backward(stage: int, stages: int,
                              microbatches: int) -> Iterator[tuple[str, int]]:
    warmup = min(stages - stage - 1, microbatches)
    forward = backward = 0
    for _ in range(warmup):
        yield FORWARD, forward
        forward += 1
    while forward < microbatches:
        yield FORWARD, forward
        forward += 1
        yield BACKWARD, backward
        backward += 1
    while backward < microbatches:
        yield BACKWARD, backward
        backward += 1


def peak_in_flight(passes: list[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage holds at once (forward done,
    backward not yet) under ``passes``."""
    held = peak = 0
    for kind, _ in passes:
        held += 1 if kind == FORWARD else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The model's idle share of a step: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)
