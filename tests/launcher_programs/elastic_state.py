"""Commit and restore of ringtrain.elastic.State on every rank; prints "rank R ok".

usage: python elastic_state.py DIRECTORY
"""

import os
import sys

import numpy as np

import ringtrain as rt
from ringtrain import elastic

DIRECTORY = sys.argv[1]
CHECKPOINT = os.path.join(DIRECTORY, elastic.CHECKPOINT_NAME)


class Counter:
    """An object saved through state_dict/load_state_dict, restored in place."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, saved: dict) -> None:
        self.count = saved["count"]


rt.init()
counter = Counter()
state = elastic.State(directory=DIRECTORY, epoch=0, weights=np.arange(3.0), counter=counter)
assert state.restore() is False, "restored from a directory with no commit"

state.epoch = 3
state.weights = state.weights * 2
state.history = {"loss": [0.5, 0.25]}
counter.count = 7
state.commit()
first_inode = os.stat(CHECKPOINT).st_ino
assert os.listdir(DIRECTORY) == [elastic.CHECKPOINT_NAME], os.listdir(DIRECTORY)
rt.barrier()  # every rank has looked at the first commit before the second begins

state.epoch = 4
counter.count = 8
state.commit()
assert os.stat(CHECKPOINT).st_ino != first_inode, "the checkpoint was not replaced"
assert os.listdir(DIRECTORY) == [elastic.CHECKPOINT_NAME], os.listdir(DIRECTORY)

fresh_counter = Counter()
fresh = elastic.State(directory=DIRECTORY, epoch=0, weights=np.zeros(3), counter=fresh_counter)
assert fresh.restore() is True
assert fresh.epoch == 4 and fresh.history == {"loss": [0.5, 0.25]}
assert np.array_equal(fresh.weights, [0.0, 2.0, 4.0]) and fresh.weights.dtype == np.float64
assert fresh.counter is fresh_counter and fresh_counter.count == 8
print(f"rank {rt.rank()} ok", flush=True)
