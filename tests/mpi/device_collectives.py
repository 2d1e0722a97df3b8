"""Every collective with device tensors, checked against numpy and against the same call on
host arrays, in the mode that RINGTRAIN_CUDA_AWARE_MPI forces (0: through pinned host
memory, 1: device pointers straight to MPI).

Without a GPU it runs under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) on two kinds
of device array: objects exposing ``__cuda_array_interface__`` over host memory (whose
results come back as numba device arrays) and the simulator's own arrays. On a GPU it
runs on CuPy arrays, torch CUDA tensors and numba device arrays, whichever are installed.
bfloat16 runs on ringtrain's bfloat16 device arrays, torch CUDA tensors on a GPU, and
under the simulator also on the two kinds above (bfloat16 host memory; the interface's
typestr is ``"bfloat16"``).

Run: NUMBA_ENABLE_CUDASIM=1 RINGTRAIN_CUDA_AWARE_MPI=0 mpiexec -n K \
         python tests/mpi/device_collectives.py [--only SUBSTRING]
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from numba import cuda

import ringtrain as rt
from ringtrain.collectives import Compression
from ringtrain.collectives.timeline import rank_path
from ringtrain.kernels.device import SIMULATED
from _harness import (COPY_DTYPES, REDUCE_DTYPES, Digests, all_inputs, assert_equal_arrays,
                      assert_reduced, check, configured, expect_raises, main, make_input,
                      reduce_reference, rng)

AWARE = os.environ.get("RINGTRAIN_CUDA_AWARE_MPI") == "1"
# auto reduces device tensors through IPC at every size here, so small arrays test it
os.environ.setdefault("RINGTRAIN_IPC_MIN_BYTES", "0")
BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(), (0,), (13,), (3, 5)]
FEW_DTYPES = [np.dtype(np.float32), np.dtype(np.int64)]


class HostBackedDeviceArray:
    """An array that says it lives in device memory (``__cuda_array_interface__``) while
    its memory is host memory: under the simulator, device memory is host memory."""

    def __init__(self, values: np.ndarray, strides: tuple[int, ...] | None = None):
        self.host = values
        self.strides = strides

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = "bfloat16" if self.host.dtype == BF16 else self.host.dtype.str
        return {"version": 3, "data": (self.host.ctypes.data, False),
                "shape": self.host.shape if self.strides is None else (self.host.shape[0] // 2,),
                "typestr": typestr, "strides": self.strides, "stream": None}


def _kinds() -> dict[str, tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray], type]]:
    """Each kind of device array: (from host, to host, the type results come back as)."""
    if SIMULATED:
        simulated = type(cuda.to_device(np.zeros(1)))
        return {"interface": (lambda a: HostBackedDeviceArray(a.copy()),
                              lambda d: d.host.copy() if isinstance(d, HostBackedDeviceArray)
                              else d.copy_to_host(), simulated),
                "numba": (cuda.to_device, lambda d: d.copy_to_host(), simulated)}
    kinds = {"numba": (cuda.to_device, lambda d: d.copy_to_host(),
                       type(cuda.to_device(np.zeros(1))))}
    try:
        import cupy
        kinds["cupy"] = (cupy.asarray, cupy.asnumpy, cupy.ndarray)
    except ImportError:
        pass
    try:
        import torch
        if torch.cuda.is_available():
            kinds["torch"] = (lambda a: torch.from_numpy(a.copy()).cuda(),
                              lambda t: t.cpu().numpy(), torch.Tensor)
    except ImportError:
        pass
    return kinds


KINDS = _kinds()


def each_kind() -> list[tuple[str, Callable, Callable, type]]:
    return [(kind, *functions) for kind, functions in KINDS.items()]


def assert_kind(result: Any, result_type: type, what: str) -> None:
    assert isinstance(result, result_type), \
        f"{what}: got a {type(result).__name__}, expected a {result_type.__name__}"


def host_twin(algorithm: str, dtype: np.dtype) -> str:
    """The host algorithm whose bits a device allreduce asked for with ``algorithm`` has:
    device memory MPI does not reduce (staged mode, or a 16-bit float) goes through CUDA
    IPC on one node with ``auto``, in the ring's order."""
    direct = AWARE and dtype not in (np.dtype(np.float16), BF16)
    return "ring" if algorithm in ("auto", "ipc") and rt.size() > 1 and not direct \
        else algorithm


def ops_for(dtype: np.dtype) -> list[rt.ReduceOp]:
    if dtype.kind != "f":
        return [rt.Sum, rt.Min, rt.Max, rt.Product]
    return [rt.Sum, rt.Average, rt.Min, rt.Max, rt.Product]


