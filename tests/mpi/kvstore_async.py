"""The KVStore's async modes: server ranks, key sharding, big arrays split across the
servers, pushes applied exactly once in arrival order, workers that never wait for a
slow one; on any number of ranks, with 1 and 2 servers.

Every rank runs each check: on the last ``servers`` ranks ``create`` serves until the
workers have closed their stores (``exit_server=False``: it then returns None).

Run: mpiexec -n K python tests/mpi/kvstore_async.py [--only SUBSTRING]
"""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from ml_dtypes import bfloat16
from mpi4py import MPI

import ringtrain as rt
from _harness import check, expect_raises, main
from kvstore_model import adam_reference, two_bit_model
from ringtrain import kvstore

WORLD = MPI.COMM_WORLD
MODES = ["dist_async", "dist_device_async"]
DTYPES = [np.dtype(t) for t in (np.float16, bfloat16, np.float32, np.float64, np.int8, np.uint8,
                                np.int16, np.int32, np.int64)]


def server_counts() -> list[int]:
    """1 server, and 2 where that leaves a worker."""
    return [k for k in (1, 2) if k < WORLD.Get_size()]


def accumulate(key, grad, weight):
    """MXNet's updater form: each push is added to the held value."""
    weight += grad.astype(weight.dtype)


def value(rank: int, shape: tuple[int, ...], dtype, salt: int = 0) -> np.ndarray:
    count = int(np.prod(shape))
    return ((rank + 1) * ((np.arange(count) + salt) % 5 + 1)).reshape(shape).astype(dtype)


def exact(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    assert np.array_equal(actual.astype(np.float64), expected.astype(np.float64)), \
        f"{what}: {actual.reshape(-1)[:8]} != {expected.reshape(-1)[:8]}"


def stores(min_servers: int = 1, min_workers: int = 1, **options):
    """(mode, servers, store) on the workers for every mode and server count (with at
    least that many servers and workers); a server rank serves each store meanwhile. Each
    store ends with a barrier and is closed."""
    for mode in MODES:
        for servers in server_counts():
            kv = kvstore.create(mode, num_servers=servers, exit_server=False, **options)
            if kv is None:
                continue
            with kv:
                if servers >= min_servers and kv.num_workers >= min_workers:
                    yield mode, servers, kv
                    kv.barrier()


@check
def one_rank_cannot_be_worker_and_server():
    if WORLD.Get_size() == 1:
        expect_raises(rt.InvalidArgumentError, kvstore.create, "dist_async",
                      match=["1 server(s)", "at least 2 ranks"])


@check(min_size=2)
def pushes_of_every_worker_are_summed_by_the_servers():
    for mode, servers, kv in stores():
        assert kv.num_workers == WORLD.Get_size() - servers and kv.type == mode
        assert kv.rank == WORLD.Get_rank()
        kv.set_optimizer(accumulate)
        keys = [f"k{d}" for d in range(len(DTYPES))] + [5, 6]
        shapes = [(7,)] * len(DTYPES) + [(3, 5), ()]
        dtypes = DTYPES + [np.float32, np.int32]
        kv.init(keys, [np.zeros(s, d) for s, d in zip(shapes, dtypes)])
        kv.push(keys, [[value(kv.rank, s, d), value(kv.rank, s, d, 1)]
                       for s, d in zip(shapes, dtypes)])
        kv.barrier()
        outs = [np.empty(s, d) for s, d in zip(shapes, dtypes)]
        kv.pull(keys, out=outs)
        for k, s, d, out in zip(keys, shapes, dtypes, outs):
            expected = sum(value(r, s, np.float64) + value(r, s, np.float64, 1)
                           for r in range(kv.num_workers))
            exact(out, expected, f"{mode} {servers} servers key {k!r}")


@check(min_size=2)
def without_an_optimizer_a_key_holds_the_last_push():
    for mode, servers, kv in stores():
        kv.init(1, np.zeros(4, np.float32))
        kv.push(1, value(kv.rank, (4,), np.float32))
        kv.barrier()
        pulled = kv.pull(1)
        assert any(np.array_equal(pulled, value(r, (4,), np.float32))
                   for r in range(kv.num_workers)), pulled


@check(min_size=3)
def big_arrays_are_split_across_all_servers():
    for mode, servers, kv in stores(min_servers=2, bigarray_bound=10):
        kv.set_optimizer(accumulate)
        kv.init(["big", "small"], [np.zeros((37,), np.float32), np.zeros(9, np.float32)])
        assert [p[0] for p in kv._parts["big"]] == [0, 1], kv._parts["big"]
        assert len(kv._parts["small"]) == 1
        kv.push(["big", "small"], [value(kv.rank, (37,), np.float32),
                                   value(kv.rank, (9,), np.float32)])
        kv.barrier()
        exact(kv.pull("big"), sum(value(r, (37,), np.float64)
                                  for r in range(kv.num_workers)), "split key")
        rows = kv.row_sparse_pull("big", row_ids=[3, 36])
        expected = np.zeros(37)
        expected[[3, 36]] = sum(value(r, (37,), np.float64)
                                for r in range(kv.num_workers))[[3, 36]]
        exact(rows, expected, "row_sparse_pull of a split key")


@check(min_size=3)
def a_slow_worker_does_not_stop_the_others_and_every_push_counts_once():
    """The last worker sleeps, then waits until the servers have applied every push of
    the other workers before pushing at all: the others cannot have waited for it (or
    this check would hang and fail). Every push adds 1 to a counter key and a known
    array to a sum key: both end exactly at the totals."""
    pushes = 40
    for mode, servers, kv in stores(min_workers=2):
        kv.set_optimizer(accumulate)
        kv.init(["count", "sum"], [np.zeros(1, np.int64), np.zeros(6, np.float64)])
        slow = kv.rank == kv.num_workers - 1
        others = pushes * (kv.num_workers - 1)
        if slow:
            time.sleep(0.3)
            while kv.pull("count")[0] < others:
                time.sleep(0.01)
            assert kv.pull("count")[0] == others
        for step in range(pushes):
            kv.push(["count", "sum"], [np.ones(1, np.int64),
                                       value(kv.rank, (6,), np.float64, step)])
        kv.barrier()
        assert kv.pull("count")[0] == pushes * kv.num_workers
        exact(kv.pull("sum"), sum(value(r, (6,), np.float64, s)
                                  for r in range(kv.num_workers) for s in range(pushes)),
              "the sum of every push")


@check(min_size=2)
def sgd_and_adam_run_on_the_servers():
    for mode, servers, kv in stores(bigarray_bound=8):
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.5))
        kv.init("w", np.full(11, 3.0, np.float32))
        for step in range(3):
            kv.push("w", value(kv.rank, (11,), np.float32, step))
        kv.barrier()
        expected = 3.0 - 0.5 * sum(value(r, (11,), np.float64, s)
                                   for r in range(kv.num_workers) for s in range(3))
        exact(kv.pull("w"), expected, "SGD on the servers")
        kv.barrier()
    for mode, servers, kv in stores(bigarray_bound=8):
        make = lambda: kvstore.optimizer.Adam(learning_rate=0.1, wd=0.01)  # noqa: E731
        kv.set_optimizer(make())
        initial = np.linspace(-1, 1, 11).astype(np.float32)
        kv.init("w", initial)
        grads = [value(0, (11,), np.float32, s) / 3 for s in range(3)]
        if kv.rank == 0:  # one pusher: a known order of updates
            for grad in grads:
                kv.push("w", grad)
        kv.barrier()
        np.testing.assert_allclose(kv.pull("w"), adam_reference(make(), initial, grads),
                                   rtol=1e-5, atol=1e-6)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "states")
            kv.save_optimizer_states(path)
            kv.barrier()
            if kv.rank == 0:
                kv.load_optimizer_states(path)  # the same states: nothing changes
                kv.push("w", grads[0])
            kv.barrier()
        np.testing.assert_allclose(kv.pull("w"),
                                   adam_reference(make(), initial, grads + grads[:1]),
                                   rtol=1e-5, atol=1e-6)


