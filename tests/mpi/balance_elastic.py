"""Balanced training through an elastic restart with another number of ranks.

usage: ringtrain-run ... python balance_elastic.py

A float64 linear model trained with a LoadBalancer, a BalancedBatchSampler and a
DistributedOptimizer given ``balance=``; the last rank is slower per sample (a sleep), so
the shares move away from even. The epoch, the global batch reached in it and the model
are committed after every step. Rank 1 kills itself (SIGKILL) at the start of step
$RINGTRAIN_TEST_KILL_AT_STEP on the first start only; the launcher starts the job again
(with the ranks its host discovery script finds), where a new balancer starts from even
shares and the sampler resumes the epoch at the committed global batch. At the end rank 0
replays the same global batches in one process and checks the weights.

Prints (rank 0): ``start R at epoch E batch B with N ranks, shares [...]`` on each start,
``final shares [...]`` and ``matches the one-process reference (off by X)``.
"""

import os
import signal
import time

import numpy as np

import ringtrain as rt
from ringtrain import elastic
from ringtrain.trainer.distributed_sampler import epoch_order

SAMPLES, FEATURES, BATCH, EPOCHS = 40, 4, 8, 3
SEED = 11
LR = 0.05
TOLERANCE = 1e-12   # float64: the weighted mean differs from the one-process mean by roundings
KILL_AT_STEP = int(os.environ.get("RINGTRAIN_TEST_KILL_AT_STEP", "-1"))
BATCHES = SAMPLES // BATCH

generator = np.random.default_rng(SEED)
INPUTS = generator.standard_normal((SAMPLES, FEATURES))
TARGETS = INPUTS @ generator.standard_normal(FEATURES) + 0.1 * generator.standard_normal(SAMPLES)


def gradient(weights: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The gradient of the mean squared error over ``rows``."""
    residual = INPUTS[rows] @ weights - TARGETS[rows]
    return 2.0 * INPUTS[rows].T @ residual / len(rows)


class Model:
    def __init__(self) -> None:
        self.weights = np.zeros(FEATURES)
        self.gradient = np.zeros(FEATURES)

    def state_dict(self) -> dict:
        return {"weights": self.weights.copy()}

    def load_state_dict(self, saved: dict) -> None:
        self.weights[...] = saved["weights"]


class SGD:
    def __init__(self, model: Model) -> None:
        self.model = model

    def step(self) -> None:
        self.model.weights -= LR * self.model.gradient


model = Model()
state = elastic.State(epoch=0, batch=0, model=model)


@elastic.run
def train(state: elastic.State) -> tuple[int, ...]:
    balancer = rt.LoadBalancer(BATCH, interval=2, hysteresis=0.0, noise_margin=0.0)
    if rt.rank() == 0:
        print(f"start {elastic.restart_count()} at epoch {state.epoch} batch {state.batch} "
              f"with {rt.size()} ranks, shares {list(balancer.shares)}", flush=True)
    sampler = rt.BalancedBatchSampler(SAMPLES, balancer, seed=SEED)
    optimizer = rt.DistributedOptimizer(SGD(model), [("w", model.weights, model.gradient)],
                                        balance=balancer)
    seconds_per_sample = 0.003 if rt.rank() == rt.size() - 1 and rt.size() > 1 else 0.0
    while state.epoch < EPOCHS:
        sampler.set_epoch(state.epoch, first_batch=state.batch)
        for rows in sampler:
            step = state.epoch * BATCHES + state.batch
            if step == KILL_AT_STEP and elastic.restart_count() == 0 and rt.rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            time.sleep(seconds_per_sample * len(rows))
            model.gradient[...] = gradient(model.weights, rows)
            optimizer.step()
            state.batch += 1
            state.commit()
        state.epoch, state.batch = state.epoch + 1, 0
        state.commit()
    return balancer.shares


shares = train(state)
if rt.rank() == 0:
    reference = np.zeros(FEATURES)
    for epoch in range(EPOCHS):
        order = epoch_order(SAMPLES, SEED, epoch, True)
        for batch in range(BATCHES):
            reference -= LR * gradient(reference, order[batch * BATCH:(batch + 1) * BATCH])
    error = float(np.abs(model.weights - reference).max())
    print(f"final shares {list(shares)}", flush=True)
    if error > TOLERANCE:
        raise SystemExit(f"the weights are off by {error:.3g} from the one-process reference")
    print(f"matches the one-process reference (off by {error:.3g})", flush=True)