@check
def allreduce_every_dtype_and_op():
    ranks, me = range(rt.size()), rt.rank()
    digests = Digests()
    for number, (kind, down, up, result_type) in enumerate(each_kind()):
        # every dtype on the first kind of array; the others share its code past the adapter
        for dtype in REDUCE_DTYPES if number == 0 else FEW_DTYPES:
            for op in ops_for(dtype):
                for shape in SHAPES + [(37 * rt.size() + 1,)]:
                    key = ("device allreduce", kind)
                    mine = make_input(me, shape, dtype, op, *key)
                    expected = reduce_reference(all_inputs(ranks, shape, dtype, op, *key), op)
                    what = f"{kind} {dtype} {op.name} {shape}"
                    result = rt.allreduce(down(mine), op=op, name="t")
                    assert_kind(result, result_type, what)
                    assert_reduced(up(result), expected, dtype, what)
                    digests.add(what, up(result))
                    tensor = down(mine)
                    assert rt.allreduce_(tensor, op=op, name="t") is tensor, what
                    assert_reduced(up(tensor), expected, dtype, what + " in place")
                    handle = rt.allreduce_async(down(mine), op=op, name="t")
                    assert_reduced(up(rt.synchronize(handle)), expected, dtype, what + " async")
    digests.verify()


@check
def allreduce_matches_host_arrays():
    """Through host memory or IPC the device result has the host result's bits; with
    device pointers MPI reduces, and only the values are compared."""
    me = rt.rank()
    for kind, down, up, _ in each_kind():
        for dtype in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32)):
            for algorithm in ("auto", "ring", "recursive_doubling"):
                for prescale, postscale in ((1.0, 1.0), (0.5, 3.0)):
                    if dtype.kind != "f" and (prescale, postscale) != (1.0, 1.0):
                        continue
                    op = rt.Average if dtype.kind == "f" else rt.Sum
                    mine = make_input(me, (101,), dtype, op, "versus host", kind)
                    options = dict(op=op, name="v", algorithm=algorithm,
                                   prescale_factor=prescale, postscale_factor=postscale)
                    host = rt.allreduce(mine, **dict(options,
                                                     algorithm=host_twin(algorithm, dtype)))
                    device = up(rt.allreduce(down(mine), **options))
                    what = f"{kind} {dtype} {algorithm} scales {prescale}/{postscale}"
                    if AWARE and algorithm == "auto" and dtype.kind == "f":
                        assert np.allclose(device, host, rtol=1e-6, atol=1e-12), what
                    else:
                        assert_equal_arrays(device, host, what)


