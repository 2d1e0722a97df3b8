"""Calls that differ across ranks (MismatchError on every rank) and bad arguments
(refused by the rank that made them, which tells the others through the agreement).

Every mismatch check makes the last rank (or rank 0) differ, expects a MismatchError on
every rank with the documented message, and then proves the library still works with a
normal collective.

Run: mpiexec -n K python tests/mpi/mismatch.py [--only SUBSTRING]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

import ringtrain as rt
from _harness import (WORLD, assert_equal_arrays, check, configured, expect_raises, main,
                      same_on_all_ranks)

HEAD = "was called with different arguments across ranks: "


def show(value: object) -> str:
    """How a value appears in a mismatch message: strings quoted, everything else str()."""
    return repr(value) if isinstance(value, str) else str(value)


def field_part(field: str, by_rank: Mapping[int, object]) -> str:
    """The documented text for one differing field: the smallest group of ranks first
    (ties: the group with the lowest rank first), 'rank R' or 'ranks R,S'."""
    groups: dict[str, list[int]] = {}
    for r in sorted(by_rank):
        groups.setdefault(show(by_rank[r]), []).append(r)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
    return ", ".join(f"{'rank' if len(ranks) == 1 else 'ranks'} {','.join(map(str, ranks))} "
                     f"sent {field} {value}" for value, ranks in ordered)


def library_still_works() -> None:
    """A normal allreduce and broadcast over every rank give the right answer."""
    k, me = rt.size(), rt.rank()
    total = rt.allreduce(np.full(7, me + 1, np.float64), rt.Sum, name="after")
    assert_equal_arrays(total, np.full(7, k * (k + 1) / 2), "allreduce after a mismatch")
    data = rt.broadcast(np.full(5, me, np.int32), k - 1, name="after")
    assert_equal_arrays(data, np.full(5, k - 1, np.int32), "broadcast after a mismatch")


def expect_mismatch(call: Callable[[], object], *, collective: str | set[str],
                    name: str | None | set, differences: dict[str, dict[int, object]],
                    comm=WORLD) -> rt.MismatchError:
    """Run ``call`` (on every participating rank) and check the MismatchError in detail.

    Args:
        collective: the collective named by the message (a set: any of them).
        name: the tensor name (a set: any of them).
        differences: the expected ``.differences``, ``{field: {world rank: value}}``.
    """
    try:
        call()
    except rt.MismatchError as error:
        caught = error
    else:
        raise AssertionError(f"no MismatchError; expected one for {sorted(differences)}")
    assert isinstance(caught, RuntimeError) and isinstance(caught, rt.RingtrainError)
    text = str(caught)
    collectives = collective if isinstance(collective, set) else {collective}
    names = name if isinstance(name, set) else {name}
    assert caught.collective in collectives, f"collective {caught.collective!r}"
    assert caught.tensor_name in names, f"tensor_name {caught.tensor_name!r}"
    label = "(unnamed)" if caught.tensor_name is None else repr(caught.tensor_name)
    prefix = f"{caught.collective} of tensor {label} {HEAD}"
    assert text.startswith(prefix), f"message {text!r} does not start with {prefix!r}"
    assert caught.differences == differences, (
        f"differences {caught.differences!r}, expected {differences!r}")
    expected_parts = {field_part(field, values) for field, values in differences.items()}
    got_parts = set(text[len(prefix):].split("; "))
    assert got_parts == expected_parts, (
        f"message {text!r}: parts {sorted(got_parts)}, expected {sorted(expected_parts)}")
    # documented: "raised on every rank of the process set, with the same message everywhere"
    same_on_all_ranks(text, "MismatchError message", comm)
    same_on_all_ranks((caught.collective, caught.tensor_name),
                      "MismatchError .collective/.tensor_name", comm)
    return caught


def last_differs(common, odd) -> dict[int, object]:
    k = rt.size()
    return {r: (odd if r == k - 1 else common) for r in range(k)}


def segment_bytes() -> int:
    return rt.current_settings().segment_bytes


def mine(values: Mapping[int, object]) -> object:
    return values[rt.rank()]


# --------------------------------------------------------------------------- mismatches

@check(min_size=2)
def shape_mismatch_small_payload():
    """10 vs 11 float32 elements (auto: recursive doubling, data rides with the check)."""
    k = rt.size()
    shapes = last_differs((10,), (11,))
    error = expect_mismatch(lambda: rt.allreduce(np.ones(mine(shapes), np.float32), rt.Sum,
                                                 name="w"),
                            collective="allreduce", name="w", differences={"shape": shapes})
    text = str(error)
    assert f"rank {k - 1} sent shape (11,)" in text and "sent shape (10,)" in text, text
    if k >= 3:
        group = "ranks " + ",".join(str(r) for r in range(k - 1))
        assert f"rank {k - 1} sent shape (11,), {group} sent shape (10,)" in text, text
    else:
        assert "rank 0 sent shape (10,), rank 1 sent shape (11,)" in text, text
    library_still_works()


@check(min_size=2)
def shape_mismatch_recursive_doubling_4_vs_5():
    shapes = last_differs((4,), (5,))
    for function in (rt.allreduce, rt.allreduce_):
        expect_mismatch(lambda: function(np.ones(mine(shapes), np.float64), rt.Sum, name="rd",
                                         algorithm="recursive_doubling"),
                        collective="allreduce", name="rd", differences={"shape": shapes})
        library_still_works()


@check(min_size=2)
def shape_mismatch_ring_100000_vs_100001():
    shapes = last_differs((100_000,), (100_001,))
    for algorithm in ("ring", "auto", "native"):
        expect_mismatch(lambda: rt.allreduce(np.ones(mine(shapes), np.float32), rt.Sum,
                                             name="big", algorithm=algorithm),
                        collective="allreduce", name="big", differences={"shape": shapes})
        library_still_works()


def _shape_mismatch_across(limit_bytes: int, name: str) -> None:
    """One rank's float32 array of ``limit_bytes`` rides with the check (recursive
    doubling), the other's, one element more, goes by the ring: every rank gets the
    error naming the fields that differ."""
    limit = limit_bytes // 4
    shapes = last_differs((limit,), (limit + 1,))
    algorithms = last_differs("recursive_doubling", "ring")
    expect_mismatch(lambda: rt.allreduce(np.ones(mine(shapes), np.float32), rt.Sum,
                                         name=name),
                    collective="allreduce", name=name,
                    differences={"shape": shapes, "algorithm": algorithms})
    library_still_works()


@check(min_size=2)
def shape_mismatch_across_the_auto_threshold():
    """A threshold set to 4096 bytes."""
    with configured(recursive_doubling_max_bytes=4096, allreduce_algorithm="auto"):
        _shape_mismatch_across(4096, "edge")


@check(min_size=2)
def shape_mismatch_across_the_default_auto_threshold():
    """The built-in table's own threshold (128 KiB)."""
    with configured(allreduce_algorithm="auto"):
        _shape_mismatch_across(rt.current_settings().recursive_doubling_max_bytes,
                               "default edge")


