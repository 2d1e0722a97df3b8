"""bfloat16 allreduce against float32 of the same element count and of the same bytes.

    mpiexec -n 2 python benchmarks/bfloat16_allreduce.py
    mpiexec -n 2 python benchmarks/bfloat16_allreduce.py --sizes 1,4,64 --in-place

For each size (MiB of bfloat16), ``ringtrain.allreduce`` (``op=Sum``, ``auto``) of a
bfloat16 array of N elements, a float32 array of N elements (twice the bytes) and a float32
array of N/2 elements (the same bytes), timed in turn within each round, so that the
machine's noise hits the three alike. A time is the median over ``--rounds`` rounds of
the slowest rank's mean per call (enough calls to move ``--round-bytes``). ``x N`` is
bfloat16's time over float32's at the same element count, ``x bytes`` over float32's at
the same bytes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import ringtrain as rt
from ringtrain.kernels import BFLOAT16

MIB = 1 << 20


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", default="0.5,1,2,4,8,16,32,64",
                        help="comma-separated sizes in MiB of bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--round-bytes", type=int, default=64 * MIB,
                        help="float32 bytes moved per timed call kind per round")
    parser.add_argument("--in-place", action="store_true", help="allreduce_ (in place)")
    return parser.parse_args()


def seconds_per_call(call: Callable[[], object], calls: int) -> float:
    """The slowest rank's mean seconds per call, after a barrier."""
    rt.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    seconds = (time.perf_counter() - start) / calls
    return float(rt.allreduce(np.array([seconds]), op=rt.Max, name="benchmark time")[0])


def main() -> None:
    args = parse_arguments()
    rt.init()
    reduce = rt.allreduce_ if args.in_place else rt.allreduce
    if rt.rank() == 0:
        print(f"{rt.size()} ranks, allreduce{'_' if args.in_place else ''} (sum, auto), "
              f"median of {args.rounds} rounds")
        print(f"{'MiB bf16':>9} {'bf16 us':>10} {'f32 N us':>10} {'f32 bytes us':>13} "
              f"{'x N':>6} {'x bytes':>8}")
    for mib in (float(s) for s in args.sizes.split(",")):
        count = int(mib * MIB) // 2
        arrays = {"bf16": np.ones(count, BFLOAT16), "f32 N": np.ones(count, np.float32),
                  "f32 bytes": np.ones(count // 2, np.float32)}
        calls = max(3, args.round_bytes // (count * 4))
        times: dict[str, list[float]] = {kind: [] for kind in arrays}
        for array in arrays.values():
            reduce(array, op=rt.Sum)
        for _ in range(args.rounds):
            for kind, array in arrays.items():
                times[kind].append(seconds_per_call(
                    lambda array=array: reduce(array, op=rt.Sum), calls))
        medians = {kind: statistics.median(values) * 1e6 for kind, values in times.items()}
        if rt.rank() == 0:
            print(f"{mib:>9g} {medians['bf16']:>10.0f} {medians['f32 N']:>10.0f} "
                  f"{medians['f32 bytes']:>13.0f} {medians['bf16'] / medians['f32 N']:>6.2f} "
                  f"{medians['bf16'] / medians['f32 bytes']:>8.2f}", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