@check
def allreduce_long_enough_to_pipeline():
    """More bytes than one segment of the copy pipeline (segments are shrunk here): each
    segment is reduced on its own, so the bits may differ from one host call's."""
    from ringtrain.collectives.memory import _staging
    ranks, me = range(rt.size()), rt.rank()
    digests = Digests()
    saved = _staging.PIPELINE_BYTES
    _staging.PIPELINE_BYTES = 4096
    try:
        for kind, down, up, _ in each_kind():
            for shape in ((5000,), (4096 // 4 * 3,)):
                for compression in (Compression.none, Compression.fp16):
                    mine = make_input(me, shape, np.float32, rt.Sum, "pipelined")
                    expected = reduce_reference(
                        all_inputs(ranks, shape, np.float32, rt.Sum, "pipelined"), rt.Sum)
                    result = up(rt.allreduce(down(mine), op=rt.Sum, algorithm="ring",
                                             compression=compression))
                    what = f"{kind} {shape} {compression.name}"
                    digests.add(what, result)
                    if compression is Compression.none:
                        assert_reduced(result, expected, np.dtype(np.float32), what)
                    else:
                        assert np.allclose(result, expected, rtol=1e-2, atol=1e-2), what
    finally:
        _staging.PIPELINE_BYTES = saved
    digests.verify()


@check
def compression_casts_on_the_device():
    me = rt.rank()
    for kind, down, up, _ in each_kind():
        for compression in (Compression.fp16, Compression.bf16):
            for op in (rt.Average, rt.Max):
                for algorithm in ("ring", "auto"):
                    mine = rng(me, "compressed", kind).standard_normal(77).astype(np.float32)
                    options = dict(op=op, algorithm=algorithm, compression=compression,
                                   prescale_factor=2.0, postscale_factor=0.25)
                    what = f"{kind} {compression.name} {op.name} {algorithm}"
                    expected = rt.allreduce(mine, **options)
                    result = up(rt.allreduce(down(mine), **options))
                    if algorithm == "ring":
                        assert_equal_arrays(result, expected, what)
                    else:
                        assert np.allclose(result, expected, rtol=1e-2, atol=1e-2), what
                    tensor = down(mine)
                    rt.allreduce_(tensor, **options)
                    assert np.allclose(up(tensor), expected, rtol=1e-2, atol=1e-2), what


@check
def grouped_allreduce_fuses_on_the_device():
    ranks, me = range(rt.size()), rt.rank()
    # float16 tensors share their dtype with the fp16 wire format
    shapes = [(3, 4), (5,), (), (0,), (7,), (6,), (4,)]
    dtypes = [np.float32, np.float64, np.float32, np.int32, np.float32, np.float16, np.int16]
    for kind, down, up, result_type in each_kind():
        for compression in (Compression.none, Compression.fp16, Compression.bf16):
            mine = [make_input(me, s, d, rt.Sum, "grouped", i)
                    for i, (s, d) in enumerate(zip(shapes, dtypes))]
            expected = [reduce_reference(all_inputs(ranks, s, d, rt.Sum, "grouped", i), rt.Sum)
                        for i, (s, d) in enumerate(zip(shapes, dtypes))]
            what = f"{kind} grouped {compression.name}"
            results = rt.grouped_allreduce([down(x) for x in mine], op=rt.Sum,
                                           compression=compression)
            tensors = [down(x) for x in mine]
            returned = rt.grouped_allreduce_(tensors, op=rt.Sum, compression=compression)
            assert all(a is b for a, b in zip(returned, tensors)), what
            for index, (result, tensor, reference) in enumerate(zip(results, tensors,
                                                                    expected)):
                assert_kind(result, result_type, what)
                dtype = np.dtype(dtypes[index])
                if compression is not Compression.none and dtype == np.float32:
                    assert np.allclose(up(result), reference, rtol=1e-2, atol=1e-2), what
                    assert np.allclose(up(tensor), reference, rtol=1e-2, atol=1e-2), what
                else:
                    assert_reduced(up(result), reference, dtype, f"{what} #{index}")
                    assert_reduced(up(tensor), reference, dtype, f"{what} #{index} in place")
            average = rt.grouped_allreduce([down(x) for x in mine[:2]], op=rt.Average,
                                           postscale_factor=2.0)
            for result, reference, dtype in zip(average, expected, dtypes):
                assert_reduced(up(result), reference / rt.size() * 2.0, np.dtype(dtype),
                               what + " Average")


@check
def broadcast_from_every_root():
    me = rt.rank()
    for number, (kind, down, up, result_type) in enumerate(each_kind()):
        for dtype in COPY_DTYPES if number == 0 else FEW_DTYPES:
            for shape in ((), (0,), (11,), (2, 3)):
                for root in range(rt.size()):
                    data = make_input(root, shape, dtype, None, "device broadcast", kind)
                    mine = make_input(me, shape, dtype, None, "device broadcast", kind)
                    what = f"{kind} {dtype} {shape} root {root}"
                    result = rt.broadcast(down(mine), root_rank=root)
                    assert_kind(result, result_type, what)
                    assert_equal_arrays(up(result), data, what)
                    tensor = down(mine)
                    assert rt.broadcast_(tensor, root_rank=root) is tensor, what
                    assert_equal_arrays(up(tensor), data, what + " in place")


@check
def allgather_uneven_rows():
    k, me = rt.size(), rt.rank()
    for kind, down, up, result_type in each_kind():
        for dtype in COPY_DTYPES:
            for row in ((), (3,)):
                parts = [make_input(r, (r % 3, *row), dtype, None, "gather", kind)
                         for r in range(k)]
                result = rt.allgather(down(parts[me]))
                what = f"{kind} {dtype} rows of {row}"
                assert_kind(result, result_type, what)
                assert_equal_arrays(up(result), np.concatenate(parts), what)
        scalar = rt.allgather(down(np.array(me + 0.5)))
        assert_equal_arrays(up(scalar), np.arange(k) + 0.5, f"{kind} 0-d")


@check
def alltoall_uneven_splits():
    k, me = rt.size(), rt.rank()
    for kind, down, up, result_type in each_kind():
        for dtype in (np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.bool_)):
            splits = [(me + r) % 3 for r in range(k)]
            data = make_input(me, (sum(splits), 2), dtype, None, "alltoall", kind)
            result, received = rt.alltoall(down(data), splits=splits)
            what = f"{kind} {dtype}"
            assert_kind(result, result_type, what)
            pieces = []
            for sender in range(k):
                theirs = [(sender + r) % 3 for r in range(k)]
                rows = make_input(sender, (sum(theirs), 2), dtype, None, "alltoall", kind)
                start = sum(theirs[:me])
                pieces.append(rows[start:start + theirs[me]])
            assert_equal_arrays(up(result), np.concatenate(pieces), what)
            assert list(np.asarray(received)) == [(r + me) % 3 for r in range(k)], what


@check
def reducescatter_uneven_rows():
    ranks, k, me = range(rt.size()), rt.size(), rt.rank()
    for kind, down, up, result_type in each_kind():
        for dtype in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int32)):
            for op in (rt.Sum, rt.Max) if dtype.kind != "f" else (rt.Average, rt.Min):
                shape = (2 * k + 1, 3)
                mine = make_input(me, shape, dtype, op, "reducescatter", kind)
                full = reduce_reference(all_inputs(ranks, shape, dtype, op, "reducescatter",
                                                   kind), op)
                base, extra = divmod(shape[0], k)
                bounds = np.cumsum([0] + [base + (r < extra) for r in range(k)])
                result = rt.reducescatter(down(mine), op=op)
                what = f"{kind} {dtype} {op.name}"
                assert_kind(result, result_type, what)
                assert_reduced(up(result), full[bounds[me]:bounds[me + 1]], dtype, what)