@check(min_size=3)
def every_rank_a_different_shape():
    k = rt.size()
    shapes = {r: (r + 1,) for r in range(k)}
    error = expect_mismatch(lambda: rt.allreduce(np.ones(mine(shapes), np.float32), rt.Max),
                            collective="allreduce", name=None, differences={"shape": shapes})
    assert "allreduce of tensor (unnamed)" in str(error)
    library_still_works()


@check(min_size=2)
def dtype_mismatch():
    dtypes = last_differs(np.dtype(np.float32), np.dtype(np.float64))
    error = expect_mismatch(lambda: rt.allreduce(np.ones(6, mine(dtypes)), rt.Sum, name="d"),
                            collective="allreduce", name="d", differences={"dtype": dtypes})
    assert f"rank {rt.size() - 1} sent dtype float64" in str(error)
    assert "sent dtype float32" in str(error)
    library_still_works()


@check(min_size=2)
def dtype_and_shape_mismatch_joined_by_semicolon():
    dtypes = last_differs(np.dtype(np.int32), np.dtype(np.int64))
    shapes = last_differs((3,), (4,))
    error = expect_mismatch(
        lambda: rt.allreduce(np.ones(mine(shapes), mine(dtypes)), rt.Sum, name="two"),
        collective="allreduce", name="two", differences={"dtype": dtypes, "shape": shapes})
    assert "; " in str(error)
    library_still_works()


@check(min_size=2)
def compression_mismatch():
    """One rank compresses, the others do not: refused before any data moves."""
    kinds = last_differs("none", "fp16")
    compressor = {"none": rt.Compression.none, "fp16": rt.Compression.fp16}
    for size in (8, 100_000):
        expect_mismatch(lambda: rt.allreduce(np.ones(size, np.float32), name="c",
                                             compression=compressor[mine(kinds)]),
                        collective="allreduce", name="c", differences={"compression": kinds})
    expect_mismatch(lambda: rt.grouped_allreduce([np.ones(5, np.float32)], name="c",
                                                 compression=compressor[mine(kinds)]),
                    collective="grouped_allreduce", name="c",
                    differences={"compression": kinds})
    library_still_works()


