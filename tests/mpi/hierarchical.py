"""The hierarchical collectives on the node layout in force, checked against numpy.

Run: mpiexec -n K python tests/mpi/hierarchical.py [--only SUBSTRING]

The layout comes from MPI's shared-memory split, or from RINGTRAIN_NODE_SIZE (pretend
nodes of that many consecutive ranks), so the same checks run on one machine and on
(simulated) hosts.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import ringtrain as rt
from ringtrain.collectives.calls._allgather_plan import _PLANS as ALLGATHER_PLANS
from ringtrain.collectives.calls._allreduce_plan import allreduce_plan
from ringtrain.collectives.calls._reducescatter_plan import _PLANS as REDUCESCATTER_PLANS
from ringtrain.collectives.world._topology import layout_of
from ringtrain.collectives.world._world import world
from ringtrain.collectives.tuning import default_choice
from _harness import (COPY_DTYPES, OPS, REDUCE_DTYPES, Digests, all_inputs, assert_equal_arrays,
                      assert_reduced, check, configured, expect_raises, log, main, make_input,
                      reduce_reference)

ALGORITHMS = ["hierarchical", "node_leader"]


def layout():
    return layout_of(world().group, rt.current_settings())


def reducescatter_plans() -> list:
    return list(REDUCESCATTER_PLANS._plans.values())


def allgather_plans() -> list:
    return list(ALLGATHER_PLANS._plans.values())


def shapes() -> list[tuple[int, ...]]:
    k = rt.size()
    return [(0,), (), (1,), (13,), (3, 5, 7), (37 * k + 1,)]


@check
def report_layout() -> None:
    if rt.rank() == 0:
        log(f"rank 0: layout {layout().describe()}, nodes {layout().nodes}")


@check
def allreduce_every_dtype_op_and_shape() -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    with configured(segment_bytes=256):
        for algorithm in ALGORITHMS:
            for dtype in REDUCE_DTYPES:
                for op in OPS:
                    if op is rt.Average and dtype.kind in "iu":
                        continue
                    for shape in shapes():
                        for in_place in (False, True):
                            x = make_input(me, shape, dtype, op, "h")
                            what = (f"allreduce{'_' if in_place else ''}({algorithm}, "
                                    f"{op.name}, {dtype.name}, {shape})")
                            expected = reduce_reference(all_inputs(range(k), shape, dtype, op,
                                                                   "h"), op)
                            if in_place:
                                y = rt.allreduce_(x, op, name="t", algorithm=algorithm)
                                assert y is x, f"{what}: not the input array"
                            else:
                                before = x.copy()
                                y = rt.allreduce(x, op, name="t", algorithm=algorithm)
                                assert_equal_arrays(x, before, f"{what}: input afterwards")
                            assert_reduced(y, expected, dtype, what)
                            digests.add(what, y)
    digests.verify()


@check
def allreduce_large_scaled_and_grouped() -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    with configured(segment_bytes=4096):
        for algorithm in ALGORITHMS:
            for dtype in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32)):
                shape = (100_003,)
                x = make_input(me, shape, dtype, rt.Sum, "big")
                scales = (0.5, 3.0) if dtype.kind == "f" else (1.0, 1.0)
                y = rt.allreduce(x, rt.Sum, name="big", algorithm=algorithm,
                                 prescale_factor=scales[0], postscale_factor=scales[1])
                expected = reduce_reference(all_inputs(range(k), shape, dtype, rt.Sum, "big"),
                                            rt.Sum, *scales)
                assert_reduced(y, expected, dtype, f"{algorithm} {dtype} scaled")
                digests.add(f"{algorithm} {dtype}", y)
            parts = [make_input(me, (1000 + i,), d, rt.Sum, "g", i)
                     for i, d in enumerate((np.float32, np.int64, np.float32, np.float16))]
            results = rt.grouped_allreduce(parts, rt.Sum, name="g", algorithm=algorithm)
            for i, (part, result) in enumerate(zip(parts, results)):
                expected = reduce_reference(all_inputs(range(k), part.shape, part.dtype,
                                                       rt.Sum, "g", i), rt.Sum)
                assert_reduced(result, expected, part.dtype, f"grouped {algorithm} #{i}")
                digests.add(f"grouped {algorithm} #{i}", result)
    digests.verify()


@check
def compressed_between_nodes_only() -> None:
    k, me = rt.size(), rt.rank()
    digests = Digests()
    shape = (50_001,)
    for algorithm in ALGORITHMS:
        for compression, tolerance in ((rt.Compression.fp16, 2e-3), (rt.Compression.bf16, 2e-2)):
            for op in (rt.Sum, rt.Average, rt.Max):
                x = make_input(me, shape, np.float32, op, "c")
                expected = reduce_reference(all_inputs(range(k), shape, np.float32, op, "c"),
                                            op)
                for grouped in (False, True):
                    what = f"{algorithm} {compression.name} {op.name} grouped={grouped}"
                    if grouped:
                        y = rt.grouped_allreduce([x], op, name="c", algorithm=algorithm,
                                                 compression=compression)[0]
                    else:
                        y = rt.allreduce(x, op, name="c", algorithm=algorithm,
                                         compression=compression)
                    assert y.dtype == np.float32, what
                    error = np.abs(y - expected).max()
                    assert error <= tolerance * k, f"{what}: error {error}"
                    digests.add(what, y)
    digests.verify()


@check(min_size=2)
def inside_a_node_values_keep_full_precision() -> None:
    """Ranks 0 and 1 hold 1 + 2**-20 and -1 (the others 0). Cast one by one to float16
    the 2**-20 is lost; summed in float32 on their node first, it survives the cast
    (allreduce, and reducescatter on nodes of equal size)."""
    nodes = layout().nodes
    if 1 not in nodes[0]:
        return  # ranks 0 and 1 are on different nodes: nothing to show
    me = rt.rank()
    value = {0: 1.0 + 2.0 ** -20, 1: -1.0}.get(me, 0.0)
    x = np.full(1000, value, np.float32)
    for algorithm in ALGORITHMS:
        y = rt.allreduce(x, rt.Sum, name="p", algorithm=algorithm,
                         compression=rt.Compression.fp16)
        assert np.all(y == np.float32(2.0 ** -20)), f"{algorithm}: got {y[:3]}"
    flat = rt.allreduce(x, rt.Sum, name="p", algorithm="ring", compression=rt.Compression.fp16)
    assert np.all(flat == 0.0), f"flat ring with fp16: expected the loss, got {flat[:3]}"
    share = rt.reducescatter(x, rt.Sum, name="p", algorithm="hierarchical",
                             compression=rt.Compression.fp16)
    expected = 2.0 ** -20 if layout().uniform else 0.0  # the ring on unequal nodes
    assert np.all(share == np.float32(expected)), f"reducescatter: got {share[:3]}"
    flat = rt.reducescatter(x, rt.Sum, name="p", algorithm="ring",
                            compression=rt.Compression.fp16)
    assert np.all(flat == 0.0), f"flat reducescatter with fp16: got {flat[:3]}"


@check
def auto_chooses_hierarchical_on_several_nodes() -> None:
    x = np.zeros(1 << 16, np.float32)
    with configured(hierarchical_min_bytes=1 << 18, allreduce_algorithm="auto"):
        big = allreduce_plan(x, rt.Sum, "a", 1.0, 1.0, None, None, rt.Compression.none,
                             "allreduce")
        small = allreduce_plan(x[:100], rt.Sum, "a", 1.0, 1.0, None, None,
                               rt.Compression.none, "allreduce")
    assert small.algorithm in ("recursive_doubling", "ring"), small.algorithm
    if layout().pays_off:
        assert big.algorithm == "hierarchical", big.algorithm
        assert big.call.fields["layout"] == layout().describe()
    else:
        flat = default_choice("allreduce", x.nbytes, rt.size(), rt.current_settings())
        if flat == "ring" and len(layout().nodes) > 1:
            flat = "native"  # the built-in ring is for one node
        assert big.algorithm == flat, big.algorithm
        assert "layout" not in big.call.fields


def uniform_node_sizes() -> list[int]:
    """The node sizes (``node_size`` settings) that cut this world into equal nodes,
    the layout in force (0) first."""
    k = rt.size()
    return [0] + [n for n in range(1, k + 1) if k % n == 0]


@check
def reducescatter_column_by_column() -> None:
    """The hierarchical reduce-scatter on every layout of equal nodes this world has (and
    the ring in its place on unequal ones): every dtype and op, uneven shares, splits
    with empty shares, scales, 16-bit wires, several in flight."""
    k, me = rt.size(), rt.rank()
    for node_size in uniform_node_sizes():
        with configured(node_size=node_size, segment_bytes=256):
            where = f"layout {layout().describe()}"
            for dtype in REDUCE_DTYPES:
                for op in OPS:
                    if op is rt.Average and dtype.kind in "iu":
                        continue
                    for shape in ((1,), (13,), (3, 5, 7), (37 * k + 1,)):
                        x = make_input(me, shape, dtype, op, "rs")
                        full = reduce_reference(all_inputs(range(k), shape, dtype, op, "rs"),
                                                op)
                        y = rt.reducescatter(x, op, name="rs", algorithm="hierarchical")
                        assert_reduced(y, np.array_split(full, k)[me], dtype,
                                       f"reducescatter({op.name}, {dtype.name}, {shape}), "
                                       f"{where}")
            rows = 3 * k + 1
            for splits in ([rows] + [0] * (k - 1), [0] * (k - 1) + [rows],
                           [r % 3 for r in range(k - 1)] + [rows - sum(r % 3
                                                                       for r in range(k - 1))]):
                inputs = all_inputs(range(k), (rows, 2), np.float64, rt.Average, "rsp")
                y = rt.reducescatter(inputs[me], rt.Average, name="rsp", prescale_factor=0.5,
                                     postscale_factor=3.0, algorithm="hierarchical",
                                     splits=splits)
                start = sum(splits[:me])
                assert_reduced(y, reduce_reference(inputs, rt.Average, 0.5, 3.0)[
                    start:start + splits[me]], np.float64, f"splits {splits}, {where}")
            for compression, tolerance in ((rt.Compression.fp16, 2e-3),
                                           (rt.Compression.bf16, 2e-2)):
                inputs = all_inputs(range(k), (5001,), np.float32, rt.Sum, "rsc")
                y = rt.reducescatter(inputs[me], rt.Sum, name="rsc", algorithm="hierarchical",
                                     compression=compression)
                error = np.abs(y - np.array_split(reduce_reference(inputs, rt.Sum), k)[me])
                assert y.dtype == np.float32 and error.max(initial=0) <= tolerance * k, \
                    f"{compression.name}, {where}: error {error.max(initial=0)}"
            handles = [rt.reducescatter_async(make_input(me, (1000 + i,), np.int64, rt.Sum,
                                                         "rsa", i),
                                              rt.Sum, name=f"rsa{i}", algorithm="hierarchical")
                       for i in range(3)]
            for i, handle in reversed(list(enumerate(handles))):
                full = reduce_reference(all_inputs(range(k), (1000 + i,), np.int64, rt.Sum,
                                                   "rsa", i), rt.Sum)
                assert_reduced(rt.synchronize(handle), np.array_split(full, k)[me], np.int64,
                               f"reducescatter_async #{i}, {where}")


@check
def auto_gathers_and_scatters_hierarchically_across_nodes() -> None:
    """Across nodes, ``auto`` takes the hierarchical allgather and reduce-scatter from
    ``hierarchical_min_bytes`` (the reduce-scatter on equal nodes; the ring on others),
    and the results are right whichever it takes."""
    k, me = rt.size(), rt.rank()
    with configured(hierarchical_min_bytes=1 << 14, reducescatter_algorithm="auto",
                    allgather_algorithm="auto"):
        shape = (1 << 13, 3)
        x = make_input(me, shape, np.float32, rt.Sum, "auto")
        rt.reducescatter(x, rt.Sum, name="auto")
        plan = next(p for p in reducescatter_plans() if p.call.fields["name"] == "auto")
        expected = ("hierarchical" if layout().uniform else "ring") if layout().pays_off \
            else plan.chosen
        assert plan.chosen == expected, (plan.chosen, layout().describe())
        assert ("layout" in plan.call.fields) == (plan.chosen == "hierarchical"), plan.call
        full = reduce_reference(all_inputs(range(k), shape, np.float32, rt.Sum, "auto"), rt.Sum)
        assert_reduced(rt.reducescatter(x, rt.Sum, name="auto"), np.array_split(full, k)[me],
                       np.float32, f"auto reducescatter on {layout().describe()}")
        inputs = [make_input(r, (1 << 12, 2), np.int32, None, "aga") for r in range(k)]
        out = rt.allgather(inputs[me], name="aga")
        assert_equal_arrays(out, np.concatenate(inputs), "auto allgather")
        gathered = next(p for p in allgather_plans() if p.call.fields["name"] == "aga")
        assert (gathered.gather_layout is not None) == layout().pays_off, layout().describe()


@check
def broadcast_every_root() -> None:
    k, me = rt.size(), rt.rank()
    with configured(broadcast_pipeline_min_bytes=1024, segment_bytes=512):
        for root in range(k):
            for dtype in COPY_DTYPES:
                for shape in ((0,), (), (7,), (3001,)):
                    source = make_input(root, shape, dtype, None, "b")
                    mine = source.copy() if me == root else np.zeros(shape, dtype)
                    what = f"broadcast(root={root}, {dtype.name}, {shape})"
                    out = rt.broadcast(mine, root, name="b", algorithm="hierarchical")
                    assert_equal_arrays(out, source, what)
                    rt.broadcast_(mine, root, name="b", algorithm="hierarchical")
                    assert_equal_arrays(mine, source, "in place " + what)


@check
def allgather_uneven_rows() -> None:
    k, me = rt.size(), rt.rank()
    for dtype in COPY_DTYPES:
        for rows_of in (lambda r: r + 1, lambda r: 0, lambda r: (3 * r) % 4):
            for row_shape in ((), (5,)):
                inputs = [make_input(r, (rows_of(r), *row_shape), dtype, None, "ag")
                          for r in range(k)]
                out = rt.allgather(inputs[me], name="ag", algorithm="hierarchical")
                assert_equal_arrays(out, np.concatenate(inputs), f"allgather {dtype.name}")


@check(min_size=3)
def process_set_gets_its_own_layout() -> None:
    k, me = rt.size(), rt.rank()
    members = list(range(1, k))
    subset = rt.add_process_set(members)
    try:
        if me in members:
            group = subset.group("allreduce")
            sub = layout_of(group, rt.current_settings())
            assert sum(len(n) for n in sub.nodes) == len(members)
            x = make_input(me, (1001,), np.float64, rt.Sum, "ps")
            for algorithm in ALGORITHMS:
                y = rt.allreduce(x, rt.Sum, name="ps", process_set=subset, algorithm=algorithm)
                expected = reduce_reference(all_inputs(members, (1001,), np.float64, rt.Sum,
                                                       "ps"), rt.Sum)
                assert_reduced(y, expected, np.float64, f"process set {algorithm}")
            out = rt.allgather(np.full(2, me, np.int32), name="ps", process_set=subset,
                               algorithm="hierarchical")
            assert_equal_arrays(out, np.repeat(np.array(members, np.int32), 2), "ps allgather")
    finally:
        rt.remove_process_set(subset)


@check(min_size=2)
def different_layouts_are_a_mismatch_not_a_hang() -> None:
    me = rt.rank()
    with configured(node_size=1 if me == 0 else rt.size()):
        expect_raises(rt.MismatchError, rt.allreduce, np.ones(10, np.float32), rt.Sum,
                      name="lay", algorithm="hierarchical", match=["'lay'", "layout"])
        expect_raises(rt.MismatchError, rt.reducescatter, np.ones(10, np.float32), rt.Sum,
                      name="lrs", algorithm="hierarchical", match=["'lrs'", "layout"])
    y = rt.allreduce(np.ones(10, np.float32), rt.Sum, name="lay", algorithm="hierarchical")
    assert np.all(y == rt.size())


@check
def nodes_interleaved_in_rank_order() -> None:
    """ringtrain started on a communicator whose ranks alternate between the nodes: the
    node blocks are not contiguous in rank order."""
    k = rt.size()
    with configured(node_size=0):
        nodes = layout().nodes
    order = [n[i] for i in range(max(len(n) for n in nodes)) for n in nodes if i < len(n)]
    rt.shutdown()
    comm = MPI.COMM_WORLD.Split(0, order.index(MPI.COMM_WORLD.Get_rank()))
    try:
        rt.init(comm)
        me = rt.rank()
        with configured(node_size=0, hierarchical_min_bytes=0):
            digests = Digests()
            x = make_input(me, (10_007,), np.float32, rt.Sum, "il")
            expected = reduce_reference(all_inputs(range(k), (10_007,), np.float32, rt.Sum,
                                                   "il"), rt.Sum)
            for algorithm in ALGORITHMS + ["auto"]:
                y = rt.allreduce(x, rt.Sum, name="il", algorithm=algorithm)
                assert_reduced(y, expected, np.float32, f"interleaved {algorithm}")
                digests.add(algorithm, y)
            digests.verify(comm)
            inputs = [make_input(r, (r + 2, 3), np.int16, None, "il") for r in range(k)]
            out = rt.allgather(inputs[me], name="il", algorithm="hierarchical")
            assert_equal_arrays(out, np.concatenate(inputs), "interleaved allgather")
            for splits in (None, [r + 1 for r in range(k - 1)] + [20 - k * (k - 1) // 2]):
                scattered = rt.reducescatter(x[:20], rt.Sum, name="ilr", splits=splits,
                                             algorithm="hierarchical")
                shares = np.split(expected[:20], np.cumsum(splits)[:-1]) if splits else \
                    np.array_split(expected[:20], k)
                assert_reduced(scattered, shares[me], np.float32,
                               f"interleaved reducescatter splits={splits}")
            for root in range(k):
                data = make_input(root, (2049,), np.float64, None, "ilb")
                out = rt.broadcast(data if me == root else np.zeros_like(data), root,
                                   algorithm="hierarchical")
                assert_equal_arrays(out, data, f"interleaved broadcast root {root}")
    finally:
        rt.shutdown()
        comm.Free()
        rt.init()


if __name__ == "__main__":
    main()