@check
def the_path_taken():
    """Staged calls copy through host memory, except allreduce between ranks, which runs
    on the GPUs through IPC; CUDA-aware ones hand MPI device memory."""
    path = os.path.join(tempfile.gettempdir(), f"ringtrain-device-path-{os.getpid()}.json")
    written = rank_path(path, rt.rank(), rt.size())
    kind, (down, up, _) = next(iter(KINDS.items()))
    rt.start_timeline(path)
    try:
        rt.allreduce(down(np.ones(64, np.float32)), op=rt.Sum, name="path")
        rt.broadcast(down(np.ones(8, np.int32)), root_rank=0, name="path")
    finally:
        rt.stop_timeline()
    with open(written) as file:
        text = file.read()
    os.remove(written)
    copies = "copy to host" in text
    assert copies == (not AWARE), \
        f"{kind}: copies through host memory {'seen' if copies else 'missing'} with " \
        f"RINGTRAIN_CUDA_AWARE_MPI={int(AWARE)}"
    if AWARE and rt.size() > 1:
        assert "MPI allreduce" in text and "MPI broadcast" in text, text[:2000]
    through_ipc = '"copy in"' in text
    assert through_ipc == (not AWARE and rt.size() > 1), \
        f"{kind}: the IPC allreduce {'seen' if through_ipc else 'missing'}: {text[:2000]}"
    with configured(ipc_min_bytes=257):  # below it, auto goes through host memory
        rt.start_timeline(path)
        try:
            rt.allreduce(down(np.ones(64, np.float16)), op=rt.Sum, name="small")
            rt.allreduce(down(np.ones(129, np.float16)), op=rt.Sum, name="large")
        finally:
            rt.stop_timeline()
    with open(written) as file:
        rows = [line for line in file if '"copy in"' in line or '"copy to host"' in line]
    os.remove(written)
    if rt.size() > 1:
        assert len(rows) == 2 and "copy to host" in rows[0] and "copy in" in rows[1], rows


@check(min_size=2)
def ipc_buffers_grow_and_are_mapped_once():
    """Each group maps its peers' buffers once; a larger call grows every rank's buffer
    (handles exchanged again) and the results keep the ring's bits; ``algorithm="ipc"``
    is refused for host arrays."""
    from ringtrain.collectives.algorithms import _ipc
    from ringtrain.collectives.world._process_sets import resolve_group
    kind, (down, up, _) = next(iter(KINDS.items()))
    process_set = rt.add_process_set(list(range(rt.size())))
    saved = _ipc.GRANULE
    _ipc.GRANULE = 256  # growth at small sizes, which the simulator reduces quickly
    try:
        buffers = _ipc.node_buffers(resolve_group(process_set, "allreduce", None), 0)
        opened = []
        for count in (10, 10, 300, 40, 1000, 1000):
            for dtype in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int16)):
                op = rt.Average if dtype.kind == "f" else rt.Sum
                mine = make_input(rt.rank(), (count,), dtype, op, "grow", count)
                options = dict(op=op, name="grow", process_set=process_set)
                host = rt.allreduce(mine, **dict(options, algorithm="ring"))
                device = rt.allreduce(down(mine), **dict(options, algorithm="ipc"))
                assert_equal_arrays(up(device), host, f"{kind} {dtype} {count} elements")
            opened.append((buffers.capacity, sorted(buffers.peers)))
        assert buffers.unavailable is None, buffers.unavailable
        capacities = [capacity for capacity, _ in opened]
        assert capacities == sorted(capacities) and capacities[0] < capacities[-1], opened
        assert capacities[0] == capacities[1] and capacities[-2] == capacities[-1], opened
        assert all(peers == [r for r in range(rt.size()) if r != rt.rank()]
                   for _, peers in opened), opened
        # what a shape of call works on is set up once per exchange of the buffers
        float32 = np.dtype(np.float32)
        kept = buffers.steps(1000, float32)
        rt.allreduce(down(np.ones(1000, np.float32)), name="grow", process_set=process_set,
                     algorithm="ipc")
        assert buffers.steps(1000, float32) is kept
    finally:
        _ipc.GRANULE = saved
        rt.remove_process_set(process_set)
    expect_raises(rt.InvalidArgumentError, rt.allreduce, np.ones(3, np.float32),
                  name="host", algorithm="ipc", match=["'host'", "ipc", "GPU memory"])