@check(min_size=2)
def op_mismatch():
    ops = last_differs("Sum", "Max")
    op_of = {"Sum": rt.Sum, "Max": rt.Max}
    error = expect_mismatch(lambda: rt.allreduce(np.ones(8, np.float32), op_of[mine(ops)],
                                                 name="o"),
                            collective="allreduce", name="o", differences={"op": ops})
    assert f"rank {rt.size() - 1} sent op 'Max'" in str(error) and "sent op 'Sum'" in str(error)
    # the op of a large (ring) allreduce and of a reducescatter is checked too
    expect_mismatch(lambda: rt.allreduce(np.ones(100_000, np.float32), op_of[mine(ops)],
                                         name="o", algorithm="ring"),
                    collective="allreduce", name="o", differences={"op": ops})
    expect_mismatch(lambda: rt.reducescatter(np.ones(10, np.float32), op_of[mine(ops)],
                                             name="o"),
                    collective="reducescatter", name="o", differences={"op": ops})
    # Adasum runs its own algorithm: the signature says so too
    adasum = last_differs("Sum", "Adasum")
    for size, algorithm in ((8, "recursive_doubling"), (100_000, "ring")):
        error = expect_mismatch(
            lambda: rt.allreduce(np.ones(size, np.float32), mine(adasum), name="a",
                                 algorithm=None if mine(adasum) == "Adasum" else algorithm),
            collective="allreduce", name="a",
            differences={"op": adasum, "algorithm": last_differs(algorithm, "adasum")})
        assert f"rank {rt.size() - 1} sent op 'Adasum'" in str(error)
    library_still_works()


@check(min_size=2)
def name_mismatch():
    names = last_differs("a", "b")
    error = expect_mismatch(lambda: rt.allreduce(np.ones(3, np.float32), rt.Sum,
                                                 name=mine(names)),
                            collective="allreduce", name={"a", "b"},
                            differences={"name": names})
    assert f"rank {rt.size() - 1} sent name 'b'" in str(error) and "sent name 'a'" in str(error)
    library_still_works()


@check(min_size=2)
def algorithm_mismatch():
    algorithms = last_differs("ring", "recursive_doubling")
    error = expect_mismatch(lambda: rt.allreduce(np.ones(8, np.float32), rt.Sum, name="alg",
                                                 algorithm=mine(algorithms)),
                            collective="allreduce", name="alg",
                            differences={"algorithm": algorithms})
    assert f"rank {rt.size() - 1} sent algorithm 'recursive_doubling'" in str(error)
    # broadcast and allgather algorithms too
    bcast = last_differs("binomial", "pipeline")
    expect_mismatch(lambda: rt.broadcast(np.ones(8, np.float32), 0, name="alg",
                                         algorithm=mine(bcast)),
                    collective="broadcast", name="alg",
                    differences={"algorithm": bcast,
                                 "segment_bytes": last_differs(None, segment_bytes())})
    gather = last_differs("ring", "native")
    expect_mismatch(lambda: rt.allgather(np.ones(2, np.float32), name="alg",
                                         algorithm=mine(gather)),
                    collective="allgather", name="alg", differences={"algorithm": gather})
    library_still_works()


@check(min_size=2)
def settings_mismatch_gives_an_error_not_a_hang():
    """Ranks configured differently (algorithm, segment size) get a MismatchError."""
    k, me = rt.size(), rt.rank()
    odd = me == k - 1
    with configured(**({"allreduce_algorithm": "ring"} if odd else {})):
        expect_mismatch(lambda: rt.allreduce(np.ones(8, np.float32), rt.Sum, name="cfg"),
                        collective="allreduce", name="cfg",
                        differences={"algorithm": last_differs("recursive_doubling", "ring")})
    with configured(**({"segment_bytes": 1024} if odd else {"segment_bytes": 2048})):
        error = expect_mismatch(
            lambda: rt.allreduce(np.ones(1000, np.float32), rt.Sum, name="seg",
                                 algorithm="ring"),
            collective="allreduce", name="seg",
            differences={"segment_bytes": last_differs(2048, 1024)})
        assert f"rank {k - 1} sent segment_bytes 1024" in str(error)
    library_still_works()


@check(min_size=2)
def broadcast_root_mismatch():
    k = rt.size()
    roots = last_differs(0, 1)
    error = expect_mismatch(lambda: rt.broadcast(np.ones(4, np.int32), mine(roots), name="r"),
                            collective="broadcast", name="r", differences={"root_rank": roots})
    assert f"rank {k - 1} sent root_rank 1" in str(error) and "sent root_rank 0" in str(error)
    expect_mismatch(lambda: rt.broadcast_(np.ones(4, np.int32), mine(roots), name="r"),
                    collective="broadcast", name="r", differences={"root_rank": roots})
    expect_mismatch(lambda: rt.broadcast_object("x", mine(roots), name="r"),
                    collective="broadcast_object", name="r", differences={"root_rank": roots})
    library_still_works()


