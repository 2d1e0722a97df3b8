"""What one collective at one size needs: buffers, the calls of each algorithm, the check.

Sizes follow nccl-tests: ``size`` bytes is the whole buffer of an allreduce or a
broadcast, the whole gathered output of an allgather, the whole input of a reducescatter
and the whole send buffer of an alltoall (counts rounded down to a multiple of the number
of ranks where each rank owns an equal part).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from mpi4py import MPI
import numpy as np

from ... import collectives as rt
from ...kernels import BFLOAT16, bits, is_floating
from .devices import DeviceArrays
from .options import NATIVE, REDUCING, Options

BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "allgather": lambda p: (p - 1) / p,
    "reducescatter": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
}
"""busbw = algbw * factor: comparable with one link's peak whatever the number of ranks."""

PARTITIONED = ("allgather", "reducescatter", "alltoall")

RINGTRAIN_OPS = {"sum": rt.Sum, "prod": rt.Product, "max": rt.Max, "min": rt.Min,
                 "avg": rt.Average, "adasum": rt.Adasum}
MPI_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN, "avg": MPI.SUM,
           "adasum": MPI.SUM}
"""MPI has no Adasum: the baseline of ``-o adasum`` is MPI's sum of the same buffer."""

Call = Callable[[], Any]
"""One call of a collective; returns its result (a numpy array, or a device array)."""

HOST = "host"
CUDA = "cuda"
"""Where a variant's buffers are: host memory (numpy) or GPU memory."""
DEVICE_ONLY = ("ipc",)
"""Algorithms of GPU buffers alone."""


class Variant(NamedTuple):
    """One measured line of the table: an algorithm on buffers in ``memory``."""

    algorithm: str
    memory: str


def variants(options: Options) -> list[Variant]:
    """What a size is measured with, in table order: each algorithm on host buffers, and
    for ``--device cuda`` each ringtrain algorithm first on GPU buffers (``native``, MPI's
    own collective, only on host buffers; ``ipc`` only on GPU buffers)."""
    found = []
    for algorithm in options.algorithms:
        if options.device == CUDA and algorithm != NATIVE:
            found.append(Variant(algorithm, CUDA))
        if algorithm not in DEVICE_ONLY:
            found.append(Variant(algorithm, HOST))
    return found


