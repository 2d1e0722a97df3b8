"""LoadBalancer across real ranks: the agreement, its errors, the sampler on every rank.

- the shares are the same on every rank for any measurements (ties, ranks reporting
  zero, wide ranges), and equal to the rule applied to every rank's numbers;
- they move toward the measured speeds, stay put when the ranks are even, respect each
  rank's cap, and change only from a global batch no rank's sampler has dealt (ranks
  prefetching unevenly still deal every index once per epoch);
- the optimizer's own timing moves samples away from a rank that is slower per sample;
- a failed measurement, caps that cannot hold the batch and ranks that disagree on the
  global batch raise on every rank, and the balancer works afterwards;
- a change is logged at INFO and every agreement is on the timeline.

Run: mpiexec -n K python tests/mpi/balance.py [--only SUBSTRING]
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import Counter

import ringtrain as rt
from _harness import WORLD, check, expect_raises, main, rng, same_on_all_ranks
from ringtrain.balance import BalanceError, balanced_shares, proportional_shares

try:
    import torch
except ImportError:
    torch = None


def measurements(trial: int) -> list[float]:
    """Every rank's seconds per sample in a trial (0: the rank measures nothing), with
    ties and zeros; the same list on every rank."""
    generator = rng(0, "measurements", trial)
    pool = [0.0, 1e-3, 1e-3, 2e-3, 5e-4]
    return [float(generator.choice(pool)) if generator.random() < 0.6
            else float(generator.uniform(1e-5, 1e-2)) for _ in range(rt.size())]


@check
def shares_are_identical_on_every_rank_for_any_measurements():
    for trial in range(16):
        batch = rt.size() * (1 + trial % 5) + trial
        balancer = rt.LoadBalancer(batch, interval=1, smoothing=1.0, noise_margin=0.0)
        seconds = measurements(trial)
        if seconds[rt.rank()]:
            balancer.record(seconds[rt.rank()], 1)
        even = balancer.shares
        balancer.step()
        same_on_all_ranks(balancer.shares, f"trial {trial}: shares")
        expected = balanced_shares(seconds, even, batch, hysteresis=balancer.hysteresis,
                                   correction=balancer.correction)
        assert balancer.shares == expected, (trial, seconds, balancer.shares, expected)
        assert sum(balancer.shares) == batch and min(balancer.shares) >= 1
        assert balancer.measured == tuple(seconds)


@check
def shares_follow_speeds_and_stay_put_when_ranks_are_even():
    size, rank = rt.size(), rt.rank()
    balancer = rt.LoadBalancer(60 * size, interval=3, smoothing=1.0, correction=1.0,
                               noise_margin=0.0)
    assert balancer.shares == (60,) * size
    for step in range(3):
        balancer.record(1e-3 * (1 + 0.01 * ((rank + step) % 2)) * 60, 60)  # noise of 1%
        balancer.step()
    assert balancer.shares == (60,) * size, balancer.shares
    # Rank r takes r+1 times as long per sample: its share falls as 1/(r+1).
    for _ in range(3):
        balancer.record(1e-3 * (rank + 1) * 60, 60)
        balancer.step()
    expected = proportional_shares([1.0 / (r + 1) for r in range(size)], 60 * size)
    assert balancer.shares == expected, (balancer.shares, expected)


@check
def noise_keeps_even_ranks_still_and_a_lasting_change_is_followed():
    """Even ranks whose measurements wobble by up to 15% at each agreement keep even
    shares; when the last rank becomes twice as slow for good, its share falls once the
    change has left the noise's memory of 6 agreements."""
    size, rank = rt.size(), rt.rank()
    balancer = rt.LoadBalancer(16 * size, interval=1, smoothing=1.0)
    even = balancer.shares
    for step in range(16):
        balancer.record(1e-3 * (1 + 0.15 * rng(rank, "wobble", step).uniform(-1, 1)), 1)
        balancer.step()
        assert balancer.shares == even, (step, balancer.shares)
    for step in range(10):
        balancer.record(2e-3 if rank == size - 1 else 1e-3, 1)
        balancer.step()
    if size > 1:
        assert balancer.shares[-1] < min(balancer.shares[:-1]), balancer.shares


@check
def caps_hold_and_caps_too_small_fail_on_every_rank():
    size, rank = rt.size(), rt.rank()
    cap = 5 if rank == 0 and size > 1 else None
    balancer = rt.LoadBalancer(10 * size, interval=1, max_share=cap, smoothing=1.0,
                               correction=1.0, noise_margin=0.0)
    balancer.record(1e-6 if rank == 0 else 1e-3, 1)          # rank 0 is very fast
    balancer.step()
    if size > 1:
        assert balancer.shares[0] == 5, balancer.shares
    error = expect_raises(BalanceError, rt.LoadBalancer, 10 * size, max_share=9)
    assert str(9 * size) in str(error)
    least_two = rt.LoadBalancer(10 * size, interval=1, min_share=2)
    least_two.max_share = 1 if rank == size - 1 else None
    expect_raises(BalanceError, least_two.rebalance,
                  match=[f"rank {size - 1}", "below the least share"])
    least_two.max_share = None
    least_two.rebalance()