@check(min_size=2)
def broadcast_shape_and_dtype_mismatch():
    shapes = last_differs((2, 3), (3, 2))
    expect_mismatch(lambda: rt.broadcast(np.zeros(mine(shapes), np.uint8), 0, name="bs"),
                    collective="broadcast", name="bs", differences={"shape": shapes})
    dtypes = last_differs(np.dtype(np.uint8), np.dtype(np.bool_))
    error = expect_mismatch(lambda: rt.broadcast(np.zeros(5, mine(dtypes)), 0, name="bd"),
                            collective="broadcast", name="bd", differences={"dtype": dtypes})
    assert f"rank {rt.size() - 1} sent dtype bool" in str(error)
    riding = last_differs((8 << 10,), ((8 << 10) + 8,))
    expect_mismatch(lambda: rt.broadcast(np.zeros(mine(riding), np.uint8), 0, name="ride"),
                    collective="broadcast", name="ride", differences={"shape": riding})
    roots = last_differs(0, rt.size() - 1)
    expect_mismatch(lambda: rt.broadcast_(np.zeros(8 << 10, np.uint8), mine(roots),
                                          name="ride"),
                    collective="broadcast", name="ride", differences={"root_rank": roots})
    big = last_differs((3 << 20,), (3 << 20, 1))
    expect_mismatch(lambda: rt.broadcast(np.zeros(mine(big), np.uint8), 0, name="big"),
                    collective="broadcast", name="big", differences={"shape": big})
    library_still_works()


@check(min_size=2)
def different_collectives_allreduce_vs_broadcast():
    """Rank 0 calls allreduce while the others call broadcast."""
    k, me = rt.size(), rt.rank()

    def call():
        x = np.ones(6, np.float32)
        return rt.allreduce(x, rt.Sum, name="w") if me == 0 else rt.broadcast(x, 0, name="w")

    # pin the automatic choices so the expected fields do not depend on the defaults
    with configured(recursive_doubling_max_bytes=1024, broadcast_pipeline_min_bytes=1024,
                    allreduce_algorithm="auto", broadcast_algorithm="binomial"):
        error = expect_mismatch(call, collective={"allreduce", "broadcast"}, name="w",
                                differences={
            "collective": {r: ("allreduce" if r == 0 else "broadcast") for r in range(k)},
            "op": {r: ("Sum" if r == 0 else "(absent)") for r in range(k)},
            "algorithm": {r: ("recursive_doubling" if r == 0 else "binomial") for r in range(k)},
            "segment_bytes": {r: (segment_bytes() if r == 0 else None) for r in range(k)},
            "compression": {r: ("none" if r == 0 else "(absent)") for r in range(k)},
            "root_rank": {r: ("(absent)" if r == 0 else 0) for r in range(k)},
        })
    assert "rank 0 sent collective 'allreduce'" in str(error)
    library_still_works()


@check(min_size=2)
def barrier_waits_while_the_others_collective_fails():
    """A rank in a barrier keeps waiting; the allgather the others made fails, naming it."""
    k, me = rt.size(), rt.rank()
    if me == 0:
        rt.barrier()  # returns once the others reach a barrier too
    else:
        caught = expect_raises(rt.MismatchError, rt.allgather, np.ones(2, np.int8))
        assert caught.differences["collective"] == {r: ("barrier" if r == 0 else "allgather")
                                                    for r in range(k)}, caught.differences
        rt.barrier()
    library_still_works()


@check(min_size=2)
def different_collectives_ring_allreduce_vs_alltoall():
    k, me = rt.size(), rt.rank()

    def call():
        if me == k - 1:
            return rt.alltoall(np.ones(k, np.float32), name="x")
        return rt.allreduce(np.ones(200_000, np.float32), rt.Sum, name="x")

    caught = expect_raises(rt.MismatchError, call)
    assert caught.differences["collective"] == {r: ("alltoall" if r == k - 1 else "allreduce")
                                                for r in range(k)}, caught.differences
    assert caught.differences["shape"] == {r: (200_000,) for r in range(k - 1)} | {
        k - 1: "(absent)"}, caught.differences
    library_still_works()


@check(min_size=2)
def allgather_trailing_dims_mismatch():
    k, me = rt.size(), rt.rank()
    trailing = last_differs((3,), (4,))
    error = expect_mismatch(lambda: rt.allgather(np.ones((me + 1, *mine(trailing)), np.float32),
                                                 name="g"),
                            collective="allgather", name="g",
                            differences={"shape[1:]": trailing})
    assert f"rank {k - 1} sent shape[1:] (4,)" in str(error)
    assert "sent shape[1:] (3,)" in str(error)
    # rows that ride in the agreement's messages (8 KiB a rank)
    dtypes = last_differs(np.dtype(np.float32), np.dtype(np.int32))
    expect_mismatch(lambda: rt.allgather(np.ones(2048, mine(dtypes)), name="rows"),
                    collective="allgather", name="rows", differences={"dtype": dtypes})
    library_still_works()