@check(min_size=3)
def hierarchical_reduces_inside_nodes_on_the_gpus():
    """Nodes of two ranks (``node_size=2``): with nodes of equal size the hierarchical
    allreduce of device memory sums each chunk inside the node through CUDA IPC and
    only the node sums cross the nodes, through host memory; with unequal nodes it goes
    through host memory. Either way the result has the host algorithm's bits."""
    path = os.path.join(tempfile.gettempdir(), f"ringtrain-device-nodes-{os.getpid()}.json")
    written = rank_path(path, rt.rank(), rt.size())
    kind, (down, up, _) = next(iter(KINDS.items()))
    inside = rt.size() % 2 == 0
    with configured(node_size=2):
        rt.start_timeline(path)
        try:
            for dtype in (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int32)):
                for op in ops_for(dtype)[:3]:
                    for count in (1, 13, 37 * rt.size() + 1):
                        what = f"{kind} {dtype} {op.name} {count}"
                        mine = make_input(rt.rank(), (count,), dtype, op, "nodes", count)
                        options = dict(op=op, name="nodes", algorithm="hierarchical")
                        host = rt.allreduce(mine, **options)
                        device = rt.allreduce(down(mine), **options)
                        assert_equal_arrays(up(device), host, what)
                        tensor = down(mine)
                        rt.allreduce_(tensor, **options)
                        assert_equal_arrays(up(tensor), host, what + " in place")
            mine = make_input(rt.rank(), (300,), np.dtype(np.float32), rt.Sum, "nodes fp16")
            expected = rt.allreduce(mine, op=rt.Sum, name="fp16", algorithm="hierarchical",
                                    compression=Compression.fp16)
            device = rt.allreduce(down(mine), op=rt.Sum, name="fp16",
                                  algorithm="hierarchical", compression=Compression.fp16)
            np.testing.assert_allclose(up(device), expected, rtol=2e-3, atol=2e-3)
        finally:
            rt.stop_timeline()
    with open(written) as file:
        text = file.read()
    os.remove(written)
    assert ('"copy in"' in text) == inside, \
        f"{kind}: nodes of {'equal' if inside else 'unequal'} size, IPC inside them " \
        f"{'missing' if inside else 'seen'}: {text[:2000]}"


@check(min_size=2)
def ipc_refused_by_one_rank_falls_back_on_every_rank():
    """A rank that cannot map a peer's buffer makes the whole group reduce through host
    memory, with the same results, and says which rank and why."""
    from ringtrain.collectives.algorithms import _ipc
    from ringtrain.collectives.world._process_sets import resolve_group
    from ringtrain.kernels import ipc
    kind, (down, up, _) = next(iter(KINDS.items()))
    process_set = rt.add_process_set(list(range(rt.size())))
    saved = ipc.open_peer
    if rt.rank() == rt.size() - 1:
        def refuse(handle: Any) -> Any:
            raise ipc.IpcUnavailableError("no peer access (refused by the test)")
        ipc.open_peer = refuse
    try:
        for round_ in range(2):
            # float16: never handed to MPI, so IPC is tried in both modes
            mine = make_input(rt.rank(), (77,), np.float16, rt.Sum, "fallback", round_)
            host = rt.allreduce(mine, op=rt.Sum)  # staged: the host's own choice
            device = rt.allreduce(down(mine), op=rt.Sum, process_set=process_set)
            assert_equal_arrays(up(device), host, f"{kind} round {round_}")
        buffers = _ipc.node_buffers(resolve_group(process_set, "allreduce", None), 0)
        assert buffers.unavailable == \
            f"rank {rt.size() - 1}: no peer access (refused by the test)", buffers.unavailable
        assert buffers.own is None and not buffers.peers
    finally:
        ipc.open_peer = saved
        rt.remove_process_set(process_set)


