"""Load balancing without MPI: the share rule, the schedule of shares over positions,
and the balanced sampler's coverage of every epoch (ranks simulated in one process)."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from ringtrain.collectives.errors import InvalidArgumentError
from ringtrain.trainer.balance import (_BATCHES_PER_STEP, _FIELDS, _FIRST_BATCH, _ITERATION,
                                       _NEXT_BATCH, _first_undealt, _relative_to_median)
from ringtrain.trainer.balance_schedule import BEFORE_ANY, ShareSchedule
from ringtrain.trainer.balance_shares import (balanced_shares, predicted_step_seconds,
                                              proportional_shares, split_batch)
from ringtrain.trainer.balanced_sampler import BalancedBatchSampler

SIZES = [1, 2, 3, 4, 7]


def random_measurements(generator: random.Random, size: int) -> list[float]:
    """Seconds per sample with ties, zeros (no measurement) and wide ranges."""
    choices = [0.0, 1e-3, 1e-3, 2e-3, 5e-4, 3.7e-3, 1e-6, 0.25]
    return [generator.choice(choices) if generator.random() < 0.5
            else generator.uniform(1e-5, 1e-2) for _ in range(size)]


# --------------------------------------------------------------------------- the rule

@pytest.mark.parametrize("size", SIZES)
def test_proportional_shares_keep_the_sum_and_the_bounds(size):
    generator = random.Random(size)
    for _ in range(300):
        total = generator.randint(size, 600)
        speeds = [generator.choice([1.0, 2.0, generator.uniform(0.01, 100)])
                  for _ in range(size)]
        caps = [generator.choice([None, None, generator.randint(1, total)])
                for _ in range(size)]
        if all(c is not None for c in caps) and sum(caps) < total:
            caps[0] = None
        shares = proportional_shares(speeds, total, caps=caps)
        assert sum(shares) == total
        assert all(s >= 1 for s in shares), shares
        assert all(c is None or s <= c for s, c in zip(shares, caps)), (shares, caps)
        # Unclipped ranks are within one sample of their proportional share of what
        # the clipped ones leave.
        free = [r for r in range(size) if shares[r] > 1 and (caps[r] is None or
                                                           shares[r] < caps[r])]
        if free:
            left = total - sum(shares[r] for r in range(size) if r not in free)
            for r in free:
                ideal = left * speeds[r] / sum(speeds[q] for q in free)
                assert abs(shares[r] - ideal) < 1.0 + 1e-9, (shares, speeds, caps)


def test_proportional_shares_examples():
    assert proportional_shares([1.0, 1.0], 256) == (128, 128)
    assert proportional_shares([2.0, 1.0], 256) == (171, 85)
    assert proportional_shares([1.0, 1.0, 1.0, 1.0], 10) == (3, 3, 2, 2)  # ties: lower rank
    assert proportional_shares([1.0, 1000.0], 10) == (1, 9)               # at least one
    assert proportional_shares([100.0, 1.0, 1.0], 10, caps=[5, None, None]) == (5, 3, 2)
    assert proportional_shares([1.0, 1.0], 7, min_share=0, caps=[0, None]) == (0, 7)


def test_proportional_shares_refuse_what_cannot_be_met():
    with pytest.raises(ValueError, match="cannot give 3 ranks"):
        proportional_shares([1.0] * 3, 2)
    with pytest.raises(ValueError, match="sum to 4"):
        proportional_shares([1.0, 1.0], 10, caps=[2, 2])
    with pytest.raises(ValueError, match="below the least share"):
        proportional_shares([1.0, 1.0], 10, caps=[0, None])
    with pytest.raises(ValueError, match="positive finite"):
        proportional_shares([1.0, 0.0], 10)


@pytest.mark.parametrize("size", SIZES)
def test_shares_are_a_function_of_the_numbers_alone(size):
    """Ties, zeros and any order of evaluation give the same shares: computed twice
    from the same inputs, and from inputs that went through float64 arrays (as they
    arrive from the allreduce), the results are identical."""
    generator = random.Random(100 + size)
    for _ in range(300):
        batch = generator.randint(size, 300)
        measured = random_measurements(generator, size)
        current = proportional_shares([1.0] * size, batch)
        first = balanced_shares(measured, current, batch)
        again = balanced_shares([float(x) for x in np.array(measured, np.float64)],
                                list(current), batch)
        assert first == again
        assert sum(first) == batch and min(first) >= 1


def test_shares_move_toward_the_measured_speeds():
    # Rank 1 takes twice as long per sample: it gets a third of the batch.
    assert balanced_shares([1e-3, 2e-3], [128, 128], 256) == (171, 85)
    assert balanced_shares([1e-3, 1e-3, 1e-3, 2e-3], [64] * 4, 256) == (73, 73, 73, 37)
    # 1.5x slower: 3/(3+2) of the batch on the fast rank.
    assert balanced_shares([1e-3, 1.5e-3], [50, 50], 100) == (60, 40)
    # From any start, one agreement reaches the split that evens out the step times.
    shares = balanced_shares([1e-3, 2e-3], [10, 246], 256)
    assert shares == (171, 85)
    seconds = [1e-3, 2e-3]
    assert predicted_step_seconds(shares, seconds) < predicted_step_seconds((128, 128),
                                                                            seconds)


@pytest.mark.parametrize("size", SIZES)
def test_even_ranks_stay_put_within_the_hysteresis(size):
    generator = random.Random(7 + size)
    batch = 64 * size
    current = proportional_shares([1.0] * size, batch)
    for _ in range(200):
        # Measurement noise of +-2% cannot predict a step 5% shorter.
        measured = [1e-3 * generator.uniform(0.98, 1.02) for _ in range(size)]
        assert balanced_shares(measured, current, batch, hysteresis=0.05) == current


def test_hysteresis_decides_between_a_small_gain_and_none():
    # Rank 1 8% slower: the best split predicts a step 3.8% shorter.
    measured = [1e-3, 1.08e-3]
    assert balanced_shares(measured, [50, 50], 100, hysteresis=0.05) == (50, 50)
    assert balanced_shares(measured, [50, 50], 100, hysteresis=0.02) == (52, 48)
    assert balanced_shares(measured, [50, 50], 100, hysteresis=0.0) == (52, 48)


def test_a_change_moves_part_of_the_way_and_settles_within_the_hysteresis():
    # Proportional: (170.7, 85.3); half of the way from (128, 128).
    assert balanced_shares([1e-3, 2e-3], [128, 128], 256, correction=0.5) == (149, 107)
    shares = (128, 128)
    for _ in range(8):
        shares = balanced_shares([1e-3, 2e-3], shares, 256, correction=0.5)
    # One more move would predict a step less than 5% shorter than (168, 88) gives.
    assert shares == (168, 88)
    # A gap that part of the way would not change is closed at once.
    assert balanced_shares([1e-3, 1.2e-3], [54, 46], 100, hysteresis=0.0,
                           correction=0.1) == (55, 45)
    with pytest.raises(ValueError, match="correction"):
        balanced_shares([1e-3, 1e-3], [5, 5], 10, correction=0.0)


def test_noise_follows_the_ranks_relative_speeds():
    # A busier machine slows every rank alike: the relative speeds do not change.
    assert _relative_to_median((1e-3, 2e-3, 0.0)) == (0.6666666666666666, 1.3333333333333333, 0.0)
    assert _relative_to_median((2e-3, 4e-3, 0.0)) == _relative_to_median((1e-3, 2e-3, 0.0))
    assert _relative_to_median((0.0, 0.0)) is None


def test_ranks_without_a_measurement():
    # A rank reporting zero is taken to be as fast as the median measured rank.
    assert balanced_shares([0.0, 2e-3, 1e-3], [4, 3, 3], 10) == (3, 2, 5)
    # Nobody measured: the shares stay; shares that do not fit are made even.
    assert balanced_shares([0.0, 0.0], [3, 7], 10) == (3, 7)
    assert balanced_shares([0.0, 0.0], [3, 3], 10) == (5, 5)
    # Not-a-number and infinities count as no measurement.
    assert balanced_shares([math.nan, math.inf], [3, 7], 10) == (3, 7)


def test_caps_hold_and_shares_past_a_cap_are_replaced():
    # Rank 0 is 10x faster but may take at most 30 samples.
    assert balanced_shares([1e-4, 1e-3], [50, 50], 100, caps=[30, None]) == (30, 70)
    # Shares in use past a cap move whatever the hysteresis.
    assert balanced_shares([1e-3, 1e-3], [60, 40], 100, caps=[50, None],
                           hysteresis=0.9) == (50, 50)


@pytest.mark.parametrize("size", SIZES)
def test_split_batch(size):
    generator = random.Random(size)
    for _ in range(200):
        shares = proportional_shares([generator.uniform(0.1, 10) for _ in range(size)],
                                     generator.randint(size, 200))
        count = generator.randint(0, sum(shares))
        counts = split_batch(count, shares)
        assert sum(counts) == count
        assert all(0 <= c <= s for c, s in zip(counts, shares))
        if count >= size:
            assert min(counts) >= 1
    assert split_batch(5, (171, 85)) == (3, 2)
    with pytest.raises(ValueError):
        split_batch(7, (3, 3))


# --------------------------------------------------------------------------- schedule

def test_schedule_ties_shares_to_positions():
    schedule = ShareSchedule((5, 5), rank=1)
    assert schedule.shares_at(BEFORE_ANY) == (5, 5)
    iteration = schedule.begin_iteration(0)
    for batch in range(3):
        assert schedule.draw(iteration, batch, lambda shares: shares) == (5, 5)
    assert schedule.drawn == (1, 3, 0)
    schedule.change((7, 3), (1, 3))
    assert schedule.shares_at((1, 2)) == (5, 5) and schedule.shares_at((1, 3)) == (7, 3)
    assert schedule.shares_at((2, 0)) == (7, 3)
    with pytest.raises(ValueError, match="decided"):
        schedule.change((2, 8), (1, 2))        # batch 2 was dealt already
    assert schedule.draw(iteration, 3, lambda shares: shares) == (7, 3)
    assert schedule.take(2) == (10, 20, 2)
    assert schedule.take(5) == (8, 20, 2)
    assert schedule.take(1) == (0, 0, 0)
    schedule.draw(iteration, 4, lambda shares: shares)
    schedule.begin_iteration(0)                # the untrained batch is dropped
    assert schedule.take(1) == (0, 0, 0)


def test_first_undealt_position_is_past_every_rank_and_on_a_step_boundary():
    def records(*ranks):
        return positions(ranks)

    assert _first_undealt(records((0, 0, 0, 1), (0, 0, 0, 1))) == BEFORE_ANY
    assert _first_undealt(records((2, 5, 0, 1), (2, 9, 0, 1))) == (2, 9)
    assert _first_undealt(records((3, 0, 0, 1), (2, 9, 0, 1))) == (3, 0)
    assert _first_undealt(records((2, 5, 0, 4), (2, 6, 0, 4))) == (2, 8)
    assert _first_undealt(records((2, 5, 1, 2), (2, 5, 1, 2))) == (2, 5)
    assert _first_undealt(records((2, 6, 1, 2), (2, 6, 1, 2))) == (2, 7)


# --------------------------------------------------------------------------- sampler

def positions(ranks) -> np.ndarray:
    """Agreement records holding each rank's (iteration, next batch, first batch,
    batches per step)."""
    records = np.zeros((len(ranks), _FIELDS))
    for row, values in zip(records, ranks):
        row[[_ITERATION, _NEXT_BATCH, _FIRST_BATCH, _BATCHES_PER_STEP]] = values
    return records


class Ranks:
    """N simulated ranks, each with its own schedule (as each process has its own), the
    shares changed alike on all of them as the agreement does."""

    def __init__(self, shares):
        self.balancers = [SimpleNamespace(global_batch_size=sum(shares),
                                          schedule=ShareSchedule(shares, rank))
                          for rank in range(len(shares))]

    def samplers(self, n, **options):
        return [BalancedBatchSampler(n, balancer, **options) for balancer in self.balancers]

    def change(self, shares):
        """New shares from the first position no rank has dealt (as the agreement says)."""
        start = _first_undealt(positions([(*b.schedule.drawn, 1) for b in self.balancers]))
        for balancer in self.balancers:
            balancer.schedule.change(shares, start)


def random_shares(generator, size, batch):
    return proportional_shares([generator.uniform(0.1, 10) for _ in range(size)], batch)


@pytest.mark.parametrize("size", SIZES)
def test_every_index_once_per_epoch_for_random_shares_changing_as_ranks_run_ahead(size):
    """Exact mode: each epoch deals every index exactly once across the ranks, while the
    shares change between batches and some ranks' samplers run several batches ahead
    of the others (a loader prefetching)."""
    generator = random.Random(size)
    for trial in range(12):
        batch = generator.randint(size, 40)
        n = generator.randint(0, 200)
        ranks = Ranks(random_shares(generator, size, batch))
        samplers = ranks.samplers(n, mode="exact", seed=trial)
        for epoch in range(3):
            for sampler in samplers:
                sampler.set_epoch(epoch)
            iterators = [iter(s) for s in samplers]
            dealt: list[list[int]] = [[] for _ in range(size)]
            running = set(range(size))
            while running:
                for rank in sorted(running):
                    for _ in range(generator.randint(0, 3)):   # uneven prefetching
                        batch_indices = next(iterators[rank], None)
                        if batch_indices is None:
                            running.discard(rank)
                            break
                        dealt[rank].extend(batch_indices)
                if generator.random() < 0.3:
                    ranks.change(random_shares(generator, size, batch))
            counts = Counter(i for indices in dealt for i in indices)
            assert sorted(counts) == list(range(n)) and set(counts.values()) <= {1}, \
                (trial, epoch, counts)


@pytest.mark.parametrize("mode", ["pad", "drop"])
@pytest.mark.parametrize("size", SIZES)
def test_pad_and_drop_deal_whole_global_batches(size, mode):
    generator = random.Random(size)
    for n in [0, 1, 5, 37, 100]:
        batch = generator.randint(size, 20)
        shares = random_shares(generator, size, batch)
        ranks = Ranks(shares)
        got = [list(s) for s in ranks.samplers(n, mode=mode)]
        batches = math.ceil(n / batch) if mode == "pad" else n // batch
        assert [len(g) for g in got] == [batches] * size
        assert all(len(b) == s for g, s in zip(got, shares) for b in g)
        counts = Counter(i for g in got for b in g for i in b)
        if mode == "drop":
            assert len(counts) == batches * batch and set(counts.values()) <= {1}
        else:
            assert set(counts) == set(range(n))
            assert sum(counts.values()) == batches * batch


def test_global_batches_do_not_depend_on_ranks_or_shares():
    """Global batch g holds the same indices whatever the number of ranks and shares,
    so an epoch resumed at a batch (after an elastic resize) deals exactly the rest."""
    n, batch, seed = 53, 8, 3
    whole = [sorted(i for b in batches for i in b)
             for batches in zip(*[list(s) for s in Ranks((batch,)).samplers(n, seed=seed,
                                                                             mode="exact")])]
    for shares in [(4, 4), (1, 7), (3, 2, 3), (2, 2, 2, 2)]:
        samplers = Ranks(shares).samplers(n, seed=seed, mode="exact")
        per_rank = [list(s) for s in samplers]
        for g in range(len(whole)):
            assert sorted(i for batches in per_rank for i in batches[g]) == whole[g]
    resumed = Ranks((5, 3)).samplers(n, seed=seed, mode="exact")
    for sampler in resumed:
        sampler.set_epoch(0, first_batch=4)
    rest = sorted(i for s in resumed for b in s for i in b)
    assert rest == sorted(i for g in whole[4:] for i in g)
    assert [len(s) for s in resumed] == [3, 3]


def test_sampler_is_deterministic_given_seed_and_shares():
    first = [list(s) for s in Ranks((3, 5)).samplers(30, seed=9)]
    second = [list(s) for s in Ranks((3, 5)).samplers(30, seed=9)]
    other = [list(s) for s in Ranks((3, 5)).samplers(30, seed=10)]
    assert first == second and first != other
    unshuffled = Ranks((3, 5)).samplers(16, shuffle=False)
    assert list(unshuffled[0]) == [[0, 1, 2], [8, 9, 10]]
    assert list(unshuffled[1]) == [[3, 4, 5, 6, 7], [11, 12, 13, 14, 15]]


def test_the_ledger_weights_what_was_dealt():
    ranks = Ranks((3, 5))
    sampler = ranks.samplers(20, mode="exact", shuffle=False)[1]
    batches = list(sampler)
    assert [len(b) for b in batches] == [5, 5, 2]
    schedule = ranks.balancers[1].schedule
    assert schedule.take(1) == (5, 8, 1)
    assert schedule.take(2) == (7, 12, 2)


def test_sampler_argument_errors():
    balancer = Ranks((2, 2)).balancers[0]
    with pytest.raises(InvalidArgumentError, match="mode"):
        BalancedBatchSampler(10, balancer, mode="even")
    with pytest.raises(InvalidArgumentError, match="seed"):
        BalancedBatchSampler(10, balancer, seed=-1)
    with pytest.raises(InvalidArgumentError, match="first_batch"):
        BalancedBatchSampler(10, balancer).set_epoch(0, first_batch=4)
    with pytest.raises(InvalidArgumentError, match="dataset"):
        BalancedBatchSampler(object(), balancer)


def test_torch_dataloader_takes_the_sampler():
    torch = pytest.importorskip("torch")
    dataset = torch.utils.data.TensorDataset(torch.arange(20))
    ranks = Ranks((3, 5))
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=ranks.samplers(20, shuffle=False, mode="exact")[0])
    assert [x.tolist() for (x,) in loader] == [[0, 1, 2], [8, 9, 10], [16, 17]]
    assert len(loader) == 3


@pytest.mark.processes
def test_the_rule_the_schedule_and_the_sampler_import_neither_mpi4py_nor_torch(tmp_path):
    probe = ("import sys\n"
             "import ringtrain.trainer.balance_shares, ringtrain.trainer.balance_schedule\n"
             "import ringtrain.trainer.balanced_sampler\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'torch')))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