@check(min_size=2)
def reducescatter_shape_mismatch():
    k = rt.size()
    shapes = last_differs((2 * k,), (2 * k + 1,))
    expect_mismatch(lambda: rt.reducescatter(np.ones(mine(shapes), np.float32), rt.Sum,
                                             name="rs"),
                    collective="reducescatter", name="rs", differences={"shape": shapes})
    library_still_works()


@check(min_size=2)
def alltoall_dtype_mismatch():
    k = rt.size()
    dtypes = last_differs(np.dtype(np.int32), np.dtype(np.int64))
    error = expect_mismatch(lambda: rt.alltoall(np.ones(2 * k, mine(dtypes)), name="a"),
                            collective="alltoall", name="a", differences={"dtype": dtypes})
    assert f"rank {k - 1} sent dtype int64" in str(error)
    trailing = last_differs((2,), (3,))
    expect_mismatch(lambda: rt.alltoall(np.ones((k, *mine(trailing)), np.int32), name="a"),
                    collective="alltoall", name="a", differences={"shape[1:]": trailing})
    library_still_works()


@check(min_size=2)
def grouped_allreduce_mismatch():
    k = rt.size()
    counts = last_differs(2, 3)
    tensors = [np.ones(4, np.float32) for _ in range(mine(counts))]
    caught = expect_raises(rt.MismatchError, rt.grouped_allreduce, tensors, rt.Sum, name="grp")
    assert caught.collective == "grouped_allreduce" and caught.tensor_name == "grp"
    assert caught.differences["shape"] == {r: ((4,),) * counts[r] for r in range(k)}
    assert "grouped_allreduce of tensor 'grp' " + HEAD in str(caught)
    library_still_works()


@check(min_size=2)
def mismatch_in_an_async_call():
    """The error reaches synchronize(); the calls queued after it still work."""
    k, me = rt.size(), rt.rank()
    shapes = last_differs((5,), (6,))
    bad = rt.allreduce_async(np.ones(mine(shapes), np.float32), rt.Sum, name="async-bad")
    good = rt.allreduce_async(np.full(3, me, np.float32), rt.Sum, name="async-good")
    expect_mismatch(lambda: rt.synchronize(bad), collective="allreduce", name="async-bad",
                    differences={"shape": shapes})
    assert rt.poll(bad)
    assert_equal_arrays(rt.synchronize(good), np.full(3, k * (k - 1) / 2, np.float32),
                        "allreduce_async queued after a mismatch")
    library_still_works()


@check(min_size=3)
def mismatch_inside_a_process_set_names_world_ranks():
    k, me = rt.size(), rt.rank()
    members = list(range(1, k))
    ps = rt.add_process_set(members)
    members_comm = WORLD.Split(0 if ps.included() else 1, me)  # to compare the messages
    try:
        if ps.included():
            shapes = {r: ((11,) if r == k - 1 else (10,)) for r in members}
            expect_mismatch(lambda: rt.allreduce(np.ones(shapes[me], np.float32), rt.Sum,
                                                 name="ps", process_set=ps),
                            collective="allreduce", name="ps", differences={"shape": shapes},
                            comm=members_comm)
            total = rt.allreduce(np.ones(3, np.float32), rt.Sum, process_set=ps)
            assert_equal_arrays(total, np.full(3, k - 1, np.float32),
                                "process set after a mismatch")
    finally:
        members_comm.Free()
    assert rt.remove_process_set(ps) == ps.included()
    library_still_works()


@check(min_size=2)
def repeated_mismatches_keep_working():
    k = rt.size()
    for i in range(5):
        shapes = last_differs((i + 1,), (i + 2,))
        expect_raises(rt.MismatchError, rt.allreduce, np.ones(mine(shapes), np.float32), rt.Sum)
        expect_raises(rt.MismatchError, rt.broadcast, np.ones(mine(shapes), np.float32), 0)
    library_still_works()
    assert rt.allgather_object(rt.rank()) == list(range(k))


