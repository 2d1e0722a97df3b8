"""C functions called from Numba-compiled code: the MPI library's, and the C library's
clock, to time phases inside a compiled call (:func:`stamp`).

Compiled code (:mod:`._compiled_steps`, :mod:`..p2p._p2p_compiled`) calls the MPI
library mpi4py loaded, found through mpi4py's own extension module, so that its
functions and mpi4py's handles (``MPI._handleof``) belong to one library. The functions
reach compiled code as addresses, arguments like any other, and are called through
:func:`call_c`: nothing in the compiled code depends on where this process loaded the
library, so it is cached on disk like the kernels.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import types
from numba.extending import intrinsic

from ...common.environment import COMPILED_EXCHANGE
from ..logs import LOGGER

_HANDLE_DTYPES = {4: np.dtype(np.int32), 8: np.dtype(np.int64)}


@intrinsic
def call_c(typingctx: Any, address: Any, arguments: Any) -> Any:
    """``call_c(address, (arg, ...))`` in compiled code: call the C function at
    ``address`` (an integer) with the arguments of the tuple, typed as they are (cast
    each to the C parameter's width first), and return its ``int`` result."""
    if not isinstance(address, types.Integer) or not isinstance(arguments, types.BaseTuple):
        return None

    def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
        address_value, argument_tuple = values
        argument_types = signature.args[1].types
        function_type = ir.FunctionType(
            ir.IntType(32), [context.get_value_type(t) for t in argument_types])
        function = builder.inttoptr(address_value, function_type.as_pointer())
        return builder.call(function, [builder.extract_value(argument_tuple, i)
                                       for i in range(len(argument_types))])

    return types.int32(address, arguments), codegen


@intrinsic
def void_pointer(typingctx: Any, address: Any) -> Any:
    """``void_pointer(address)`` in compiled code: the integer ``address`` as a ``void *``
    (for ``numba.carray``)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, values: Any) -> Any:
        return builder.inttoptr(values[0], ir.IntType(8).as_pointer())

    return types.voidptr(address), codegen


@numba.njit(cache=True, nogil=True)
def copy_bytes(destination: int, source: int, count: int) -> None:
    """Copy ``count`` bytes from address ``source`` to address ``destination`` (apart),
    as fast as memcpy: a slice assignment in compiled code moves one byte at a time."""
    into = numba.carray(void_pointer(destination), count, np.uint8)
    out_of = numba.carray(void_pointer(source), count, np.uint8)
    for i in range(count):
        into[i] = out_of[i]


@dataclass(frozen=True)
class MpiFunctions:
    """The MPI library's functions that compiled code calls, as addresses.

    Attributes:
        sendrecv, send, recv, isend, irecv, testall, iprobe, improbe, mrecv, get_count,
        allreduce, bcast, reduce_scatter_block, allgather, alltoall: ``MPI_Sendrecv``,
            ``MPI_Send``, and so on.
        handle_dtype: the C type of the library's handles (``int`` in MPICH, a pointer
            in Open MPI), as which handles are passed.
        status_bytes: the size of an ``MPI_Status``.
    """

    sendrecv: int
    send: int
    recv: int
    isend: int
    irecv: int
    testall: int
    iprobe: int
    improbe: int
    mrecv: int
    get_count: int
    allreduce: int
    bcast: int
    reduce_scatter_block: int
    allgather: int
    alltoall: int
    handle_dtype: np.dtype
    status_bytes: int

    def handle(self, mpi_object: Any) -> Any:
        """``mpi_object``'s C handle (a communicator, a datatype) as a signed scalar of
        :attr:`handle_dtype`."""
        bits = 8 * self.handle_dtype.itemsize
        value = MPI._handleof(mpi_object) & ((1 << bits) - 1)
        return self.handle_dtype.type(value - (1 << bits) if value >> (bits - 1) else value)


def load_mpi_functions() -> tuple[MpiFunctions | None, str]:
    """The MPI library's functions for compiled code, or None and why they cannot be had."""
    handle_dtype = _HANDLE_DTYPES.get(MPI._sizeof(MPI.Comm))
    if handle_dtype is None or MPI._sizeof(MPI.Datatype) != handle_dtype.itemsize:
        return None, (f"MPI handles of {MPI._sizeof(MPI.Comm)} bytes are not ones compiled "
                      f"code can pass")
    # Every field but the last two (handle_dtype, status_bytes) names a function.
    names = [field.name for field in dataclasses.fields(MpiFunctions)][:-2]
    try:
        library = ctypes.CDLL(MPI.__file__)
        addresses = [ctypes.cast(getattr(library, "MPI_" + name.capitalize()),
                                 ctypes.c_void_p).value for name in names]
    except (OSError, AttributeError) as error:
        return None, f"the MPI library's functions cannot be found: {error}"
    return MpiFunctions(*addresses, handle_dtype, MPI._sizeof(MPI.Status)), "found"


@functools.cache
def _found_mpi_functions() -> MpiFunctions | None:
    functions, reason = load_mpi_functions()
    if functions is None:
        LOGGER.debug("the agreement's exchange and blocking point-to-point messages run "
                     "in Python: %s", reason)
    return functions


def mpi_functions() -> MpiFunctions | None:
    """The MPI library's functions for compiled code, or None where
    ``RINGTRAIN_COMPILED_EXCHANGE`` turns compiled calls off or they cannot be found
    (then said once, at DEBUG level)."""
    return _found_mpi_functions() if COMPILED_EXCHANGE.read() else None


_CLOCK = time.CLOCK_MONOTONIC


@functools.cache
def clock_address() -> int:
    """The address of the C library's ``clock_gettime``, for :func:`stamp`."""
    return ctypes.cast(ctypes.CDLL(None).clock_gettime, ctypes.c_void_p).value


def new_stamps(count: int) -> np.ndarray:
    """Room for ``count`` times of :func:`stamp`, taken (see :func:`stamped_seconds`)."""
    stamps = np.zeros(1 + 2 * count, np.int64)
    stamps[0] = clock_address()
    return stamps


NO_STAMPS = np.zeros(1, np.int64)
"""Stamps that :func:`stamp` leaves alone: a compiled call not traced."""


@numba.njit(cache=True, nogil=True, inline="always")
def stamp(stamps, index: int) -> None:
    """Write the monotonic clock's time as time number ``index`` of ``stamps`` (made by
    :func:`new_stamps`; :data:`NO_STAMPS`: nothing)."""
    if stamps[0] != 0:
        call_c(stamps[0], (np.int32(_CLOCK), stamps.ctypes.data + 8 * (1 + 2 * index)))


def stamped_seconds(stamps: np.ndarray) -> list[float]:
    """The times that :func:`stamp` wrote, in seconds of ``time.clock_gettime``'s
    monotonic clock."""
    words = stamps.tolist()
    return [words[i] + words[i + 1] * 1e-9 for i in range(1, len(words), 2)]