@check(min_size=2)
def two_bit_pushes_are_dequantized_and_summed_on_the_servers():
    threshold = 0.5
    for mode, servers, kv in stores(bigarray_bound=16):
        kv.set_optimizer(accumulate)
        kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
        kv.init("g", np.zeros(37, np.float32))
        total = np.zeros(37, np.float32)
        for r in range(kv.num_workers):
            residual = np.zeros(37, np.float32)
            for step in range(3):
                grad = np.random.default_rng([r, step]).standard_normal(37)
                sent, residual = two_bit_model(grad.astype(np.float32), residual,
                                               threshold)
                total += sent
                if r == kv.rank:
                    kv.push("g", grad.astype(np.float32))
            if r == kv.rank:
                kept = np.concatenate([kv._compression.residuals[("g", p)]
                                       for p in range(len(kv._parts["g"]))])
                assert np.array_equal(kept, residual), (kept, residual)
        kv.barrier()
        exact(kv.pull("g"), total, "2-bit pushes summed on the servers")


@check(min_size=2)
def bad_input_names_the_key():
    closed = None
    for mode, servers, kv in stores():
        expect_raises(rt.InvalidArgumentError, kv.pull, "nope", match=["'nope'", "init"])
        kv.init("w", np.zeros(3, np.float32))
        expect_raises(rt.InvalidArgumentError, kv.init, "w", np.zeros(3, np.float32),
                      match=["'w'", "initialised already"])
        expect_raises(rt.InvalidArgumentError, kv.push, "w", np.zeros(3, np.int32),
                      match=["'w'", "int32", "float32"])
        if kv.num_workers > 1:  # init refused on one worker: an error on every worker
            if kv.rank == 1:
                expect_raises(rt.InvalidArgumentError, kv.init, "w", np.zeros(3),
                              match=["'w'", "initialised already"])
            else:
                expect_raises(rt.MismatchError, kv.init, "w2", np.zeros(3),
                              match=["worker 1", "initialised already", "'w2'"])
        kv.init("v", np.zeros(2, np.float32))
        kv.push("v", np.ones(2, np.float32))
        exact(kv.pull("v"), np.ones(2), "usable after the errors")
        closed = kv
    if closed is not None:  # a worker of the last store
        expect_raises(rt.UsageError, closed.pull, "v", match=["closed"])


if __name__ == "__main__":
    main()