@check(min_size=2)
def failed_in_place_call_leaves_the_tensor_unchanged():
    """A MismatchError is raised before any data moves, so retrying must be safe: the
    caller's tensor still holds its input, also with a prescale factor."""
    shapes = last_differs((10,), (11,))
    for algorithm in ("recursive_doubling", "ring", "native"):
        before = np.arange(mine(shapes)[0], dtype=np.float32)
        group = [before.copy()]
        expect_raises(rt.MismatchError, rt.grouped_allreduce_, group, rt.Sum,
                      prescale_factor=2.0, algorithm=algorithm)
        assert_equal_arrays(group[0], before, "grouped_allreduce_ input after a MismatchError")
        strided = np.repeat(before, 2)[::2]
        expect_raises(rt.MismatchError, rt.allreduce_, strided, rt.Sum, prescale_factor=2.0,
                      algorithm=algorithm)
        assert_equal_arrays(strided, before, "allreduce_ of a strided view after a MismatchError")
        x = before.copy()
        expect_raises(rt.MismatchError, rt.allreduce_, x, rt.Sum, prescale_factor=2.0,
                      algorithm=algorithm)
        assert_equal_arrays(x, before, f"allreduce_(prescale_factor=2, algorithm={algorithm}) "
                                       f"input after a MismatchError")
    library_still_works()


# --------------------------------------------------------------------------- bad arguments

@check(min_size=2)
def unpicklable_object_on_the_root_raises_everywhere():
    """The root cannot pickle its object: every rank raises, no rank waits for data."""
    import threading
    k = rt.size()
    root = k - 1
    status = {r: "ok" for r in range(k)}
    lock = threading.Lock()
    try:
        __import__("pickle").dumps(lock)
    except TypeError as error:
        status[root] = f"failed (TypeError: {error})"
    obj = lock if rt.rank() == root else None
    error = expect_mismatch(lambda: rt.broadcast_object(obj, root_rank=root, name="config"),
                            collective="broadcast_object", name="config",
                            differences={"pickling": status})
    assert f"rank {root} sent pickling " in str(error), str(error)
    assert "failed (TypeError: cannot pickle" in str(error), str(error)
    library_still_works()


@check(min_size=2)
def unpicklable_object_in_allgather_object_raises_everywhere():
    k = rt.size()
    obj = (lambda: None) if rt.rank() == 0 else rt.rank()
    error = None
    try:
        rt.allgather_object(obj, name="stats")
    except rt.MismatchError as caught:
        error = caught
    assert error is not None, "no MismatchError"
    by_rank = error.differences["pickling"]
    assert sorted(by_rank) == list(range(k)), by_rank
    assert by_rank[0].startswith("failed ("), by_rank
    assert all(by_rank[r] == "ok" for r in range(1, k)), by_rank
    same_on_all_ranks(str(error), "MismatchError message", WORLD)
    library_still_works()


