"""Compile ringtrain's compiled collectives for every dtype they take into numba's disk
cache, before a job needs them.

Each compiled call (the agreement's exchange, the ring, MPI's own collectives checked in
one call, the riding broadcast and gather, the pairwise exchange, point-to-point steps,
Adasum, the 16-bit host kernels) is compiled per dtype the first time a program makes
it, on every rank at once, and loaded from numba's cache ever after. Compiling them all
takes minutes of one core (:func:`specializations` lists them); this spreads them over
several processes, each compiling every specialization of its dtypes, so that each is
compiled by one process (the few callees that every dtype shares aside).

Run once after installing or upgrading ringtrain (the cache lives beside the package, or
in ``NUMBA_CACHE_DIR``)::

    python -m ringtrain.collectives.warm_up [--processes N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

import numba
import numpy as np
from numba import types

PAYLOAD_DTYPES = ("float32", "float64", "int8", "uint8", "int16", "int32", "int64", "uint16")
"""The dtypes that compiled code moves and combines (:func:`payload_code`); uint16 holds
the 16-bit floats' bits, which it reduces only."""
HOST_KERNELS = "float16/bfloat16"
"""The share of the 16-bit host kernels (:func:`..kernels.host.compile_every_kernel`)."""
_HOST_KERNELS_LOAD = 13
"""What compiling the host kernels weighs, in specializations of the others."""

_MODULE = "ringtrain.collectives.warm_up"

Specialization = tuple[Callable, tuple]
"""A compiled function and the types of the arguments it is compiled for."""


def _array(dtype: str, readonly: bool = False) -> types.Array:
    return types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C", readonly=readonly)


def specializations() -> dict[str, list[Specialization]]:
    """Every specialization the collectives compile, by the dtype it is for (``""``: those
    of no payload dtype), each as the library calls it from Python (its callees compile
    with it)."""
    from ..kernels import adasum
    from .algorithms import _compiled_ring
    from .p2p import _p2p_compiled
    from .transport import (_compiled_checked, _compiled_riding, _compiled_steps, _mailboxes,
                            _pairwise)
    from .transport._c_calls import load_mpi_functions

    functions, _ = load_mpi_functions()
    handle = numba.from_dtype(np.dtype("int32") if functions is None
                              else functions.handle_dtype)
    words, handles = _array("int64"), types.Array(handle, 1, "C")
    header, byte = _array("uint8", readonly=True), _array("uint8")
    size = types.int64
    found: dict[str, list[Specialization]] = {"": [
        (_compiled_steps.exchange, (words, handle, handle, words, words, byte, size, byte,
                                    size, size, byte, byte)),
        (_compiled_riding.broadcast_held, (words, handles, words, header, byte, byte)),
        (_compiled_riding.broadcast_held, (words, handles, words, header, header, byte)),
        (_compiled_riding.gather_held, (words, handles, words, byte, header, byte, byte)),
        (_compiled_checked.checked_collective_call, (words, handles, words, words, header,
                                                     header, header)),
        (_pairwise.through_mailboxes, (words, words, size, header, words, types.boolean,
                                       header, words)),
        (_mailboxes.mailbox_send, (words, words, size, byte, size, size)),
        (_mailboxes.mailbox_receive, (words, words, size, byte, size)),
        *[(_p2p_compiled._send_steps, (byte, handles, template, byte, types.boolean, size,
                                       size, size, size)) for template in (header, byte)],
        *[(_p2p_compiled._receive_steps, (byte, handles, expected, byte, size, size, size))
          for expected in (header, byte)],
        (_p2p_compiled._test_requests, (words,)),
        (_p2p_compiled._receive_matched, (byte, handles, byte)),
        (_p2p_compiled._send_planned, (handles, words, byte, byte, size)),
        (_p2p_compiled._receive_planned, (handles, words, byte, byte)),
    ]}
    for name in PAYLOAD_DTYPES:
        data = _array(name)
        factors = _array("float32") if name == "uint16" else data
        found[name] = [
            (_compiled_steps.exchange, (words, handle, handle, words, words, byte, size, byte,
                                        size, size, data, data)),
            (_compiled_steps._reduce, (words, handle, handle, words, words, byte, size, byte,
                                       size, header, factors, data, data)),
            (_compiled_steps.reduce_planned, (words, handles, header, factors, data, data)),
            (_compiled_steps.reduce_segments, (words, handle, handle, data, byte, size, size)),
            (_compiled_ring._checked_ring, (words, handles, words, factors, data, words,
                                            header, data, data)),
            (_compiled_ring._ring_steps, (words, handles, factors, data, data, data, size)),
        ]
        if name != "uint16":
            found[name] += [
                (_compiled_checked.checked_collective_call, (words, handles, words, words,
                                                             header, data, data)),
                (_pairwise.through_mailboxes, (words, words, size, data, words, types.boolean,
                                               data, words))]
        if name.startswith("float"):
            found[name] += [(adasum._sums, (data, data)),
                            (adasum._scaled_add, (data, types.float64, data, types.float64))]
    return found


def compile_all(shares: Sequence[str]) -> int:
    """Compile (or load from the cache) every specialization of ``shares`` (payload
    dtypes, ``""`` for those of no payload dtype, :data:`HOST_KERNELS`); the number of
    the collectives' specializations compiled rather than loaded."""
    compiled = 0
    listed = specializations()
    for share in shares:
        if share == HOST_KERNELS:
            from ..kernels import host
            host.compile_every_kernel()
            continue
        for function, argument_types in listed[share]:
            misses = sum(function.stats.cache_misses.values())
            function.compile(argument_types)
            compiled += sum(function.stats.cache_misses.values()) - misses
    return compiled


def shares(processes: int) -> list[list[str]]:
    """What each of ``processes`` compiles: the specializations of one dtype share their
    callees, so they stay in one process."""
    loads = {dtype: len(listed) for dtype, listed in specializations().items()}
    loads[HOST_KERNELS] = _HOST_KERNELS_LOAD
    parts: list[list[str]] = [[] for _ in range(max(1, processes))]
    totals = [0] * len(parts)
    for share in sorted(loads, key=lambda share: -loads[share]):
        least = totals.index(min(totals))
        parts[least].append(share)
        totals[least] += loads[share]
    return [part for part in parts if part]


def warm_up(processes: int | None = None) -> None:
    """Compile every specialization into numba's cache, in ``processes`` processes at
    once (default: the CPUs this process may run on).

    Raises:
        RuntimeError: a process failed (its output is in the message).
    """
    count = processes or len(os.sched_getaffinity(0))
    started = [subprocess.Popen([sys.executable, "-m", _MODULE, "--dtypes", *part],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for part in shares(count)]
    failures = []
    for process in started:
        output, _ = process.communicate()
        if process.returncode != 0:
            failures.append(output[-3000:])
    if failures:
        raise RuntimeError("compiling the collectives failed:\n" + "\n".join(failures))


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ringtrain.collectives.warm_up``: see the module's documentation."""
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=None,
                        help="processes compiling at once (default: one per CPU)")
    parser.add_argument("--dtypes", nargs="*", default=None, help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.dtypes is not None:
        print(f"compiled {compile_all(arguments.dtypes)}")
        return
    warm_up(arguments.processes)


if __name__ == "__main__":
    main()