@check(min_size=4)
def hierarchical_refused_on_one_node_goes_through_host_memory_everywhere():
    """A node whose ranks cannot share device memory makes every node's ranks take the
    hierarchical allreduce through host memory, with the same bits."""
    from ringtrain.collectives.algorithms import _ipc
    from ringtrain.collectives.world._process_sets import resolve_group
    from ringtrain.collectives.world._topology import hierarchy_for, layout_of
    from ringtrain.kernels import ipc
    kind, (down, up, _) = next(iter(KINDS.items()))
    process_set = rt.add_process_set(list(range(4)))
    saved = ipc.open_peer
    if rt.rank() in (2, 3):
        def refuse(handle: Any) -> Any:
            raise ipc.IpcUnavailableError("no peer access (refused by the test)")
        ipc.open_peer = refuse
    try:
        with configured(node_size=2) as settings:
            if rt.rank() < 4:
                for round_ in range(2):
                    mine = make_input(rt.rank(), (77,), np.float32, rt.Sum, "refused", round_)
                    options = dict(op=rt.Sum, algorithm="hierarchical", process_set=process_set)
                    host = rt.allreduce(mine, **options)
                    device = rt.allreduce(down(mine), **options)
                    assert_equal_arrays(up(device), host, f"{kind} round {round_}")
                group = resolve_group(process_set, "allreduce", None)
                local = hierarchy_for(group, layout_of(group, settings)).local
                buffers = _ipc.node_buffers(local, 0)
                assert buffers.unavailable is not None and buffers.own is None, \
                    buffers.unavailable
    finally:
        ipc.open_peer = saved
        rt.remove_process_set(process_set)


@check
def bad_device_input_is_refused():
    for kind, down, up, _ in each_kind():
        if rt.size() > 1:
            mismatched = (5,) if rt.rank() == 0 else (6,)
            expect_raises(rt.MismatchError, rt.allreduce,
                          down(np.ones(mismatched, np.float32)), name="weights",
                          match=["'weights'", "shape"])
        expect_raises(rt.UnsupportedDtypeError, rt.allreduce,
                      down(np.ones(3, np.complex64)), name="z", match=["'z'", "complex64"])
        expect_raises(rt.InvalidArgumentError, rt.grouped_allreduce,
                      [down(np.ones(2, np.float32)), np.ones(2, np.float32)], name="mixed",
                      match=["'mixed'", "host memory"])
    if SIMULATED:
        strided = HostBackedDeviceArray(np.ones(8, np.float32), strides=(8,))
        expect_raises(rt.InvalidArgumentError, rt.allreduce, strided, name="strided",
                      match=["'strided'", "contiguous"])
        if rt.size() > 1:
            # Refused on the last rank only: it raises its own error, the others a
            # MismatchError naming it, within a second, never a hang.
            last = rt.size() - 1
            mine = strided if rt.rank() == last else HostBackedDeviceArray(np.ones(4, np.float32))
            started = time.perf_counter()
            expect_raises(rt.InvalidArgumentError if rt.rank() == last else rt.MismatchError,
                          rt.allreduce_, mine, name="strided",
                          match=["'strided'", "contiguous" if rt.rank() == last
                                 else f"rank {last} refused the call"])
            assert time.perf_counter() - started < 1.0
    if rt.size() > 1:
        kind, (down, up, _) = next(iter(KINDS.items()))
        tensor = down(np.ones(4, np.float32)) if rt.rank() == 0 else np.ones(4, np.float32)
        expect_raises(rt.MismatchError, rt.allreduce, tensor, name="where",
                      match=["'where'", "memory"])


@check
def ops_in_flight_keep_their_order():
    """Several asynchronous calls on device tensors, synchronized in reverse."""
    ranks, me = range(rt.size()), rt.rank()
    for kind, down, up, _ in each_kind():
        with configured(allreduce_algorithm="ring"):
            inputs = [make_input(me, (9 + i,), np.float32, rt.Sum, "async", i) for i in range(4)]
            handles = [rt.allreduce_async(down(x), op=rt.Sum, name=f"a{i}")
                       for i, x in enumerate(inputs)]
            for i in reversed(range(4)):
                expected = reduce_reference(all_inputs(ranks, (9 + i,), np.float32, rt.Sum,
                                                       "async", i), rt.Sum)
                assert_reduced(up(rt.synchronize(handles[i])), expected,
                               np.dtype(np.float32), f"{kind} async {i}")


@check(min_size=2)
def joined_rank_takes_part_with_device_zeros():
    """A rank that joined replays the others' device calls the way they travel (here in
    several pipeline segments)."""
    import ringtrain.collectives as rtc
    from ringtrain.collectives.memory import _staging
    k, me = rt.size(), rt.rank()
    saved = _staging.PIPELINE_BYTES
    _staging.PIPELINE_BYTES = 4096
    try:
        for kind, down, up, _ in each_kind():
            first = k - 1
            active = [r for r in range(k) if r != first]
            if me != first:
                for compression in (Compression.none, Compression.fp16):
                    key = ("device join", kind, compression.name)
                    mine = make_input(me, (3000,), np.float32, rt.Sum, *key)
                    expected = reduce_reference(
                        [make_input(r, (3000,), np.float32, rt.Sum, *key) for r in active],
                        rt.Sum)
                    got = up(rt.allreduce(down(mine), op=rt.Sum, name="j",
                                          compression=compression))
                    tolerance = 1e-5 if compression is Compression.none else 1e-2
                    assert np.allclose(got, expected, rtol=tolerance, atol=tolerance), kind
                grouped = rt.grouped_allreduce([down(np.ones(7, np.float32)),
                                                down(np.ones(2, np.int64))], op=rt.Sum)
                assert [up(g).tolist() for g in grouped] == \
                    [[k - 1.0] * 7, [k - 1] * 2], kind
            assert rtc.join() == (max(active) if me != first or k > 1 else me)
    finally:
        _staging.PIPELINE_BYTES = saved


