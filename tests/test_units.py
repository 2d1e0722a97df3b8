"""Single-process units: ring chunking, the executor."""

from __future__ import annotations

import inspect
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from ringtrain.collectives.world import _plan_cache
from ringtrain.collectives.algorithms import _ring
from ringtrain.collectives.base._executor import Executor, Handle
from ringtrain.collectives.world._plan_cache import PlanCache
from ringtrain.collectives.errors import RingtrainError

# --------------------------------------------------------------------------- chunk_bounds


@pytest.mark.parametrize("parts", range(1, 9))
def test_chunk_bounds_match_numpy_array_split(parts):
    for count in list(range(0, 40)) + [997, 1 << 20, (1 << 20) + 3]:
        bounds = _ring.chunk_bounds(count, parts)
        assert len(bounds) == parts + 1
        assert bounds[0] == 0 and bounds[-1] == count
        sizes = np.diff(bounds).tolist()
        expected = [len(piece) for piece in np.array_split(np.empty(count), parts)]
        assert sizes == expected, (count, parts)


def test_chunk_bounds_example_from_the_documentation():
    # 10 rows on 4 ranks: 3, 3, 2, 2
    assert np.diff(_ring.chunk_bounds(10, 4)).tolist() == [3, 3, 2, 2]
    assert _ring.chunk_bounds(2, 4) == [0, 1, 2, 2, 2]


# --------------------------------------------------------------------------- Executor

def _takes_args(method) -> bool:
    return "args" in inspect.signature(method).parameters


def submit(executor: Executor, function, *args, name: str | None = None) -> Handle:
    """Queue ``function(*args)`` (whichever way the executor takes the arguments)."""
    if _takes_args(executor.submit):
        return executor.submit(function, args, "test", name)
    return executor.submit(lambda: function(*args), "test", name)


def run(executor: Executor, function, *args):
    if _takes_args(executor.run):
        return executor.run(function, args, "test", None)
    return executor.run(lambda: function(*args), "test", None)


@pytest.fixture
def executor():
    ex = Executor()
    yield ex
    ex.close()


def test_queued_work_runs_in_fifo_order(executor):
    order = []
    rng = np.random.default_rng(3)
    delays = rng.uniform(0, 0.003, 40)

    def work(i):
        time.sleep(delays[i])
        order.append(i)
        return i * i

    handles = [submit(executor, work, i, name=f"t{i}") for i in range(40)]
    results = [h.wait() for h in reversed(handles)]
    assert order == list(range(40))
    assert results == [i * i for i in reversed(range(40))]
    assert all(h.done() for h in handles)


def test_queued_work_runs_on_one_worker_thread(executor):
    threads = [submit(executor, lambda: threading.current_thread()).wait() for _ in range(5)]
    assert len(set(threads)) == 1
    assert threads[0] is not threading.main_thread()


def test_a_blocking_call_waits_for_queued_work(executor):
    order = []
    started = threading.Event()

    def slow(i):
        started.set()
        time.sleep(0.02)
        order.append(i)

    handles = [submit(executor, slow, i) for i in range(3)]
    started.wait(5)
    assert run(executor, lambda: order.append("blocking") or "result") == "result"
    assert order == [0, 1, 2, "blocking"]
    assert all(h.done() for h in handles)


def test_a_blocking_call_without_queued_work_runs_inline(executor):
    assert run(executor, lambda: threading.current_thread()) is threading.current_thread()


def test_exceptions_reach_wait(executor):
    class Boom(Exception):
        pass

    error = Boom("boom")

    def fail():
        raise error

    handle = submit(executor, fail, name="bad")
    after = submit(executor, lambda: "still running")
    with pytest.raises(Boom) as caught:
        handle.wait()
    assert caught.value is error
    assert handle.done()
    with pytest.raises(Boom):
        handle.wait()  # again: the same error
    assert after.wait() == "still running", "work queued after a failure did not run"


def test_exceptions_of_blocking_calls_propagate(executor):
    with pytest.raises(ZeroDivisionError):
        run(executor, lambda: 1 / 0)
    assert run(executor, lambda: 5) == 5


def test_handle_state_and_repr(executor):
    gate = threading.Event()
    handle = submit(executor, gate.wait, 5, name="grad")
    assert handle.collective == "test" and handle.name == "grad"
    assert not handle.done() and "in flight" in repr(handle)
    gate.set()
    assert handle.wait() is True
    assert handle.done() and "done" in repr(handle) and "grad" in repr(handle)


def test_close_finishes_queued_work_then_refuses_more():
    executor = Executor()
    order = []
    handles = [submit(executor, lambda i=i: (time.sleep(0.005), order.append(i))) for i in range(5)]
    executor.close()
    assert order == list(range(5)) and all(h.done() for h in handles)
    with pytest.raises(RingtrainError):
        submit(executor, lambda: None)
    executor.close()  # closing twice is harmless


def test_close_without_any_work():
    executor = Executor()
    executor.close()
    with pytest.raises(RingtrainError):
        submit(executor, lambda: None)


