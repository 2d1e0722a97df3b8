"""Collectives from several threads of every rank: named calls are matched by name
whatever order each rank's threads make them in, unnamed calls of different threads
never meet (a MismatchError, the same on every rank), handles complete from any thread,
and two DistributedOptimizers train from two threads.

Run: mpiexec -n K python tests/mpi/threads.py [--only SUBSTRING]
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

import numpy as np

import ringtrain as rt
from _harness import assert_equal_arrays, check, configured, main, same_on_all_ranks

ITERATIONS = 40


def in_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Run ``work(k)`` in ``count`` threads; the errors they raised."""
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            work(k)
        except BaseException as error:  # collected and checked by the caller
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(k,), name=f"worker-{k}")
               for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def value(rank: int, thread: int, step: int) -> float:
    return float(1 + rank + 10 * thread + 100 * step)


def library_still_works() -> None:
    k = rt.size()
    total = rt.allreduce(np.full(7, rt.rank() + 1.0), rt.Sum, name="after")
    assert_equal_arrays(total, np.full(7, k * (k + 1) / 2), "allreduce afterwards")


def named_work(asynchronous: bool) -> Callable[[int], None]:
    """Each thread: allreduce, broadcast and allgather in turn, named by thread and step."""
    n, me = rt.size(), rt.rank()

    def work(k: int) -> None:
        for i in range(ITERATIONS):
            mine = np.full(13 + k, value(me, k, i))
            kind = i % 3
            if kind == 0:
                call = rt.allreduce_async if asynchronous else rt.allreduce
                out = call(mine, op=rt.Sum, name=f"sum.{k}.{i}")
                expected = np.full(13 + k, sum(value(r, k, i) for r in range(n)))
            elif kind == 1:
                root = (k + i) % n
                call = rt.broadcast_async if asynchronous else rt.broadcast
                out = call(mine, root, name=f"bcast.{k}.{i}")
                expected = np.full(13 + k, value(root, k, i))
            else:
                call = rt.allgather_async if asynchronous else rt.allgather
                out = call(mine[: 1 + me], name=f"gather.{k}.{i}")
                expected = np.concatenate([np.full(1 + r, value(r, k, i)) for r in range(n)])
            if asynchronous:
                out = rt.synchronize(out)
            assert_equal_arrays(out, expected, f"thread {k} step {i}")

    return work


def _named_threads(count: int, asynchronous: bool) -> None:
    errors = in_threads(count, named_work(asynchronous))
    assert not errors, errors[:2]
    library_still_works()


@check(name="2 threads, named blocking calls")
def two_threads_blocking() -> None:
    _named_threads(2, False)


@check(name="4 threads, named blocking calls")
def four_threads_blocking() -> None:
    _named_threads(4, False)


@check(name="2 threads, named asynchronous calls")
def two_threads_async() -> None:
    _named_threads(2, True)


@check(name="4 threads, named asynchronous calls")
def four_threads_async() -> None:
    _named_threads(4, True)


def crossing(first_on_rank0: int) -> Callable[[int], float]:
    """A delay per thread so that rank 0 calls from thread ``first_on_rank0`` first and
    every other rank from the other thread first."""
    me = rt.rank()

    def delay(k: int) -> float:
        first = first_on_rank0 if me == 0 else 1 - first_on_rank0
        return 0.0 if k == first else 0.3

    return delay


@check(min_size=2, name="named calls crossed between ranks are matched by name")
def crossed_named() -> None:
    delay = crossing(0)
    n, me = rt.size(), rt.rank()

    def work(k: int) -> None:
        time.sleep(delay(k))
        out = rt.allreduce(np.full(5, value(me, k, 0)), rt.Sum, name=f"crossed.{k}")
        assert_equal_arrays(out, np.full(5, sum(value(r, k, 0) for r in range(n))),
                            f"thread {k}")

    errors = in_threads(2, work)
    assert not errors, errors
    library_still_works()