# --------------------------------------------------------------------------- bfloat16

def _bfloat16_kinds() -> dict[str, tuple[Callable, Callable, type]]:
    """Each kind of device array that holds bfloat16: (from host, to host, result type)."""
    from ringtrain.kernels.device import BfloatDeviceArray
    kinds = {"ringtrain": (lambda a: BfloatDeviceArray(cuda.to_device(
        np.ascontiguousarray(a).view(np.uint16))), lambda d: d.copy_to_host(),
        BfloatDeviceArray)}
    if SIMULATED:
        kinds["interface"] = (lambda a: HostBackedDeviceArray(a.copy()),
                              lambda d: d.host.copy() if isinstance(d, HostBackedDeviceArray)
                              else d.copy_to_host(), BfloatDeviceArray)
        kinds["numba"] = (cuda.to_device, lambda d: d.copy_to_host(), BfloatDeviceArray)
    if "torch" in KINDS:
        import torch
        kinds["torch"] = (
            lambda a: torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda(),
            lambda t: t.cpu().view(torch.int16).numpy().view(BF16), torch.Tensor)
    return kinds


BFLOAT16_KINDS = _bfloat16_kinds()


def bfloat16_input(rank: int, shape: tuple[int, ...], op: rt.ReduceOp, *key: object
                   ) -> np.ndarray:
    """bfloat16 values: small integers for Product (exact), else in [-1, 1]."""
    g = rng(rank, tuple(shape), "bfloat16", getattr(op, "name", op), *key)
    if op is rt.Product:
        return np.asarray(g.choice(np.array([-2.0, -1.0, 1.0, 2.0]), size=shape)).astype(BF16)
    return np.asarray(g.uniform(-1.0, 1.0, size=shape), np.float32).astype(BF16)