@check
def a_failed_measurement_raises_on_every_rank_and_the_balancer_goes_on():
    size, rank = rt.size(), rt.rank()
    balancer = rt.LoadBalancer(4 * size, interval=2)
    failing = size - 1
    try:
        with balancer.timed(4):
            if rank == failing:
                raise RuntimeError("out of memory")
    except RuntimeError:
        pass
    balancer.step()
    error = expect_raises(BalanceError, balancer.step,
                          match=[f"rank {failing}", "failed measurement"])
    assert "shares stay" in str(error)
    with balancer.timed(4):
        pass
    balancer.rebalance()                     # the next agreement works
    same_on_all_ranks(balancer.shares, "shares after a failure")


@check(min_size=2)
def ranks_disagreeing_on_the_global_batch_fail_on_every_rank():
    expect_raises(rt.MismatchError, rt.LoadBalancer, 8 + (rt.rank() == 1))
    rt.LoadBalancer(8)                       # and the next one is made


@check
def sampler_deals_every_index_once_while_shares_change_and_ranks_prefetch():
    """Each rank's sampler runs a different number of batches ahead of training (as a
    loader's workers do); shares change every 2 steps; the union of what the ranks
    trained in each epoch is every index exactly once."""
    size, rank = rt.size(), rt.rank()
    balancer = rt.LoadBalancer(5 * size + 1, interval=2, hysteresis=0.0, smoothing=1.0,
                               noise_margin=0.0)
    n = 103  # the last global batch has at least one sample for every rank at np 1 to 4
    sampler = rt.BalancedBatchSampler(n, balancer, seed=4, mode="exact")
    ahead = rank % 3
    for epoch in range(2):
        sampler.set_epoch(epoch)
        iterator = iter(sampler)
        queue = [b for _, b in zip(range(ahead), iterator)]
        trained: list[int] = []
        steps = 0
        while True:
            queue.extend(b for _, b in zip(range(1), iterator))
            if not queue:
                break
            trained.extend(queue.pop(0))
            balancer.record(rng(rank, "speed", epoch, steps).uniform(1e-4, 1e-2), 1)
            steps += 1
            balancer.step()
        everyone = WORLD.allgather(trained)
        counts = Counter(i for indices in everyone for i in indices)
        assert sorted(counts) == list(range(n)) and set(counts.values()) == {1}, counts
    same_on_all_ranks(steps, "steps in the last epoch")


@check(min_size=2)
def optimizer_timing_moves_samples_away_from_a_slow_rank():
    """The DistributedOptimizer measures each step's compute itself; the last rank
    spends 2 ms more per sample (a sleep inside the step), so after a few agreements it
    holds fewer samples than the others (no noise margin: a machine busy with other work
    makes the ranks' speeds wobble, and the check is about the measurement)."""
    if torch is None:
        return
    size, rank = rt.size(), rt.rank()
    balancer = rt.LoadBalancer(8 * size, interval=3, noise_margin=0.0)
    model = torch.nn.Linear(4, 2)
    optimizer = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                        named_parameters=model.named_parameters(),
                                        balance=balancer)
    assert optimizer.balancer is balancer
    for _ in range(9):
        optimizer.zero_grad()
        share = balancer.share
        x = torch.ones(share, 4)
        model(x).sum().backward()
        time.sleep(share * (0.0025 if rank == size - 1 else 0.0005))
        optimizer.step()
    slow, fast = balancer.shares[-1], min(balancer.shares[:-1])
    assert slow < fast, balancer.shares
    assert balancer.seconds_per_sample is not None


@check
def a_change_is_logged_and_every_agreement_is_on_the_timeline():
    size, rank = rt.size(), rt.rank()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ringtrain")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    directory = tempfile.mkdtemp(prefix="ringtrain-balance-") if rank == 0 else None
    directory = WORLD.bcast(directory)
    path = os.path.join(directory, "timeline.json")
    try:
        rt.start_timeline(path)
        balancer = rt.LoadBalancer(10 * size + 1, interval=1, smoothing=1.0, noise_margin=0.0)
        balancer.record(1e-3 * (rank + 1), 1)
        changed = balancer.step()
        rt.stop_timeline()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [r.getMessage() for r in records if "load balance" in r.getMessage()]
    if changed and rank == 0:
        assert len(lines) == 1 and "changed from" in lines[0], lines
    else:
        assert not lines, lines
    mine = path if size == 1 else os.path.join(directory, f"timeline.rank{rank}.json")
    with open(mine) as handle:
        events = json.load(handle)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    shares = [e for e in events if e["name"] == "shares"]
    assert len(shares) == 1 and rows[shares[0]["tid"]] == "load balancer", shares
    assert shares[0]["args"]["shares"] == list(balancer.shares)


if __name__ == "__main__":
    main()