def test_blocking_calls_from_several_threads_never_overlap(executor):
    """Work from the worker and inline calls never runs at the same time."""
    inside = []
    overlaps = []
    lock = threading.Lock()

    def work():
        with lock:
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(True)
        time.sleep(0.001)
        with lock:
            inside.pop()

    handles = [submit(executor, work) for _ in range(20)]
    for _ in range(20):
        run(executor, work)
    for h in handles:
        h.wait()
    assert not overlaps


def test_handles_are_futures(executor):
    import concurrent.futures
    gate = threading.Event()
    handle = submit(executor, gate.wait, 5)
    assert isinstance(handle, concurrent.futures.Future)
    with pytest.raises(concurrent.futures.TimeoutError):
        handle.result(timeout=0.01)
    assert not handle.cancel() and not handle.cancelled(), "a collective cannot be cancelled"
    seen = []
    handle.add_done_callback(lambda h: seen.append(h.result()))
    gate.set()
    done, not_done = concurrent.futures.wait([handle], timeout=5)
    assert handle in done and not not_done and seen == [True]
    assert handle.wait(timeout=1) is True


def test_handles_are_waited_for_from_other_threads(executor):
    gate = threading.Event()
    handle = submit(executor, lambda: gate.wait(5) and "value")
    results = []
    waiters = [threading.Thread(target=lambda: results.append(handle.wait())) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    gate.set()
    for waiter in waiters:
        waiter.join(5)
    assert results == ["value"] * 3


def test_a_call_made_inside_a_call_runs_at_once(executor):
    """A body that makes another call (holding the turn) runs it inline, whether it
    runs on the caller's thread or on the worker."""
    assert run(executor, lambda: run(executor, lambda: "inner")) == "inner"
    assert submit(executor, lambda: run(executor, lambda: "inner")).wait(5) == "inner"


def test_several_threads_are_noticed_the_worker_aside(executor):
    submit(executor, lambda: run(executor, lambda: None)).wait(5)
    run(executor, lambda: None)
    assert not executor.several_threads
    other = threading.Thread(target=lambda: run(executor, lambda: None))
    other.start()
    other.join(5)
    assert executor.several_threads


def test_a_waiting_call_runs_out_of_turn_when_asked(executor):
    """The thread holding the turn runs a named call waiting behind it; the call's
    handle gets its result and the worker does not run it again."""
    inside, release = threading.Event(), threading.Event()
    ran = []

    def first():
        inside.set()
        release.wait(5)
        assert executor.waiting_names() == [("b", None), ("c", None)]
        executor.run_waiting(("c", None))
        ran.append("a")

    def record(label):
        ran.append(label)
        return label

    handles = [executor.submit(first, (), "test", "a", ("a", None))]
    inside.wait(5)
    handles += [executor.submit(record, ("b",), "test", "b", ("b", None)),
                executor.submit(record, ("c",), "test", "c", ("c", None))]
    release.set()
    assert [h.wait(5) for h in handles[1:]] == ["b", "c"]
    handles[0].wait(5)
    assert ran == ["c", "a", "b"]
    with pytest.raises(LookupError):
        executor.run_waiting(("missing", None))


# --------------------------------------------------------------------------- plan cache

class _Plan:
    def __init__(self, group, settings):
        self.group, self.settings = group, settings


@pytest.fixture
def plan_world(monkeypatch):
    """The settings and the group a plan cache compares its plans with, swappable."""
    world = {"settings": object(), "group": object()}
    monkeypatch.setattr(_plan_cache, "current_settings", lambda: world["settings"])
    monkeypatch.setattr(_plan_cache, "resolve_group", lambda *_: world["group"])
    monkeypatch.setattr(_plan_cache, "world", lambda: SimpleNamespace(group=world["group"]))
    return world


def _plan_of(world):
    return _Plan(world["group"], world["settings"])


def test_a_kept_plan_is_reused_until_the_settings_or_the_group_change(plan_world):
    cache = PlanCache()
    plan = cache.keep(("allreduce", (3,)), _plan_of(plan_world))
    assert cache.get(("allreduce", (3,)), None, "allreduce", None) is plan
    assert cache.get(("allreduce", (4,)), None, "allreduce", None) is None
    plan_world["settings"] = object()
    assert cache.get(("allreduce", (3,)), None, "allreduce", None) is None
    plan = cache.keep(("allreduce", (3,)), _plan_of(plan_world))
    plan_world["group"] = object()
    assert cache.get(("allreduce", (3,)), None, "allreduce", None) is None


def test_unhashable_arguments_are_never_kept(plan_world):
    cache = PlanCache()
    key = ("broadcast", [0])
    assert cache.get(key, None, "broadcast", None) is None
    plan = _plan_of(plan_world)
    assert cache.keep(key, plan) is plan
    assert len(cache) == 0


def test_the_cache_is_bounded(plan_world):
    cache = PlanCache(limit=3)
    for shape in range(10):
        cache.keep(shape, _plan_of(plan_world))
        assert len(cache) <= 3
    assert cache.get(9, None, "allreduce", None) is not None