def bad_calls() -> list[tuple[str, type[BaseException], Callable[[], object], list[str]]]:
    """(label, exception, call, message parts): each must raise before communicating."""
    k = rt.size()
    f32 = np.ones(2 * k, np.float32)
    i32 = np.ones(2 * k, np.int32)
    c64 = np.ones(2 * k, np.complex64)
    Inv, Dt = rt.InvalidArgumentError, rt.UnsupportedDtypeError
    calls = [
        ("unknown op", Inv, lambda: rt.allreduce(f32, "median", name="t"), ["'t'", "median"]),
        ("unknown op object", Inv, lambda: rt.allreduce(f32, 42, name="t"), ["'t'"]),
        ("unknown op async", Inv, lambda: rt.allreduce_async(f32, "mean", name="t"), ["'t'"]),
        ("unknown op reducescatter", Inv, lambda: rt.reducescatter(f32, "xor", name="t"),
         ["'t'", "xor"]),
        ("unknown op grouped", Inv, lambda: rt.grouped_allreduce([f32], "xor", name="t"),
         ["'t'"]),
        ("root too large", Inv, lambda: rt.broadcast(f32, k, name="t"), ["'t'", str(k)]),
        ("negative root", Inv, lambda: rt.broadcast_(f32.copy(), -1, name="t"), ["'t'", "-1"]),
        ("root not an int", Inv, lambda: rt.broadcast(f32, 0.0, name="t"), ["'t'"]),
        ("root bool", Inv, lambda: rt.broadcast(f32, True, name="t"), ["'t'"]),
        ("root async", Inv, lambda: rt.broadcast_async(f32, k + 3, name="t"), ["'t'"]),
        ("object root", Inv, lambda: rt.broadcast_object(1, k, name="t"), ["'t'"]),
        ("complex64 allreduce", Dt, lambda: rt.allreduce(c64, rt.Sum, name="t"),
         ["'t'", "complex64"]),
        ("complex64 allreduce_", Dt, lambda: rt.allreduce_(c64.copy(), rt.Sum, name="t"),
         ["'t'", "complex64"]),
        ("uint16 allreduce", Dt, lambda: rt.allreduce(np.ones(3, np.uint16), rt.Sum, name="t"),
         ["'t'", "uint16"]),
        ("bool allreduce", Dt, lambda: rt.allreduce(np.ones(3, bool), rt.Max, name="t"),
         ["'t'", "bool"]),
        ("complex64 grouped", Dt, lambda: rt.grouped_allreduce([f32, c64], rt.Sum, name="t"),
         ["'t'"]),
        ("complex64 broadcast", Dt, lambda: rt.broadcast(c64, 0, name="t"), ["'t'"]),
        ("complex64 allgather", Dt, lambda: rt.allgather(c64, name="t"), ["'t'"]),
        ("complex64 reducescatter", Dt, lambda: rt.reducescatter(c64, rt.Sum, name="t"),
         ["'t'"]),
        ("complex64 alltoall", Dt, lambda: rt.alltoall(c64, name="t"), ["'t'"]),
        ("uint16 async", Dt, lambda: rt.allreduce_async(np.ones(3, np.uint16), rt.Sum,
                                                        name="t"),
         ["'t'"]),
        ("strings", Dt, lambda: rt.allreduce(np.array(["a", "b"]), rt.Sum, name="t"), ["'t'"]),
        ("Average of int32", Inv, lambda: rt.allreduce(i32, rt.Average, name="t"),
         ["'t'", "Average"]),
        ("Average of int32 in place", Inv, lambda: rt.allreduce_(i32.copy(), name="t"),
         ["'t'", "Average"]),
        ("Average of uint8 async", Inv,
         lambda: rt.allreduce_async(np.ones(3, np.uint8), rt.Average, name="t"), ["'t'"]),
        ("Average of int64 grouped", Inv,
         lambda: rt.grouped_allreduce([f32, np.ones(2, np.int64)], rt.Average, name="t"),
         ["'t'"]),
        ("Average of int8 reducescatter", Inv,
         lambda: rt.reducescatter(np.ones(3, np.int8), rt.Average, name="t"), ["'t'"]),
        ("prescale on int32", Inv,
         lambda: rt.allreduce(i32, rt.Sum, name="t", prescale_factor=2.0), ["'t'"]),
        ("postscale on int64", Inv,
         lambda: rt.allreduce(np.ones(3, np.int64), rt.Sum, name="t", postscale_factor=0.5),
         ["'t'"]),
        ("prescale on int32 reducescatter", Inv,
         lambda: rt.reducescatter(i32, rt.Sum, name="t", prescale_factor=3.0), ["'t'"]),
        ("bad allreduce algorithm", Inv,
         lambda: rt.allreduce(f32, rt.Sum, name="t", algorithm="tree"), ["'t'", "tree"]),
        ("bad broadcast algorithm", Inv,
         lambda: rt.broadcast(f32, 0, name="t", algorithm="ring"), ["'t'", "ring"]),
        ("bad allgather algorithm", Inv,
         lambda: rt.allgather(f32, name="t", algorithm="pipeline"), ["'t'", "pipeline"]),
        ("bad reducescatter algorithm", Inv,
         lambda: rt.reducescatter(f32, rt.Sum, name="t", algorithm="binomial"),
         ["'t'", "binomial"]),
        ("bad alltoall algorithm", Inv,
         lambda: rt.alltoall(f32, name="t", algorithm="ring"), ["'t'", "ring"]),
        ("bad grouped algorithm", Inv,
         lambda: rt.grouped_allreduce([f32], rt.Sum, name="t", algorithm="bogus"), ["'t'"]),
        ("splits of the wrong length", Inv,
         lambda: rt.alltoall(f32, [2 * k] + [0] * k, name="t"), ["'t'"]),
        ("negative splits", Inv,
         lambda: rt.alltoall(f32, [2 * k + 1, -1] + [0] * (k - 2) if k >= 2 else [-1],
                             name="t"), ["'t'"]),
        ("splits with the wrong sum", Inv,
         lambda: rt.alltoall(f32, [1] * k, name="t"), ["'t'", str(2 * k)]),
        ("float splits", Inv, lambda: rt.alltoall(f32, [2.0] * k, name="t"), ["'t'"]),
        ("splits async", Inv, lambda: rt.alltoall_async(f32, [1] * (k + 1), name="t"), ["'t'"]),
        ("0-d reducescatter", Inv,
         lambda: rt.reducescatter(np.ones((), np.float32), rt.Sum, name="t"),
         ["'t'"]),
        ("0-d reducescatter async", Inv,
         lambda: rt.reducescatter_async(np.ones((), np.float64), rt.Sum, name="t"), ["'t'"]),
        ("0-d alltoall", Inv, lambda: rt.alltoall(np.ones((), np.float32), name="t"), ["'t'"]),
        ("in place on a list", Inv, lambda: rt.allreduce_([1.0, 2.0], rt.Sum, name="t"),
         ["'t'"]),
        ("in place on a read-only array", Inv,
         lambda: rt.allreduce_(np.frombuffer(b"\0" * 8, np.float32), rt.Sum, name="t"),
         ["'t'"]),
        ("broadcast_ on a read-only array", Inv,
         lambda: rt.broadcast_(np.frombuffer(b"\0" * 8, np.float32), 0, name="t"), ["'t'"]),
        ("process_set not a ProcessSet", Inv,
         lambda: rt.allreduce(f32, rt.Sum, name="t", process_set=[0]), ["'t'"]),
        ("unknown setting", Inv, lambda: rt.configure(segment_size=4), ["segment_size"]),
        ("bad setting value", Inv, lambda: rt.configure(allreduce_algorithm="tree"), ["tree"]),
    ]
    return calls


