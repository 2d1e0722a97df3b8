"""Pipeline schedules and splits, without MPI."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from ringtrain.pipeline import (balanced_split, bubble_fraction, parameter_costs,  # noqa: E402
                                peak_in_flight, schedule)
from ringtrain.trainer.pipeline_schedule import BACKWARD, FORWARD  # noqa: E402
from ringtrain.collectives.errors import InvalidArgumentError  # noqa: E402


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_every_micro_batch_forward_then_backward_once(kind):
    for stages, microbatches in itertools.product(range(1, 6), range(1, 9)):
        for stage in range(stages):
            passes = schedule(kind, stage, stages, microbatches)
            assert sorted(passes) == sorted([(FORWARD, m) for m in range(microbatches)]
                                            + [(BACKWARD, m) for m in range(microbatches)])
            forwards = [m for k, m in passes if k == FORWARD]
            backwards = [m for k, m in passes if k == BACKWARD]
            assert forwards == backwards == list(range(microbatches))
            for index, (k, m) in enumerate(passes):
                if k == BACKWARD:
                    assert (FORWARD, m) in passes[:index]


def test_activations_held():
    for stages, microbatches in itertools.product(range(1, 6), range(1, 9)):
        for stage in range(stages):
            assert peak_in_flight(schedule("gpipe", stage, stages, microbatches)) == \
                microbatches
            assert peak_in_flight(schedule("1f1b", stage, stages, microbatches)) == \
                min(stages - stage, microbatches)


def test_the_1f1b_order_of_a_middle_stage():
    assert schedule("1f1b", 1, 3, 4) == [
        (FORWARD, 0), (FORWARD, 1), (BACKWARD, 0), (FORWARD, 2), (BACKWARD, 1),
        (FORWARD, 3), (BACKWARD, 2), (BACKWARD, 3)]
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        schedule("zigzag", 0, 2, 2)


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)


def test_balanced_split_is_the_best_contiguous_partition():
    costs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]

    def largest_part(points) -> int:
        bounds = [0, *points, len(costs)]
        return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))

    for stages in range(1, len(costs) + 1):
        best = min(largest_part(cut)
                   for cut in itertools.combinations(range(1, len(costs)), stages - 1))
        assert largest_part(balanced_split(costs, stages)) == best, stages
    assert balanced_split([1, 1, 1, 5, 1, 1, 1], 3) == [3, 4]


def test_a_model_that_cannot_be_split():
    with pytest.raises(InvalidArgumentError, match="has 2 layers; it cannot be split into 3"):
        balanced_split([1, 2], 3)


def test_parameter_costs():
    layers = [torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)]
    assert parameter_costs(layers) == [17.0, 1.0, 11.0]