@check(min_size=2, name="unnamed calls of different threads never meet")
def crossed_unnamed() -> None:
    delay = crossing(0)
    messages: dict[int, str] = {}

    def work(k: int) -> None:
        time.sleep(delay(k))
        try:
            rt.allreduce(np.full(5, 1.0), rt.Sum)
        except rt.MismatchError as error:
            messages[k] = str(error)
            raise

    errors = in_threads(2, work)
    assert len(errors) == 2 and all(isinstance(e, rt.MismatchError) for e in errors), errors
    assert all("sent thread 'worker-0'" in m and "sent thread 'worker-1'" in m
               for m in messages.values()), messages
    same_on_all_ranks(sorted(messages.values()), "the errors of the crossed calls")
    library_still_works()


@check(min_size=2, name="names that never meet fail alike on every rank")
def unmatched_names() -> None:
    me = rt.rank()
    with configured(name_match_seconds=1.0):
        started = time.monotonic()

        def work(k: int) -> None:
            rt.allreduce(np.ones(3), rt.Sum, name="only-on-rank-0" if me == 0 else "elsewhere")

        errors = in_threads(1, work)
        waited = time.monotonic() - started
    assert len(errors) == 1 and isinstance(errors[0], rt.MismatchError), errors
    message = str(errors[0])
    assert "several threads" in message and "name=" in message, message
    assert 0.9 < waited < 30, waited
    same_on_all_ranks(message, "the error")
    library_still_works()


@check(name="handles complete from other threads")
def handles_from_other_threads() -> None:
    n = rt.size()
    handles = [rt.allreduce_async(np.full(4, float(i)), rt.Sum, name=f"h{i}") for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(rt.synchronize, handles[:3]))
        polled = list(pool.map(lambda h: (rt.synchronize(h), rt.poll(h)), handles[3:]))
    for i, out in enumerate(results + [out for out, _ in polled]):
        assert_equal_arrays(out, np.full(4, float(i) * n), f"handle {i}")
    assert all(done for _, done in polled)
    more = [rt.allreduce_async(np.full(2, 1.0), rt.Sum, name=f"f{i}") for i in range(4)]
    finished = concurrent.futures.wait(more, timeout=60)
    assert not finished.not_done
    for handle in concurrent.futures.as_completed(more):
        assert_equal_arrays(handle.result(timeout=1), np.full(2, float(n)), "as_completed")
    assert not more[0].cancel(), "a submitted collective cannot be cancelled"


@check(name="two DistributedOptimizers trained from two threads")
def two_optimizers() -> None:
    try:
        import torch
    except ImportError:
        return
    n, me = rt.size(), rt.rank()
    steps, lr = 5, 0.1

    def batch(model: int, rank: int, step: int) -> tuple:
        generator = torch.Generator().manual_seed(1000 * model + 10 * rank + step)
        return torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)

    def build(model: int) -> torch.nn.Module:
        torch.manual_seed(model)
        return torch.nn.Linear(4, 1)

    def reference(model: int) -> list[torch.Tensor]:
        net = build(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=lr)
        for step in range(steps):
            optimizer.zero_grad()
            loss = sum(torch.nn.functional.mse_loss(net(x), y)
                       for x, y in (batch(model, r, step) for r in range(n))) / n
            loss.backward()
            optimizer.step()
        return [p.detach().clone() for p in net.parameters()]

    trained: dict[int, list[torch.Tensor]] = {}
    nets = [build(model) for model in range(2)]  # seeding is global: not in the threads

    def work(model: int) -> None:
        net = nets[model]
        optimizer = rt.DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=lr),
            named_parameters=[(f"model{model}.{name}", p) for name, p in net.named_parameters()])
        for step in range(steps):
            optimizer.zero_grad()
            x, y = batch(model, me, step)
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
        trained[model] = [p.detach().clone() for p in net.parameters()]

    errors = in_threads(2, work)
    assert not errors, errors
    for model in range(2):
        for got, expected in zip(trained[model], reference(model)):
            assert torch.allclose(got, expected, atol=1e-6), (model, got, expected)


if __name__ == "__main__":
    main()
