"""broadcast in all its forms, broadcast_object, allgather_object and barrier.

Run: mpiexec -n K python tests/mpi/broadcast.py [--only SUBSTRING]
"""

from __future__ import annotations

import time

import numpy as np

import ringtrain as rt
from _harness import (COPY_DTYPES, WORLD, assert_equal_arrays, check, configured, main,
                      make_input, rng)

ALGORITHMS = ["binomial", "pipeline", "recursive_doubling", "native", "auto"]
SHAPES = [(0,), (), (1,), (13,), (3, 5, 7), (2, 0)]


def data(rank: int, shape, dtype, *key) -> np.ndarray:
    return make_input(rank, shape, dtype, None, "bcast", *key)


def broadcast_matrix(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for root in range(k):
        for dtype in COPY_DTYPES:
            for shape in SHAPES:
                what = (f"broadcast(algorithm={algorithm}, root={root}, dtype={dtype.name}, "
                        f"shape={shape})")
                expected = data(root, shape, dtype)
                # every rank passes its own (different) values; only the root's count,
                # read from an input that cannot be written
                x = data(me, shape, dtype)
                x.flags.writeable = False
                before = x.copy()
                y = rt.broadcast(x, root, name="b", algorithm=algorithm)
                assert_equal_arrays(y, expected, what)
                assert y is not x and not np.shares_memory(y, x), f"{what}: result aliases input"
                assert_equal_arrays(x, before, f"{what}: input after the call")
                z = data(me, shape, dtype)
                returned = rt.broadcast_(z, root, name="b", algorithm=algorithm)
                assert returned is z, f"{what}: broadcast_ did not return its argument"
                assert_equal_arrays(z, expected, what + " in place")


def noncontiguous(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    for root in range(k):
        for dtype in (np.dtype(np.float32), np.dtype(np.bool_), np.dtype(np.int64)):
            base = data(me, (6, 8), dtype, "nc")
            expected = data(root, (6, 8), dtype, "nc")
            for pick in (lambda a: a[::2, 1::3], lambda a: a.T):
                view = pick(base)
                what = f"broadcast non-contiguous {view.shape} root={root} {dtype.name}"
                y = rt.broadcast(view, root, algorithm=algorithm)
                assert_equal_arrays(y, np.ascontiguousarray(pick(expected)), what)
            # in place into a strided view: the rest of the base keeps this rank's values
            base = data(me, (6, 8), dtype, "nc")
            own = base.copy()
            view = base[1::2, ::3]
            rt.broadcast_(view, root, algorithm=algorithm)
            want = own.copy()
            want[1::2, ::3] = expected[1::2, ::3]
            assert_equal_arrays(base, want, f"broadcast_ into a strided view, root={root}")
            # the same, asynchronously
            base = data(me, (6, 8), dtype, "nc")
            handle = rt.broadcast_async_(base[::3, 1::2], root, algorithm=algorithm)
            view = rt.synchronize(handle)
            assert_equal_arrays(base, want_async(own_of=data(me, (6, 8), dtype, "nc"),
                                                 expected=expected),
                                f"broadcast_async_ into a strided view, root={root}")
            assert not view.flags.c_contiguous


def want_async(own_of: np.ndarray, expected: np.ndarray) -> np.ndarray:
    want = own_of.copy()
    want[::3, 1::2] = expected[::3, 1::2]
    return want


def large_and_segmented(algorithm: str) -> None:
    """3 MiB + 7 bytes (several pipeline segments, a partial last one); tiny segments."""
    k, me = rt.size(), rt.rank()
    n = 3 * (1 << 20) + 7
    for root in range(k):
        expected = rng(root, "large").integers(0, 256, n, dtype=np.uint8)
        x = expected.copy() if me == root else np.zeros(n, np.uint8)
        y = rt.broadcast(x, root, algorithm=algorithm)
        assert_equal_arrays(y, expected, f"broadcast 3 MiB uint8 root={root} {algorithm}")
        assert_equal_arrays(x, expected if me == root else np.zeros(n, np.uint8),
                            f"broadcast 3 MiB uint8 root={root} {algorithm}: input after")
        if root == k - 1:
            rt.broadcast_(x, root, algorithm=algorithm)
            assert_equal_arrays(x, expected, f"broadcast_ 3 MiB uint8 root={root} {algorithm}")
    with configured(segment_bytes=64, broadcast_pipeline_min_bytes=0):
        for root in range(k):
            for dtype, count in [(np.float64, 1001), (np.int8, 129), (np.bool_, 64),
                                 (np.float16, 7)]:
                expected = data(root, (count,), np.dtype(dtype), "seg")
                x = data(me, (count,), np.dtype(dtype), "seg")
                y = rt.broadcast(x, root, algorithm=algorithm)
                assert_equal_arrays(y, expected, f"broadcast segment_bytes=64 {np.dtype(dtype)} "
                                                 f"n={count} root={root} {algorithm}")
                rt.broadcast_(x, root, algorithm=algorithm)
                assert_equal_arrays(x, expected, "in place, segment_bytes=64")


def asynchronous(algorithm: str) -> None:
    k, me = rt.size(), rt.rank()
    pending = []
    for root in range(k):
        for dtype in COPY_DTYPES:
            x = data(me, (3, 4), dtype, "async")
            h1 = rt.broadcast_async(x, root, name=f"async{root}{dtype}", algorithm=algorithm)
            z = data(me, (5,), dtype, "async_")
            h2 = rt.broadcast_async_(z, root, name=f"async_{root}{dtype}", algorithm=algorithm)
            pending.append((root, dtype, h1, z, h2))
    for root, dtype, h1, z, h2 in reversed(pending):
        returned = rt.synchronize(h2)
        assert returned is z, "broadcast_async_ did not return its argument"
        assert_equal_arrays(z, data(root, (5,), dtype, "async_"),
                            f"broadcast_async_ root={root} {dtype}")
        assert_equal_arrays(rt.synchronize(h1), data(root, (3, 4), dtype, "async"),
                            f"broadcast_async root={root} {dtype}")
        assert rt.poll(h1) and rt.poll(h2)


for _algorithm in ALGORITHMS:
    check(name=f"broadcast and broadcast_, every root x dtype x shape, algorithm={_algorithm}")(
        lambda a=_algorithm: broadcast_matrix(a))
    check(name=f"broadcast non-contiguous, algorithm={_algorithm}")(
        lambda a=_algorithm: noncontiguous(a))
    check(name=f"broadcast 3 MiB and tiny segments, algorithm={_algorithm}")(
        lambda a=_algorithm: large_and_segmented(a))
    check(name=f"broadcast_async / broadcast_async_, algorithm={_algorithm}")(
        lambda a=_algorithm: asynchronous(a))


@check
def broadcasts_ride_in_the_agreement_up_to_its_payload():
    """From 4 KiB to the agreement's payload capacity (and one byte over, which the
    tree moves), every root, in place and not, each followed by a small allreduce that
    must find the agreement's messages in step."""
    k, me = rt.size(), rt.rank()
    capacity = 128 * 1024
    for nbytes in (4097, 8 * 1024 + 3, 64 * 1024, capacity, capacity + 1):
        for algorithm in ("recursive_doubling", "auto"):
            for root in range(k):
                expected = rng(root, "ride", nbytes).integers(0, 256, nbytes, dtype=np.uint8)
                mine = rng(me, "ride", nbytes).integers(0, 256, nbytes, dtype=np.uint8)
                what = f"broadcast of {nbytes} B, root={root}, algorithm={algorithm}"
                y = rt.broadcast(expected.copy() if me == root else mine, root,
                                 name="ride", algorithm=algorithm)
                assert_equal_arrays(y, expected, what)
                in_place = expected.copy() if me == root else mine.copy()
                rt.broadcast_(in_place, root, name="ride", algorithm=algorithm)
                assert_equal_arrays(in_place, expected, what + " in place")
                total = rt.allreduce(np.full(3, me + 1, np.int64), op=rt.Sum, name="step")
                assert_equal_arrays(total, np.full(3, k * (k + 1) // 2, np.int64),
                                    f"allreduce after the {what}")
        wide = data(k - 1, (nbytes // 8,), np.dtype(np.float64), "ride")
        y = rt.broadcast(wide if me == k - 1 else np.zeros_like(wide), k - 1)
        assert_equal_arrays(y, wide, f"float64 broadcast of {wide.nbytes} B")


@check
def broadcast_root_as_numpy_integer():
    k, me = rt.size(), rt.rank()
    root = np.int64(k - 1)
    y = rt.broadcast(np.full(3, me, np.int32), root)
    assert_equal_arrays(y, np.full(3, k - 1, np.int32), "broadcast with a numpy root")


@check
def broadcast_object_every_root():
    k, me = rt.size(), rt.rank()
    for root in range(k):
        obj = {"root": root, "sender": me, "values": list(range(me + 3)), "nested": {"x": (me,)}}
        got = rt.broadcast_object(obj, root_rank=root, name="cfg")
        expected = {"root": root, "sender": root, "values": list(range(root + 3)),
                    "nested": {"x": (root,)}}
        assert got == expected, f"broadcast_object root={root}: {got!r}"
        if me == root:
            assert got is obj or got == obj
        for value in (None, 0, "text", [1, 2.5, None]):
            assert rt.broadcast_object(value if me == root else "garbage", root) == value
        array = rt.broadcast_object(np.arange(5) * root, root)
        assert_equal_arrays(array, np.arange(5) * root, "broadcast_object(ndarray)")
    # default root is 0
    assert rt.broadcast_object(me) == 0


@check
def broadcast_object_large_bytes():
    """Over 1 MiB: large enough for the pipelined broadcast with three or more ranks."""
    k, me = rt.size(), rt.rank()
    for root in sorted({0, k - 1}):
        payload = rng(root, "big-object").bytes((1 << 20) + 12345)
        got = rt.broadcast_object(payload if me == root else None, root_rank=root)
        assert isinstance(got, bytes) and got == payload, \
            f"broadcast_object of {len(payload)} bytes from root {root} arrived altered"


@check
def allgather_object_varied_sizes():
    k, me = rt.size(), rt.rank()

    def obj(r):
        return {"rank": r, "blob": rng(r, "ag-object").bytes(r * 1000), "list": [r] * r}

    assert rt.allgather_object(obj(me), name="objs") == [obj(r) for r in range(k)]
    assert rt.allgather_object(b"") == [b""] * k
    assert rt.allgather_object(None) == [None] * k
    big = rt.allgather_object(rng(me, "agbig").bytes(300_000 + me))
    assert [len(b) for b in big] == [300_000 + r for r in range(k)]
    assert big == [rng(r, "agbig").bytes(300_000 + r) for r in range(k)]


@check
def barrier_orders_ranks():
    """After a barrier, every rank has entered it: a value posted before is seen after."""
    k, me = rt.size(), rt.rank()
    for _ in range(5):
        rt.barrier()
    # ranks enter one after the other (rank r waits for a token from r-1); the barrier
    # must not let any rank through before the last one has arrived.
    if me > 0:
        WORLD.recv(source=me - 1, tag=77)
    if me < k - 1:
        WORLD.send(me, dest=me + 1, tag=77)
    entered = time.monotonic()  # one clock for every process on this host
    rt.barrier()
    left = time.monotonic()
    times = WORLD.allgather((entered, left))
    assert max(t[0] for t in times) <= min(t[1] for t in times), \
        f"a rank left the barrier before another entered it: {times}"


if __name__ == "__main__":
    main()
