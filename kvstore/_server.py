"""An async-mode server rank: holds its parts of the keys and applies each push as it
arrives, until every worker has closed its store.

Requests are received from any worker in arrival order (``Recv(ANY_SOURCE)``), one at a
time, so each push of a part is applied whole and exactly once, and a pull returns the
value after the pushes that arrived before it. A server needs no thread and no
asynchronous progress: it is always inside MPI, waiting for the next request.

An error while serving (an optimizer that raises, a message that makes no sense) would
leave workers waiting for replies that never come: the server prints it, naming its
rank, the operation and the key, and aborts the job.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from ..kernels.two_bit import words_for
from . import _protocol as protocol
from ._compression import decompress
from ._table import Table


def as_bytes(array: np.ndarray) -> Any:
    """A contiguous array's memory as an MPI byte buffer (bfloat16 and 0-d included)."""
    return [array.reshape(-1).view(np.uint8), MPI.BYTE]


class Server:
    """The server loop of one server rank.

    Args:
        comm: the store's communicator (workers first, then the servers).
        num_workers: how many workers must close before the loop ends.
    """

    def __init__(self, comm: MPI.Comm, num_workers: int):
        self.comm = comm
        self.num_workers = num_workers
        self.table = Table()
        self.meta: dict[tuple[int, int], tuple[Any, int, int]] = {}  # key, start, stop
        self.pushes = 0

    def serve(self) -> int:
        """Serve until every worker has stopped; the number of pushes applied."""
        head = np.empty(4, np.int64)
        status = MPI.Status()
        stopped = 0
        while stopped < self.num_workers:
            self.comm.Recv(head, MPI.ANY_SOURCE, protocol.REQUEST, status)
            operation, key_index, part, argument = (int(x) for x in head)
            source = status.Get_source()
            if operation == protocol.STOP:
                stopped += 1
                continue
            try:
                self._handle(operation, (key_index, part), argument, source)
            except Exception:  # reported, then the job ends: workers would wait forever
                self._abort(operation, (key_index, part), source)
        return self.pushes

    def _handle(self, operation: int, slot: tuple[int, int], argument: int,
                source: int) -> None:
        if operation == protocol.PUSH:
            self._push(slot, argument, source)
        elif operation == protocol.PULL:
            self.comm.Send(as_bytes(self.table.values[slot]), source, protocol.REPLY)
        elif operation == protocol.INIT:
            key, start, stop, dtype = self.comm.recv(source=source, tag=protocol.DATA)
            value = np.empty(stop - start, dtype)
            self.comm.Recv(as_bytes(value), source, protocol.DATA)
            self.table.values[slot] = value
            self.meta[slot] = (key, start, stop)
            self.comm.send(None, source, protocol.REPLY)
        elif operation == protocol.SET_OPTIMIZER:
            self.table.optimizer = pickle.loads(self.comm.recv(source=source,
                                                               tag=protocol.DATA))
            self.comm.send(None, source, protocol.REPLY)
        elif operation == protocol.GET_STATES:
            self.comm.send({self.meta[s]: state for s, state in self.table.states.items()},
                           source, protocol.REPLY)
        elif operation == protocol.SET_STATES:
            states = self.comm.recv(source=source, tag=protocol.DATA)
            self.table.states = {slot: states[where] for slot, where in self.meta.items()
                                 if where in states}
            self.comm.send(None, source, protocol.REPLY)
        else:
            raise ValueError(f"unknown request {operation}")

    def _push(self, slot: tuple[int, int], argument: int, source: int) -> None:
        value = self.table.values[slot]
        if argument:
            words = np.empty(words_for(value.size), np.uint32)
            self.comm.Recv(as_bytes(words), source, protocol.DATA)
            grad = decompress(words, value.size, protocol.threshold_of(argument))
        else:
            grad = np.empty_like(value)
            self.comm.Recv(as_bytes(grad), source, protocol.DATA)
        self.table.apply(slot, grad, index=self.meta[slot][0])
        self.pushes += 1

    def _abort(self, operation: int, slot: tuple[int, int], source: int) -> None:
        key = self.meta.get(slot, (f"(index {slot[0]})",))[0]
        sys.stderr.write(f"kvstore server rank {MPI.COMM_WORLD.Get_rank()}: "
                         f"{protocol.NAMES.get(operation, operation)} of key {key!r} from "
                         f"worker {source} failed; ending the job\n")
        sys.stderr.flush()
        # ringtrain-run's hook passes the traceback on and ends the job itself; an abort
        # at once could end the job before the output reached the terminal.
        sys.excepthook(*sys.exc_info())
        MPI.COMM_WORLD.Abort(1)
