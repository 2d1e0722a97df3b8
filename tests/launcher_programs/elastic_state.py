"""Commit and restore of ringtrain.elastic.State on every rank, the background write of
the file and a failed one reported on every rank; prints "rank R ok".

usage: python elastic_state.py DIRECTORY
"""

import os
import pickle
import sys
import threading

import numpy as np

import ringtrain as rt
from ringtrain import elastic
from ringtrain.trainer import elastic as elastic_module

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
state.flush()  # the file is written in the background
first_inode = os.stat(CHECKPOINT).st_ino
assert os.listdir(DIRECTORY) == [elastic.CHECKPOINT_NAME], os.listdir(DIRECTORY)
rt.barrier()  # every rank has looked at the first commit before the second begins

state.epoch = 4
counter.count = 8
state.commit()
state.flush()
assert os.stat(CHECKPOINT).st_ino != first_inode, "the checkpoint was not replaced"
assert os.listdir(DIRECTORY) == [elastic.CHECKPOINT_NAME], os.listdir(DIRECTORY)

fresh_counter = Counter()
fresh = elastic.State(directory=DIRECTORY, epoch=0, weights=np.zeros(3), counter=fresh_counter)
assert fresh.restore() is True
assert fresh.epoch == 4 and fresh.history == {"loss": [0.5, 0.25]}
assert np.array_equal(fresh.weights, [0.0, 2.0, 4.0]) and fresh.weights.dtype == np.float64
assert fresh.counter is fresh_counter and fresh_counter.count == 8
# The file is written in the background: a commit returns while rank 0's write waits, and
# the file holds the previous commit until the write is done.
real_write = elastic_module.write_atomically
gate = threading.Event()


def slow_write(path: str, data: bytes) -> None:
    gate.wait()
    real_write(path, data)


def committed_epoch() -> object:
    with open(CHECKPOINT, "rb") as handle:
        return pickle.load(handle)["values"]["epoch"][1]


elastic_module.write_atomically = slow_write
state.epoch = 6
state.commit()
if rt.rank() == 0:
    assert committed_epoch() == 4, committed_epoch()
gate.set()
state.flush()
assert committed_epoch() == 6, committed_epoch()


def failing_write(path: str, data: bytes) -> None:
    raise OSError(28, "No space left on device")


# A write that fails is reported on every rank, at the next flush (or commit).
elastic_module.write_atomically = failing_write
state.epoch = 7
state.commit()
try:
    state.flush()
    raise AssertionError("the failed write was not reported")
except elastic.ElasticError as error:
    assert "No space left on device" in str(error) and CHECKPOINT in str(error), error
elastic_module.write_atomically = real_write
state.commit()
state.flush()
assert committed_epoch() == 7, committed_epoch()
print(f"rank {rt.rank()} ok", flush=True)
