"""``dist_async`` and ``dist_device_async``: a worker's side of the parameter servers.

The store's own communicator is a duplicate of ``MPI.COMM_WORLD`` (never the
collectives' one): its first ranks are workers, its last ``num_servers`` ranks servers
(:mod:`._server`). Keys are placed by :func:`._protocol.parts`. A push sends each part to
its server and returns; a pull asks each server for its part and waits for the replies.
Workers never wait for each other, except in ``init``, ``set_optimizer`` and
``barrier``, which every worker calls: collectives of ringtrain over the workers' process
set (the servers not in it), so a worker that does not come is named by the stall
inspector, and a worker that calls something else gets a ``MismatchError``.
"""

from __future__ import annotations

import atexit
from typing import Any

import numpy as np
from mpi4py import MPI

from .. import collectives as rt
from ..collectives import InvalidArgumentError, MismatchError, RingtrainError, UsageError
from . import _protocol as protocol
from ._keys import Key
from ._server import Server, as_bytes
from ._store import KVStore
from ._table import pickled


def open_async(name: str, num_servers: int, bound: int) -> AsyncStore | int:
    """Every rank's part of an async store: a worker's :class:`AsyncStore`, or, on a
    server rank, serve until every worker has closed, then the pushes it applied."""
    if not rt.is_initialized():
        rt.init()
    world = MPI.COMM_WORLD
    if rt.size() != world.Get_size():
        raise UsageError(f"kvstore create({name!r}): the async modes take every rank of "
                         f"MPI.COMM_WORLD; ringtrain was started on {rt.size()} of its "
                         f"{world.Get_size()}")
    if num_servers >= world.Get_size():
        raise InvalidArgumentError(f"kvstore create({name!r}): {num_servers} server(s) need "
                                   f"at least {num_servers + 1} ranks, the job has "
                                   f"{world.Get_size()}")
    comm = world.Dup()
    first_server = comm.Get_size() - num_servers
    if comm.Get_rank() >= first_server:
        pushes = Server(comm, first_server).serve()
        comm.Free()
        return pushes
    workers = rt.add_process_set(range(first_server))
    return AsyncStore(name, comm, workers, first_server, bound)