@check
def bad_arguments_raise_on_the_rank_that_made_them():
    """Every rank makes the same bad calls: each raises its own error (naming the rank),
    and the library still works after them."""
    k, me = rt.size(), rt.rank()
    for repeat in range(2):
        for label, exception, call, parts in bad_calls():
            try:
                error = expect_raises(exception, call, match=parts)
            except AssertionError as failure:
                raise AssertionError(f"{label}: {failure}") from None
            if exception is rt.InvalidArgumentError:
                assert isinstance(error, ValueError), label
            if exception is rt.UnsupportedDtypeError:
                assert isinstance(error, TypeError), label
            assert isinstance(error, rt.RingtrainError), label
            if " of tensor " in str(error):  # a collective's error names the calling rank
                assert str(error).startswith(f"rank {me}: "), f"{label}: {error}"
    library_still_works()
    assert rt.allgather_object(me) == list(range(k))


def refused_on_one_rank() -> list[tuple[str, type[BaseException], Callable[[bool], object]]]:
    """(label, the refusing rank's exception, call): ``call(refuse)`` makes the call
    with a bad argument when ``refuse``, else the same call with good ones."""
    k = rt.size()
    f32, c64 = np.ones(2 * k, np.float32), np.ones(2 * k, np.complex64)
    read_only = np.frombuffer(np.ones(2 * k, np.float32).tobytes(), np.float32)
    Inv, Dt = rt.InvalidArgumentError, rt.UnsupportedDtypeError
    return [
        ("read-only in place", Inv,
         lambda refuse: rt.allreduce_(read_only if refuse else f32.copy(), rt.Sum, name="t")),
        ("unsupported dtype", Dt,
         lambda refuse: rt.allreduce(c64 if refuse else f32, rt.Sum, name="t")),
        ("bad root", Inv, lambda refuse: rt.broadcast(f32, k if refuse else 0, name="t")),
        ("bad splits", Inv,
         lambda refuse: rt.alltoall(f32, [1] * k if refuse else None, name="t")),
        ("bad dtype in a group", Dt,
         lambda refuse: rt.grouped_allreduce([f32, c64 if refuse else f32], rt.Sum, name="t")),
        ("Average of integers in reducescatter", Inv,
         lambda refuse: rt.reducescatter(np.ones(2 * k, np.int32 if refuse else np.float32),
                                         rt.Average, name="t")),
        ("bad algorithm in allgather", Inv,
         lambda refuse: rt.allgather(f32, name="t", algorithm="tree" if refuse else None)),
        ("async", Dt,
         lambda refuse: rt.synchronize(rt.allreduce_async(c64 if refuse else f32, rt.Sum,
                                                          name="t"))),
    ]


@check(min_size=2)
def a_call_refused_on_one_rank_fails_on_every_rank():
    """One rank refuses its call (a bad argument of its own): it raises its error, every
    other rank a MismatchError naming it and why, all in one round trip, no hang."""
    k, me = rt.size(), rt.rank()
    refusing = k - 1
    for label, exception, call in refused_on_one_rank():
        started = time.perf_counter()
        if me == refusing:
            error = expect_raises(exception, call, True, match=[f"rank {me}: "])
        else:
            error = expect_raises(rt.MismatchError, call, False,
                                  match=[f"rank {refusing} refused the call",
                                         f"(rank {refusing}: "])
            assert error.differences["refused"][refusing] != "(absent)", label
        took = time.perf_counter() - started
        assert took < 1.0, f"{label}: {took:.1f} s"
        library_still_works()


@check
def exception_hierarchy():
    assert issubclass(rt.MismatchError, rt.RingtrainError)
    assert issubclass(rt.MismatchError, RuntimeError)
    assert issubclass(rt.InvalidArgumentError, ValueError)
    assert issubclass(rt.UnsupportedDtypeError, TypeError)
    assert issubclass(rt.NotInitializedError, RuntimeError)
    assert issubclass(rt.CommunicationError, RuntimeError)


if __name__ == "__main__":
    main()
