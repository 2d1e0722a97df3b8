"""A small training run with the timeline on (RINGTRAIN_TIMELINE set by the test).

Each step, the file must already be valid JSON; the test then checks phases and names.

Run: RINGTRAIN_TIMELINE=/tmp/t.json mpiexec -n K python tests/mpi/diagnostics_timeline.py
"""

from __future__ import annotations

import json

import numpy as np

import ringtrain as rt
from ringtrain.collectives import timeline

SHAPES = {"w1": (300, 300), "b1": (300,), "w2": (300, 3), "b2": (3,)}


class SGD:
    def __init__(self, params: dict, grads: dict):
        self.params, self.grads = params, grads

    def step(self) -> None:
        for name, parameter in self.params.items():
            parameter -= 0.1 * self.grads[name]


def main() -> None:
    rt.init()
    path = timeline.ACTIVE.path
    grads = {name: np.full(shape, rt.rank() + 1.0, np.float32) for name, shape in SHAPES.items()}
    params = {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    for compression in (rt.Compression.none, rt.Compression.fp16):
        optimizer = rt.DistributedOptimizer(
            SGD(params, grads), [(n, params[n], grads[n]) for n in SHAPES],
            compression=compression, fusion_threshold=8192, first_bucket_bytes=8192)
        for _ in range(2):
            for name in reversed(SHAPES):
                optimizer.mark_ready(name)
            optimizer.step()
            with open(path) as file:
                json.load(file)  # valid at every moment, not only at the end
    rt.allreduce(np.ones(4), name="small", algorithm="native")
    rt.shutdown()
    print(f"rank {rt.rank() if rt.is_initialized() else '-'} wrote {path}", flush=True)


if __name__ == "__main__":
    main()
