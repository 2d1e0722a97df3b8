"""How long ringtrain.elastic's commit holds a training step: the background write against
a synchronous one, in the same run.

    mpiexec -n 2 python benchmarks/elastic_commit.py
    mpiexec -n 2 python benchmarks/elastic_commit.py --megabytes 1000 --rounds 3

The state is one float64 array of ``--megabytes`` MB (a model's weights) and an epoch
counter, committed into ``--directory`` (default: a temporary directory). Per round, in
turn: ``sync`` = ``commit()`` then ``flush()``: the call returns once the file is on disk,
which is what a commit cost before commits were written in the background; ``async`` =
``commit()`` alone, the file written on rank 0's writer thread while the ranks go on (here
they sleep ``--step-seconds``, a stand-in for a training step, before the next commit,
which first waits for the previous write). Times are the slowest rank's, median over the
rounds; the ratio is async / sync.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import ringtrain as rt
from ringtrain import elastic


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=100.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-seconds", type=float, default=2.0,
                        help="time between two commits (a training step's stand-in)")
    parser.add_argument("--directory", default=None)
    return parser.parse_args()


def slowest(seconds: float) -> float:
    """The slowest rank's time."""
    return max(rt.allgather_object(seconds, name="bench.time"))


def main() -> None:
    arguments = parse_arguments()
    rt.init()
    directory = arguments.directory or (tempfile.mkdtemp(prefix="ringtrain-commit-")
                                        if rt.rank() == 0 else None)
    directory = rt.broadcast_object(directory, root_rank=0, name="bench.directory")
    weights = np.random.default_rng(0).standard_normal(int(arguments.megabytes * 1e6) // 8)
    state = elastic.State(directory=directory, epoch=0, weights=weights)
    state.commit()
    state.flush()
    times: dict[str, list[float]] = {"sync": [], "async": []}
    for _ in range(arguments.rounds):
        for mode in ("sync", "async"):
            state.epoch += 1
            rt.barrier()
            start = time.perf_counter()
            state.commit()
            if mode == "sync":
                state.flush()
            times[mode].append(slowest(time.perf_counter() - start))
            time.sleep(arguments.step_seconds)
    state.flush()
    if rt.rank() == 0:
        medians = {mode: statistics.median(values) for mode, values in times.items()}
        print(f"# elastic commit of {weights.nbytes / 1e6:.0f} MB at {rt.size()} ranks, "
              f"{arguments.rounds} rounds, into {directory}")
        for mode, median in medians.items():
            print(f"{mode:>6}  {median * 1e3:9.1f} ms")
        print(f" ratio  {medians['async'] / medians['sync']:9.3f}  (async / sync)")
    rt.shutdown()


if __name__ == "__main__":
    main()