def native_runs(options: Options) -> bool:
    """Whether MPI's own collective can run the measured call: MPI has no bfloat16, so
    it cannot reduce one (its column shows n/a); copies move the bits."""
    return options.dtype != BFLOAT16 or options.collective not in REDUCING


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``collective`` on ``ranks`` ranks."""
    return BUS_FACTORS[collective](ranks)


def element_count(collective: str, nbytes: int, itemsize: int, ranks: int) -> int:
    """Elements in a ``nbytes`` message (nccl-tests' convention for ``collective``)."""
    count = nbytes // itemsize
    if collective in PARTITIONED:
        count -= count % ranks
    return count


def check_input(rank: int, count: int, dtype: np.dtype, op: str, ranks: int = 1) -> np.ndarray:
    """Rank ``rank``'s values for the correctness check: small integers, so sums,
    products, minima and maxima over a few ranks are exact in every datatype. For
    ``adasum``, rank r of ``ranks`` fills only the elements i with i % ranks == r: the
    vectors (and the partial results of the tree) are orthogonal, so their Adasum is
    their sum, which MPI's sum also gives."""
    index = np.arange(count)
    if op == "prod":
        return ((rank + index) % 2 + 1).astype(dtype)
    values = (rank * 7 + index) % 5 + 1
    if op == "adasum":
        values = values * (index % ranks == rank)
    return values.astype(dtype)


class Case:
    """One collective at one size: its buffers, its calls and their reference results."""

    def __init__(self, options: Options, nbytes: int, comm: MPI.Comm,
                 device: DeviceArrays | None = None):
        self.options = options
        self.device = device
        self.comm = comm
        self.rank, self.ranks = comm.Get_rank(), comm.Get_size()
        self.count = element_count(options.collective, nbytes, options.dtype.itemsize,
                                   self.ranks)
        self.part = self.count // self.ranks
        send_count = self.part if options.collective == "allgather" else self.count
        out_count = self.part if options.collective == "reducescatter" else self.count
        self.send = check_input(self.rank, send_count, options.dtype, options.op, self.ranks)
        self.out = np.zeros(out_count, options.dtype)
        self.work = self._timing_values(self.send)
        self.compression = getattr(rt.Compression, options.compression)
        if device is not None:
            self.device_send = device.from_host(self.send)
            self.device_work = device.from_host(self.work)
            device.synchronize()

    @property
    def in_place(self) -> bool:
        """Whether the collective has an in-place form (ringtrain's ``_`` functions)."""
        return self.options.collective in ("allreduce", "broadcast")

    def _timing_values(self, send: np.ndarray) -> np.ndarray:
        # In place, a buffer is reduced again and again: values that the op maps to
        # themselves keep it from overflowing (adasum's baseline is MPI's sum).
        if self.options.op in ("sum", "avg", "adasum"):
            return np.zeros_like(send)
        if self.options.op == "prod":
            return np.ones_like(send)
        return send.copy()

    def reset(self) -> None:
        """Put the check inputs into the in-place buffers (timing overwrote them)."""
        self.work[...] = self.send
        self.out[...] = 0
        if self.device is not None:
            self.device.copy_from_host(self.send, self.device_work)
            self.device.synchronize()

    def call(self, algorithm: str, in_place: bool, memory: str = HOST) -> Call | None:
        """One call of the collective with ``algorithm`` on the buffers in ``memory``,
        returning its result array; None where MPI's own cannot make it (see
        :func:`native_runs`)."""
        if algorithm == NATIVE:
            return self._native(in_place) if native_runs(self.options) else None
        if memory == CUDA:
            if self.device is None:
                raise ValueError("this case has no GPU buffers")
            return self._ringtrain(algorithm, in_place, self.device_send, self.device_work)
        return self._ringtrain(algorithm, in_place, self.send, self.work)

    def ringtrain_call(self, algorithm: str, in_place: bool) -> Call:
        """One call of ringtrain's collective with ``algorithm`` on host buffers
        (``native`` too: MPI's own collective behind ringtrain's agreement check)."""
        return self._ringtrain(algorithm, in_place, self.send, self.work)

    def host_copy(self, result: Any) -> np.ndarray:
        """A numpy copy of a call's result, fetched from the GPU if it is there."""
        if isinstance(result, np.ndarray):
            return result.copy()
        if self.device is None:
            raise TypeError(f"not a numpy array: {type(result).__name__}")
        return self.device.to_host(result)

    def _ringtrain(self, algorithm: str, in_place: bool, send: Any, work: Any) -> Call:
        o = self.options
        op = RINGTRAIN_OPS[o.op]
        if o.collective == "allreduce":
            if in_place:
                return lambda: rt.allreduce_(work, op, algorithm=algorithm,
                                             compression=self.compression)
            return lambda: rt.allreduce(send, op, algorithm=algorithm,
                                        compression=self.compression)
        if o.collective == "broadcast":
            if in_place:
                return lambda: rt.broadcast_(work, o.root, algorithm=algorithm)
            return lambda: rt.broadcast(send, o.root, algorithm=algorithm)
        if o.collective == "allgather":
            return lambda: rt.allgather(send, algorithm=algorithm)
        if o.collective == "reducescatter":
            return lambda: rt.reducescatter(send, op, algorithm=algorithm,
                                            compression=self.compression)
        return lambda: rt.alltoall(send, algorithm=algorithm)[0]

    def _native(self, in_place: bool) -> Call:
        """MPI's own collective; bfloat16, which MPI lacks, moved as its bits."""
        call = self._mpi_call(in_place, *(bits(a) for a in (self.send, self.out, self.work)))
        if self.options.dtype != BFLOAT16:
            return call
        return lambda: call().view(BFLOAT16)

    def _mpi_call(self, in_place: bool, send: np.ndarray, out: np.ndarray,
                  work: np.ndarray) -> Call:
        o, comm = self.options, self.comm
        mpi_op, ranks = MPI_OPS[o.op], self.ranks
        average = o.op == "avg"

        def averaged(result: np.ndarray) -> np.ndarray:
            if average:
                np.divide(result, ranks, out=result)
            return result

        if o.collective == "allreduce":
            if in_place:
                return lambda: averaged(_done(comm.Allreduce(MPI.IN_PLACE, work, mpi_op), work))
            return lambda: averaged(_done(comm.Allreduce(send, out, mpi_op), out))
        if o.collective == "broadcast":
            if in_place:
                return lambda: _done(comm.Bcast(work, o.root), work)

            def broadcast_out_of_place() -> np.ndarray:
                if self.rank != o.root:
                    comm.Bcast(out, o.root)
                    return out
                # From the input, then the copy: the others read bytes not just written.
                comm.Bcast(send, o.root)
                out[...] = send
                return out

            return broadcast_out_of_place
        if o.collective == "allgather":
            return lambda: _done(comm.Allgather(send, out), out)
        if o.collective == "reducescatter":
            return lambda: averaged(_done(comm.Reduce_scatter_block(send, out, mpi_op), out))
        return lambda: _done(comm.Alltoall(send, out), out)

    def expected(self) -> np.ndarray:
        """This rank's correct result for the check inputs, as float64."""
        o, ranks, rank = self.options, self.ranks, self.rank
        if o.collective == "broadcast":
            return check_input(o.root, self.count, np.float64, o.op)
        if o.collective == "allgather":
            return np.concatenate([check_input(r, self.part, np.float64, o.op)
                                   for r in range(ranks)])
        inputs = np.array([check_input(r, self.count, np.float64, o.op, ranks)
                           for r in range(ranks)]).reshape(ranks, self.count)
        if o.collective == "alltoall":
            return inputs[:, rank * self.part:(rank + 1) * self.part].reshape(-1)
        reduced = {"sum": np.sum, "avg": np.sum, "prod": np.prod, "max": np.max,
                   "min": np.min, "adasum": np.sum}[o.op](inputs, axis=0)
        if o.op == "avg":
            reduced = reduced / ranks
        if o.collective == "reducescatter":
            return reduced[rank * self.part:(rank + 1) * self.part]
        return reduced

    def wrong(self, result: np.ndarray) -> int:
        """Elements of ``result`` that differ from :meth:`expected` beyond rounding."""
        expected = self.expected()
        actual = np.asarray(result, np.float64).reshape(-1)
        if actual.shape != expected.shape:
            return max(actual.size, expected.size)
        if not is_floating(self.options.dtype):
            return int(np.count_nonzero(actual != expected))
        relative = {np.dtype(np.float16): 1e-3, BFLOAT16: 2.0 ** -7,
                    np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-12}[self.options.dtype]
        if self.options.compression != "none":
            relative = self.ranks * (2.0 ** -10 if self.options.compression == "fp16"
                                     else 2.0 ** -7)
        scale = float(np.abs(expected).max()) if expected.size else 0.0
        return int(np.count_nonzero(np.abs(actual - expected) > relative * scale))


def _done(_: Any, result: np.ndarray) -> np.ndarray:
    return result