class AsyncStore(KVStore):
    """A worker of an async mode (made by :func:`ringtrain.kvstore.create`)."""

    def __init__(self, name: str, comm: MPI.Comm, workers: rt.ProcessSet, num_workers: int,
                 bound: int):
        super().__init__()
        self.type = name
        self.on_device = name == "dist_device_async"
        self.rank = workers.rank()
        self.num_workers = num_workers
        self.num_servers = comm.Get_size() - num_workers
        self._comm = comm
        self._workers = workers
        self._bound = bound
        self._index: dict[Key, int] = {}
        self._parts: dict[Key, list[tuple[int, int, int]]] = {}
        self._closed = False
        atexit.register(self.close)

    # ------------------------------------------------------------ agreement

    def _agree(self, operation: str, description: dict[str, Any]) -> None:
        """Every worker made the same call, or a MismatchError on every worker."""
        everyone = rt.allgather_object(description, name=f"kvstore {operation}",
                                       process_set=self._workers)
        fields = sorted({field for d in everyone for field in d})
        differences = {field: {rank: d.get(field, "(absent)") for rank, d in enumerate(everyone)}
                       for field in fields
                       if len({repr(d.get(field, "(absent)")) for d in everyone}) > 1}
        if differences:
            raise MismatchError(f"kvstore {operation}", description.get("keys"), differences)

    def _refuse(self, operation: str, key: Any, error: RingtrainError) -> None:
        if operation == "init":
            try:
                self._agree("init", {"keys": repr(key), "refused": f"worker {self.rank}: "
                                                                   f"{error}"})
            except MismatchError:
                pass

    # ------------------------------------------------------------ the modes' steps

    def _init(self, items: list[tuple[Key, np.ndarray]]) -> None:
        self._agree("init", {"keys": repr([k for k, _ in items]),
                             "shapes": [list(v.shape) for _, v in items],
                             "dtypes": [str(v.dtype) for _, v in items]})
        for key, value in items:
            self._index[key] = len(self._index)
            self._parts[key] = protocol.parts(key, value.size, self.num_servers, self._bound)
        if self.rank == 0:
            waiting = []
            for key, value in items:
                flat = np.ascontiguousarray(value).reshape(-1)
                for part, (server, start, stop) in enumerate(self._parts[key]):
                    dest = self.num_workers + server
                    self._request(protocol.INIT, key, part, dest)
                    self._comm.send((key, start, stop, value.dtype), dest, protocol.DATA)
                    self._comm.Send(as_bytes(flat[start:stop]), dest, protocol.DATA)
                    waiting.append(dest)
            for dest in waiting:
                self._comm.recv(source=dest, tag=protocol.REPLY)
        rt.barrier(process_set=self._workers)

    def _request(self, operation: int, key: Key | None, part: int, dest: int,
                 argument: int = 0) -> None:
        index = 0 if key is None else self._index[key]
        self._comm.Send(protocol.header(operation, index, part, argument), dest,
                        protocol.REQUEST)

    def _push(self, items: list[tuple[Key, np.ndarray]]) -> None:
        self._check_open("push")
        for key, total in items:
            flat = np.ascontiguousarray(total).reshape(-1)
            for part, (server, start, stop) in enumerate(self._parts[key]):
                dest = self.num_workers + server
                if self._compression is None:
                    self._request(protocol.PUSH, key, part, dest)
                    self._comm.Send(as_bytes(flat[start:stop]), dest, protocol.DATA)
                    continue
                words = self._compression.compress((key, part), flat[start:stop], key)
                self._request(protocol.PUSH, key, part, dest,
                              protocol.threshold_argument(self._compression.threshold))
                self._comm.Send(as_bytes(words), dest, protocol.DATA)

    def _pull(self, keys: list[Key]) -> list[np.ndarray]:
        self._check_open("pull")
        values, receives = [], []
        for key in keys:
            shape, dtype = self._shapes[key]
            value = np.empty(shape, dtype)
            flat = value.reshape(-1)
            for part, (server, start, stop) in enumerate(self._parts[key]):
                self._request(protocol.PULL, key, part, self.num_workers + server)
                receives.append((flat[start:stop], self.num_workers + server))
            values.append(value)
        for buffer, source in receives:
            self._comm.Recv(as_bytes(buffer), source, protocol.REPLY)
        return values

    def _servers(self) -> range:
        return range(self.num_workers, self.num_workers + self.num_servers)

    def _set_optimizer(self, optimizer: Any) -> None:
        self._check_open("set_optimizer")
        self._agree("set_optimizer", {"optimizer": type(optimizer).__name__})
        if self.rank == 0:
            data = pickled(optimizer)
            for dest in self._servers():
                self._request(protocol.SET_OPTIMIZER, None, 0, dest)
                self._comm.send(data, dest, protocol.DATA)
            for dest in self._servers():
                self._comm.recv(source=dest, tag=protocol.REPLY)
        rt.barrier(process_set=self._workers)

    def _states(self) -> dict[Any, Any]:
        self._check_open("save_optimizer_states")
        states: dict[Any, Any] = {}
        for dest in self._servers():
            self._request(protocol.GET_STATES, None, 0, dest)
            states.update(self._comm.recv(source=dest, tag=protocol.REPLY))
        return states

    def _state_keys(self) -> set[Any]:
        return {(key, start, stop) for key, parts in self._parts.items()
                for _, start, stop in parts}

    def _load_states(self, states: dict[Any, Any]) -> None:
        self._check_open("load_optimizer_states")
        for dest in self._servers():
            self._request(protocol.SET_STATES, None, 0, dest)
            self._comm.send(states, dest, protocol.DATA)
        for dest in self._servers():
            self._comm.recv(source=dest, tag=protocol.REPLY)

    def barrier(self) -> None:
        """Wait for every worker (the servers are not part of it)."""
        self._check_open("barrier")
        rt.barrier(process_set=self._workers)

    def close(self) -> None:
        """Tell the servers this worker is done (at exit at the latest); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for dest in self._servers():
            self._request(protocol.STOP, None, 0, dest)
        if rt.is_initialized():
            rt.remove_process_set(self._workers)
        self._comm.Free()

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise UsageError(f"kvstore {operation}: the store was closed")
