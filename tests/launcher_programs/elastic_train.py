"""A toy data-parallel training run that commits its state after every step.

usage: python elastic_train.py OUTPUT [STEPS]

The "model" is a float64 vector; each step's global batch of integer-valued rows comes
from a seed and the step, is split across the ranks, and the gradient is summed over
them with an allreduce. Every number is an integer far below 2**53, so the sums are
exact in any order and the result does not depend on the number of ranks. A small
momentum "optimizer" is saved through state_dict/load_state_dict.

Rank 1 kills itself with SIGKILL at the start of step $RINGTRAIN_TEST_KILL_AT_STEP on the
first start only ($RINGTRAIN_RESTART_COUNT 0). Rank 0 writes the final parameters to
OUTPUT (numpy .npy).
"""

import os
import signal
import sys

import numpy as np

import ringtrain as rt
from ringtrain import elastic

OUTPUT = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 10
SEED = 1234
FEATURES = 4
BATCH = 6
KILL_AT_STEP = int(os.environ.get("RINGTRAIN_TEST_KILL_AT_STEP", "-1"))


class Momentum:
    """Integer momentum: velocity = velocity // 2 + gradient; the update is the velocity."""

    def __init__(self) -> None:
        self.velocity = np.zeros(FEATURES)

    def step(self, gradient: np.ndarray) -> np.ndarray:
        self.velocity = np.floor(self.velocity / 2) + gradient
        return self.velocity

    def state_dict(self) -> dict:
        return {"velocity": self.velocity.copy()}

    def load_state_dict(self, saved: dict) -> None:
        self.velocity = saved["velocity"].copy()


def local_gradient(params: np.ndarray, step: int) -> np.ndarray:
    rng = np.random.default_rng([SEED, step])
    rows = rng.integers(-3, 4, size=(BATCH, FEATURES)).astype(np.float64)
    targets = rng.integers(-5, 6, size=BATCH).astype(np.float64)
    mine = np.array_split(np.arange(BATCH), rt.size())[rt.rank()]
    residuals = np.mod(rows[mine] @ params - targets[mine], 7)
    return residuals @ rows[mine]


state = elastic.State(step=0, params=np.zeros(FEATURES), optimizer=Momentum())


@elastic.run
def train(state: elastic.State) -> np.ndarray:
    print(f"start {elastic.restart_count()} at step {state.step} with {rt.size()} ranks",
          flush=True)
    while state.step < STEPS:
        if state.step == KILL_AT_STEP and elastic.restart_count() == 0 and rt.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        gradient = rt.allreduce(local_gradient(state.params, state.step), op=rt.Sum,
                                name="gradient")
        state.params = state.params - state.optimizer.step(gradient)
        state.step += 1
        state.commit()
    return state.params


params = train(state)
if rt.rank() == 0:
    np.save(OUTPUT, params)
    print("final", params.tolist(), flush=True)
