"""The compiled exchange's parts that one process can check: MPI functions found and
called from compiled code, handles, which payloads it combines, and turning it off.
(tests/mpi/allreduce.py checks its results against numpy and the Python exchange.)"""

from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys
import time
from types import SimpleNamespace

import numba
import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.collectives.transport._compiled_exchange import compiled_exchange
from ringtrain.collectives.transport._compiled_steps import payload_code
from ringtrain.collectives.transport._c_calls import (NO_STAMPS, call_c, load_mpi_functions,
                                                      new_stamps, stamp, stamped_seconds)
from ringtrain.collectives.warm_up import PAYLOAD_DTYPES
from ringtrain.kernels import BFLOAT16, reducer


@numba.njit(cache=False)
def _call_with_int32(address, value):
    return call_c(address, (np.int32(value),))


@numba.njit(cache=False)
def _stamp_twice(stamps):
    stamp(stamps, 0)
    stamp(stamps, 1)


def test_stamps_take_the_monotonic_clock_and_no_stamps_take_nothing():
    stamps = new_stamps(2)
    _stamp_twice(stamps)  # compiled first
    before = time.clock_gettime(time.CLOCK_MONOTONIC)
    _stamp_twice(stamps)
    after = time.clock_gettime(time.CLOCK_MONOTONIC)
    first, second = stamped_seconds(stamps)
    assert before <= first <= second <= after
    _stamp_twice(NO_STAMPS)
    assert NO_STAMPS.tolist() == [0]


def test_call_c_calls_the_function_at_an_address():
    labs = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value
    assert _call_with_int32(labs, -7) == 7
    assert _call_with_int32(labs, 12) == 12


def test_the_mpi_library_functions_are_found():
    functions, reason = load_mpi_functions()
    assert functions is not None, reason
    addresses = [getattr(functions, field.name) for field in dataclasses.fields(functions)
                 if field.name.islower() and field.type == "int" and
                 field.name != "status_bytes"]
    assert len(addresses) == 15 and all(addresses), addresses
    assert functions.status_bytes == MPI._sizeof(MPI.Status)


@pytest.mark.parametrize("mpi_object", [MPI.COMM_WORLD, MPI.COMM_SELF, MPI.BYTE])
def test_handles_keep_their_bits_at_the_c_width(mpi_object):
    functions, _ = load_mpi_functions()
    handle = functions.handle(mpi_object)
    width = 8 * functions.handle_dtype.itemsize
    assert handle.dtype == functions.handle_dtype
    assert int(handle) % (1 << width) == MPI._handleof(mpi_object) % (1 << width)


def test_payload_codes_cover_numpy_and_16_bit_combinations_and_nothing_else():
    native = [np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64]
    ufuncs = (np.add, np.minimum, np.maximum, np.multiply)
    for f in ufuncs:
        assert len({payload_code(np.dtype(t), f) for t in native}) == 1, f
    codes = {payload_code(np.dtype(np.float32), f) for f in ufuncs}
    assert None not in codes and len(codes) == len(ufuncs)
    assert payload_code(np.dtype(np.uint8), np.bitwise_or) not in codes
    assert payload_code(np.dtype(np.float16), np.add) is None
    assert payload_code(np.dtype(np.float32), np.subtract) is None
    sixteen = {payload_code(dtype, reducer(op, dtype)) for op in ("sum", "min", "max", "product")
               for dtype in (np.dtype(np.float16), BFLOAT16)}
    assert None not in sixteen and len(sixteen) == 8 and not sixteen & codes


def _group_of_two(rank: int) -> SimpleNamespace:
    """What the exchange reads of a group (MPI is not initialized in this process)."""
    return SimpleNamespace(state={}, rank=rank, size=2, comm=MPI.COMM_WORLD)


def test_turned_off_the_agreement_uses_the_python_exchange(monkeypatch):
    monkeypatch.setenv("RINGTRAIN_COMPILED_EXCHANGE", "0")
    assert compiled_exchange(_group_of_two(0), 16, 40) is None
    monkeypatch.setenv("RINGTRAIN_COMPILED_EXCHANGE", "1")
    assert compiled_exchange(_group_of_two(1), 16, 40) is not None


@pytest.mark.processes
def test_every_specialization_compiles_to_the_disk_cache():
    """Compiled once (the session's warm-up, :mod:`ringtrain.collectives.warm_up`, did),
    every specialization loads from numba's disk cache in the next process: numba warns
    when a function cannot be cached, and compiles one again at every start whose cache
    key differs between processes."""
    probe = """
import warnings
import mpi4py
mpi4py.rc.initialize = False
from numba.core.errors import NumbaWarning
warnings.simplefilter("error", NumbaWarning)
from ringtrain.collectives import warm_up
shares = [share for part in warm_up.shares(1) for share in part]
print("compiled", warm_up.compile_all(shares), "of", len(shares), "shares")
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    every_share = len(PAYLOAD_DTYPES) + 2  # and the 16-bit kernels, and no payload dtype
    assert result.stdout.split() == ["compiled", "0", "of", str(every_share), "shares"], \
        result.stdout
