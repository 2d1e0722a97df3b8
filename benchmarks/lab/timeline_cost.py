"""What a running timeline costs an allreduce: rounds of in-place allreduces without and
with a timeline, alternating (the timeline started and stopped between rounds, its
first rounds in either order), so that the machine's noise hits both alike.

    mpiexec -n 2 python benchmarks/lab/timeline_cost.py [--bytes 1048576] [--rounds 15]

Prints the median time per call of each and the median of the rounds' on/off ratios
(rank 0). The timeline files go to a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import ringtrain as rt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=1 << 20, help="the allreduce's size")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of each")
    parser.add_argument("--calls", type=int, default=200, help="calls per round")
    options = parser.parse_args()
    rt.init()
    folder = rt.broadcast_object(tempfile.mkdtemp() if rt.rank() == 0 else None, 0)
    path = os.path.join(folder, "timeline.json")
    x = np.ones(options.bytes // 4, np.float32)
    for _ in range(20):
        rt.allreduce_(x, rt.Sum)
    times: dict[str, list[float]] = {"off": [], "on": []}
    for round_ in range(options.rounds):
        for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            if mode == "on":
                rt.start_timeline(path)
            rt.barrier()
            start = time.perf_counter()
            for _ in range(options.calls):
                rt.allreduce_(x, rt.Sum)
            times[mode].append((time.perf_counter() - start) / options.calls * 1e6)
            if mode == "on":
                rt.stop_timeline()
    rt.barrier()
    if rt.rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        ratio = statistics.median(a / b for a, b in zip(times["on"], times["off"]))
        print(f"{options.bytes} B allreduce_ at {rt.size()} ranks: timeline off {off:.1f} us, "
              f"on {on:.1f} us per call; on/off {ratio:.3f} (median of {options.rounds} "
              f"rounds of {options.calls} calls)")
    rt.shutdown()


if __name__ == "__main__":
    main()
