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


def test_payload_codes_cover_numpy_combinations_and_nothing_else():
    native = [np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64]
    ufuncs = (np.add, np.minimum, np.maximum, np.multiply)
    for f in ufuncs:
        assert len({payload_code(np.dtype(t), f) for t in native}) == 1, f
    codes = {payload_code(np.dtype(np.float32), f) for f in ufuncs}
    assert None not in codes and len(codes) == len(ufuncs)
    assert payload_code(np.dtype(np.uint8), np.bitwise_or) not in codes
    assert payload_code(np.dtype(np.float16), np.add) is None
    assert payload_code(np.dtype(np.float32), np.subtract) is None
    assert payload_code(BFLOAT16, reducer("sum", BFLOAT16)) is None


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
    """numba warns, and compiles again at every start, when a function cannot be cached;
    this also fills the cache before the multi-rank tests (it runs before them)."""
    probe = """
import warnings
from types import SimpleNamespace
import mpi4py
mpi4py.rc.initialize = False
import numpy as np
from mpi4py import MPI
from numba.core.errors import NumbaWarning
warnings.simplefilter("error", NumbaWarning)
from ringtrain.collectives.transport._compiled_exchange import compiled_exchange
from ringtrain.collectives.transport._compiled_steps import HEADERS, PAYLOADS, payload_code
alone = SimpleNamespace(state={}, rank=0, size=1, comm=MPI.COMM_WORLD)
exchange = compiled_exchange(alone, 16, 40)
message, receive = np.zeros(104, np.uint8), np.zeros(1024, np.uint8)
exchange.run(message, 40, receive, HEADERS)
header = np.frombuffer(bytes(40), np.uint8)
for dtype in (np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64):
    exchange.run(message, 104, receive, PAYLOADS, payload_code(np.dtype(dtype), np.add),
                 message[40:].view(dtype), receive[40:104].view(dtype))
    values = np.ones(8 // np.dtype(dtype).itemsize, dtype)
    reduce = exchange.reduction(message, 48, receive, payload_code(np.dtype(dtype), np.add))
    assert reduce(header, np.ones(3, dtype), values, values) == 0
# The mailboxes' steps (the exchange above compiled them for a group without them).
from ringtrain.collectives.transport._mailboxes import (box_words, mailbox_receive, mailbox_send,
                                                        new_counters)
boxes, counters = np.zeros(box_words(1), np.int64), new_counters(0, 1)
mailbox_send(boxes, counters, 0, message, 8, 0)
mailbox_receive(boxes, counters, 0, receive, 0)
# The point-to-point steps, compiled for the arguments they are given (a header template
# and an expected header are read-only bytes).
import numba
from ringtrain.collectives.p2p import _p2p_compiled as steps
from ringtrain.collectives.transport._c_calls import load_mpi_functions
from ringtrain.collectives.p2p._p2p_header import expected_header, header_template
work, data = np.zeros(steps.AREA_BYTES + 1024, np.uint8), np.zeros(8, np.uint8)
handles = np.zeros(3, load_mpi_functions()[0].handle_dtype)
template = header_template(True, np.dtype(np.uint8), (8,), None)
expected = expected_header(True, np.dtype(np.uint8), (8,), None)
for function, arguments in [
        (steps._send_steps, (work, handles, template, data, True, 1, 2, 3, 4)),
        (steps._receive_steps, (work, handles, expected, data, 1, 2, 3)),
        (steps._receive_matched, (work, handles, data)),
        (steps._send_planned, (handles, np.zeros(6, np.int64), work, data, 3)),
        (steps._receive_planned, (handles, np.zeros(5, np.int64), work, data))]:
    function.compile(tuple(numba.typeof(argument) for argument in arguments))
print("cached")
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "cached", result.stderr[-3000:]