def assert_same_bfloat16(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == BF16 and expected.dtype == BF16, \
        f"{what}: dtypes {actual.dtype}, {expected.dtype}"
    assert_equal_arrays(np.ascontiguousarray(actual).view(np.uint16),
                        np.ascontiguousarray(expected).view(np.uint16), what)


@check
def bfloat16_reductions_have_the_host_bits():
    """bfloat16 reductions travel through host memory or IPC in both modes (MPI has no
    bfloat16) and give the host call's bits: the same kernels, in float32, rounded once
    per step."""
    me, k = rt.rank(), rt.size()
    digests = Digests()
    for number, (kind, (down, up, result_type)) in enumerate(BFLOAT16_KINDS.items()):
        # every algorithm on the first kind of array; the others share its code past the
        # adapter
        algorithms = ("auto", "ring", "native") if number == 0 else ("auto",)
        for op in (rt.Sum, rt.Average, rt.Min, rt.Max, rt.Product):
            for shape in ((), (0,), (13,), (37 * k + 1,)):
                for algorithm in algorithms:
                    mine = bfloat16_input(me, shape, op, "device", kind)
                    options = dict(op=op, name="bf", algorithm=algorithm)
                    if op is not rt.Product:
                        options.update(prescale_factor=0.5, postscale_factor=3.0)
                    host = rt.allreduce(mine, **dict(options,
                                                     algorithm=host_twin(algorithm, BF16)))
                    what = f"{kind} bfloat16 {op.name} {shape} {algorithm}"
                    result = rt.allreduce(down(mine), **options)
                    assert_kind(result, result_type, what)
                    assert_same_bfloat16(up(result), host, what)
                    tensor = down(mine)
                    assert rt.allreduce_(tensor, **options) is tensor, what
                    assert_same_bfloat16(up(tensor), host, what + " in place")
                    digests.add(what, up(result))
            handle = rt.allreduce_async(down(bfloat16_input(me, (5,), op, "async")), op=op)
            assert_same_bfloat16(up(rt.synchronize(handle)),
                                 rt.allreduce(bfloat16_input(me, (5,), op, "async"), op=op,
                                              algorithm=host_twin("auto", BF16)),
                                 f"{kind} async {op.name}")
        shape = (2 * k + 1, 3)
        mine = bfloat16_input(me, shape, rt.Average, "reducescatter", kind)
        result = rt.reducescatter(down(mine), op=rt.Average)
        assert_kind(result, result_type, f"{kind} reducescatter")
        assert_same_bfloat16(up(result), rt.reducescatter(mine, op=rt.Average),
                             f"{kind} reducescatter")
    digests.verify()


@check
def bfloat16_grouped_with_other_dtypes_on_the_device():
    me = rt.rank()
    shapes = [(3, 4), (5,), (), (7,), (0,)]
    dtypes = [BF16, np.dtype(np.float32), BF16, BF16, np.dtype(np.float32)]
    for kind, (down, up, result_type) in BFLOAT16_KINDS.items():
        mine = [bfloat16_input(me, s, rt.Sum, "grouped", i).astype(d)
                for i, (s, d) in enumerate(zip(shapes, dtypes))]
        plain = [x.astype(np.float32) if d == np.float32 else x for x, d in zip(mine, dtypes)]

        def on_device(x: np.ndarray) -> Any:
            if x.dtype == BF16:
                return down(x)
            return KINDS[kind][0](x) if kind in KINDS else cuda.to_device(x)

        for op, scales in ((rt.Sum, (1.0, 1.0)), (rt.Average, (0.5, 2.0))):
            options = dict(op=op, name="g", prescale_factor=scales[0],
                           postscale_factor=scales[1])
            host = rt.grouped_allreduce(plain, **options, algorithm=host_twin("auto", BF16))
            results = rt.grouped_allreduce([on_device(x) for x in plain], **options)
            tensors = [on_device(x) for x in plain]
            returned = rt.grouped_allreduce_(tensors, **options)
            assert all(a is b for a, b in zip(returned, tensors))
            for index, dtype in enumerate(dtypes):
                if dtype != BF16:
                    continue
                what = f"{kind} grouped {op.name} #{index}"
                assert_kind(results[index], result_type, what)
                assert_same_bfloat16(up(results[index]), host[index], what)
                assert_same_bfloat16(up(tensors[index]), host[index], what + " in place")


@check
def bfloat16_copies_keep_their_bits():
    me, k = rt.rank(), rt.size()

    def bits(rank: int, shape: tuple[int, ...], *key: object) -> np.ndarray:
        g = rng(rank, tuple(shape), "bfloat16 bits", *key)
        return np.asarray(g.integers(0, 1 << 16, size=shape, dtype=np.uint16)).view(BF16)

    for kind, (down, up, result_type) in BFLOAT16_KINDS.items():
        for shape in ((), (0,), (11,), (2, 3)):
            for root in range(k):
                data = bits(root, shape, "broadcast", kind)
                result = rt.broadcast(down(bits(me, shape, "broadcast", kind)), root_rank=root)
                what = f"{kind} bfloat16 broadcast {shape} root {root}"
                assert_kind(result, result_type, what)
                assert_same_bfloat16(up(result), data, what)
                tensor = down(bits(me, shape, "broadcast", kind))
                assert rt.broadcast_(tensor, root_rank=root) is tensor, what
                assert_same_bfloat16(up(tensor), data, what + " in place")
        parts = [bits(r, (r % 3, 2), "gather", kind) for r in range(k)]
        gathered = rt.allgather(down(parts[me]))
        assert_kind(gathered, result_type, f"{kind} allgather")
        assert_same_bfloat16(up(gathered), np.concatenate(parts), f"{kind} allgather")
        splits = [(me + r) % 3 for r in range(k)]
        received, counts = rt.alltoall(down(bits(me, (sum(splits), 2), "alltoall", kind)),
                                       splits=splits)
        pieces = []
        for sender in range(k):
            theirs = [(sender + r) % 3 for r in range(k)]
            rows = bits(sender, (sum(theirs), 2), "alltoall", kind)
            pieces.append(rows[sum(theirs[:me]):sum(theirs[:me]) + theirs[me]])
        assert_kind(received, result_type, f"{kind} alltoall")
        assert_same_bfloat16(up(received), np.concatenate(pieces), f"{kind} alltoall")


@check(min_size=2)
def joined_rank_replays_bfloat16_device_calls():
    import ringtrain.collectives as rtc
    k, me = rt.size(), rt.rank()
    kind, (down, up, _) = next(iter(BFLOAT16_KINDS.items()))
    first = k - 1
    active = [r for r in range(k) if r != first]
    if me != first:
        inputs = [np.asarray(rng(r, "device join bf16").integers(-8, 9, 3001)).astype(BF16)
                  for r in range(k)]
        got = up(rt.allreduce(down(inputs[me]), op=rt.Sum, name="jb"))
        total = np.sum([inputs[r].astype(np.float64) for r in active], axis=0)
        assert_same_bfloat16(got, total.astype(np.float32).astype(BF16), f"{kind} join")
    assert rtc.join() == max(active)


if __name__ == "__main__":
    main()
