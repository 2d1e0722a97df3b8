"""How long a running job takes to grow onto a host that appears: from the discovery
script's first offer of the new slots to the first step on the resized job.

    python benchmarks/elastic_resize.py
    python benchmarks/elastic_resize.py --ranks 2 --megabytes 100 --rounds 3

Each round runs ``ringtrain-run --host-discovery-script`` over a training loop of its
own (this file, with ``--worker``): ``--ranks`` ranks on localhost commit a state of
``--megabytes`` MB after every step of ``--step-seconds``; at step 3 rank 0 makes the
discovery script offer one more slot, and writes down when. The times, taken from the
files the run leaves:

    noticed   the launcher's notice is there (it polls every --discovery-interval s)
    stopped   the ranks flushed the commit after it and ended (the resizing marker)
    running   the first step of the job with one more rank has begun

Medians over ``--rounds``, in seconds after the offer. ``stopped - noticed`` is at most a
step plus the flush of one commit; ``running - stopped`` is a fresh start: mpiexec, the
interpreters, ``import ringtrain``/numpy and ``restore()`` of the commit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--megabytes", type=float, default=100.0)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--discovery-interval", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("DIRECTORY", "MEGABYTES"),
                        help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(directory: str, megabytes: float, step_seconds: float) -> None:
    """The training loop each rank runs under ringtrain-run."""
    import ringtrain as rt
    from ringtrain import elastic

    state = elastic.State(step=0, weights=np.zeros(int(megabytes * 1e6 / 8)))

    @elastic.run
    def train(state: elastic.State) -> None:
        if elastic.restart_count() > 0:
            if rt.rank() == 0:
                stamp(directory, "running")
            return
        while True:
            if state.step == 3 and rt.rank() == 0:
                stamp(directory, "offered")
                open(os.path.join(directory, "grow"), "w").close()
            time.sleep(step_seconds)
            state.step += 1
            state.commit()

    train(state)


def stamp(directory: str, name: str) -> None:
    with open(os.path.join(directory, name), "w") as file:
        file.write(repr(time.time()))


def read_stamp(directory: str, name: str) -> float:
    with open(os.path.join(directory, name)) as file:
        return float(file.read())


def one_round(arguments: argparse.Namespace) -> dict[str, float]:
    directory = tempfile.mkdtemp(prefix="ringtrain-resize-")
    elastic_dir = os.path.join(directory, "elastic")
    script = os.path.join(directory, "discover.sh")
    grow = os.path.join(directory, "grow")
    with open(script, "w") as file:
        file.write(f'#!/bin/sh\nif [ -e {grow} ]; then echo localhost:{arguments.ranks + 1}; '
                   f'else echo localhost:{arguments.ranks}; fi\n')
    os.chmod(script, 0o755)
    watch = [sys.executable, "-c", _WATCH, elastic_dir, directory]
    watcher = subprocess.Popen(watch)
    try:
        subprocess.run(
            ["ringtrain-run", "--max-np", str(arguments.ranks + 1), "--discovery-interval",
             str(arguments.discovery_interval), "--host-discovery-script", script,
             "--elastic-dir", elastic_dir, sys.executable, os.path.abspath(__file__),
             "--step-seconds", str(arguments.step_seconds),
             "--worker", directory, str(arguments.megabytes)],
            check=True, stdout=subprocess.DEVNULL)
    finally:
        watcher.kill()
        watcher.wait()
    offered = read_stamp(directory, "offered")
    times = {name: read_stamp(directory, name) - offered
             for name in ("noticed", "stopped", "running")}
    shutil.rmtree(directory, ignore_errors=True)
    return times


_WATCH = """
import os, sys, time
elastic, out = sys.argv[1], sys.argv[2]
seen = {}
while len(seen) < 2:
    for name, file in (("noticed", "hosts-updated"), ("stopped", "resizing")):
        if name not in seen and os.path.exists(os.path.join(elastic, file)):
            seen[name] = time.time()
            with open(os.path.join(out, name), "w") as handle:
                handle.write(repr(seen[name]))
    time.sleep(0.002)
"""


def main() -> None:
    arguments = parse_arguments()
    if arguments.worker:
        worker(arguments.worker[0], float(arguments.worker[1]), arguments.step_seconds)
        return
    rounds = [one_round(arguments) for _ in range(arguments.rounds)]
    print(f"{arguments.ranks} -> {arguments.ranks + 1} ranks on localhost, "
          f"{arguments.megabytes:g} MB committed every {arguments.step_seconds:g} s step, "
          f"discovery every {arguments.discovery_interval:g} s; medians of "
          f"{arguments.rounds} rounds, seconds after the offer:")
    for name in ("noticed", "stopped", "running"):
        print(f"  {name:8s} {statistics.median(r[name] for r in rounds):7.2f}")


if __name__ == "__main__":
    main()
