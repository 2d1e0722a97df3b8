"""torch.distributed on the "ringtrain" backend: every collective against numpy references
(dtypes, ops, roots, uneven splits, subgroups, async work and futures), point-to-point,
the object collectives, DeviceMesh, refusals and mismatches on every rank.

Started under mpiexec with no torch variable set: ``init_process_group("ringtrain")``
takes rank and size from MPI.

Run: mpiexec -n K python tests/mpi/torch_backend.py [--only SUBSTRING]
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import ringtrain as rt
import ringtrain.torch
from ringtrain.common.timeline_format import rank_path
from _harness import check, expect_raises, main, rng

RED = dist.ReduceOp
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTEGERS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
DTYPES = FLOATS + INTEGERS + [torch.bool]
SIZES = [1, 7, 1001]
TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-5,
             torch.float64: 1e-12}


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def make(r: int, count: int, dtype: torch.dtype, *key: object, op: object = None) -> torch.Tensor:
    """Rank ``r``'s input: small values, so no sum or product overflows ``dtype``."""
    g = rng(r, count, str(dtype), str(op), *key)
    if dtype is torch.bool:
        return torch.from_numpy(g.integers(0, 2, count).astype(np.bool_))
    if dtype.is_floating_point:
        low, high = (0.5, 1.5) if op is RED.PRODUCT else (-1.0, 1.0)
        return torch.from_numpy(g.uniform(low, high, count)).to(dtype)
    if op is RED.PRODUCT:
        return torch.from_numpy(g.integers(0, 3, count)).to(dtype)
    low = 0 if dtype is torch.uint8 else -20
    return torch.from_numpy(g.integers(low, 20, count)).to(dtype)


def reference(inputs: list[torch.Tensor], op: object, factor: float = 1.0) -> torch.Tensor:
    """The reduction of the ranks' inputs, computed here in float64 / int64 / bool."""
    dtype = inputs[0].dtype
    if dtype is torch.bool:
        stacked = torch.stack(inputs)
        if op in (RED.SUM, RED.MAX, RED.BOR):
            return stacked.any(0)
        if op in (RED.PRODUCT, RED.MIN, RED.BAND):
            return stacked.all(0)
        return (stacked.sum(0) % 2).bool()  # BXOR
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    if op is RED.PREMUL_SUM:  # scaled in the input's dtype, then summed
        stacked = torch.stack([(x * factor).to(dtype).to(wide) for x in inputs])
    else:
        stacked = torch.stack([x.to(wide) for x in inputs])
    if op in (RED.SUM, RED.PREMUL_SUM):
        return stacked.sum(0)
    if op is RED.AVG:
        return stacked.sum(0) / len(inputs)
    if op is RED.PRODUCT:
        return stacked.prod(0)
    if op is RED.MIN:
        return stacked.min(0).values
    if op is RED.MAX:
        return stacked.max(0).values
    result = stacked[0]
    for row in stacked[1:]:
        result = {RED.BAND: torch.bitwise_and, RED.BOR: torch.bitwise_or,
                  RED.BXOR: torch.bitwise_xor}[op](result, row)
    return result


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, \
        f"{what}: shape {actual.shape}, expected {expected.shape}"
    if actual.dtype.is_floating_point:
        tolerance = TOLERANCE[actual.dtype] * max(1, world())
        ok = torch.allclose(actual.double(), expected.double(), rtol=tolerance, atol=tolerance)
    else:
        ok = torch.equal(actual, expected.to(actual.dtype))
    assert ok, f"{what}: got {actual[:6].tolist()}, expected {expected[:6].tolist()}"


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), \
        f"{what}: got {actual.reshape(-1)[:6].tolist()}, " \
        f"expected {expected.reshape(-1)[:6].tolist()}"


def ops_for(dtype: torch.dtype) -> list:
    if dtype is torch.bool:
        return [RED.SUM, RED.PRODUCT, RED.MIN, RED.MAX, RED.BAND, RED.BOR, RED.BXOR]
    if dtype.is_floating_point:
        return [RED.SUM, RED.AVG, RED.PRODUCT, RED.MIN, RED.MAX, "premul"]
    return [RED.SUM, RED.PRODUCT, RED.MIN, RED.MAX, RED.BAND, RED.BOR, RED.BXOR]


def torch_op(op: object) -> tuple[object, object, float]:
    """(op to pass, op of the reference, factor)."""
    if op == "premul":
        return dist._make_nccl_premul_sum(0.5), RED.PREMUL_SUM, 0.5
    return op, op, 1.0


@check
def starts_from_mpi_with_no_torch_variable():
    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(variable, None)  # as under plain mpiexec
    dist.init_process_group("ringtrain")
    assert dist.is_initialized()
    assert dist.get_backend() == "ringtrain"
    assert (dist.get_rank(), dist.get_world_size()) == (rt.rank(), rt.size())
    assert ringtrain.torch.process_set_of() is rt.global_process_set


@check
def all_reduce_every_dtype_and_op():
    for dtype in DTYPES:
        for op in ops_for(dtype):
            passed, reference_op, factor = torch_op(op)
            for count in SIZES:
                key = ("all_reduce", count)
                inputs = [make(r, count, dtype, *key, op=reference_op) for r in range(world())]
                expected = reference(inputs, reference_op, factor)
                what = f"all_reduce {dtype} {reference_op} {count}"
                tensor = inputs[rank()].clone()
                dist.all_reduce(tensor, op=passed)
                assert_close(tensor, expected, what)
                tensor = inputs[rank()].clone()
                work = dist.all_reduce(tensor, op=passed, async_op=True)
                assert work.wait() is True
                assert_close(tensor, expected, what + " async")


@check
def all_reduce_refusals_reach_every_rank():
    expect_raises(rt.InvalidArgumentError, dist.all_reduce, torch.ones(3, dtype=torch.int32),
                  op=RED.AVG, match=["Average", "int32"])
    expect_raises(rt.UnsupportedDtypeError, dist.all_reduce, torch.ones(3), op=RED.BAND,
                  match=["bitwise", "float32"])
    expect_raises(rt.UnsupportedDtypeError, dist.all_reduce, torch.ones(3, dtype=torch.uint16),
                  match=["uint16"])
    expect_raises(rt.UnsupportedDtypeError, dist.all_reduce, torch.eye(2).to_sparse(),
                  match=["sparse", "dense"])
    # a dtype refused on one rank only: the others learn why, nobody waits
    dtype = torch.uint32 if rank() == world() - 1 else torch.int32
    error = (rt.UnsupportedDtypeError, rt.MismatchError) if world() > 1 \
        else rt.UnsupportedDtypeError
    expect_raises(error, dist.all_reduce, torch.ones(3, dtype=dtype), match=["uint32"])
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert_same(tensor, torch.full((2,), float(world())), "after the refusals")


@check
def mismatches_raise_on_every_rank():
    last = world() - 1
    cases = {
        "shape": lambda: dist.all_reduce(torch.ones(3 + (rank() == last))),
        "dtype": lambda: dist.all_reduce(torch.ones(3, dtype=torch.float64 if rank() == last
                                                    else torch.float32)),
        "op": lambda: dist.all_reduce(torch.ones(3), op=RED.MAX if rank() == last else RED.SUM),
        "order": lambda: (dist.broadcast(torch.ones(3), src=0) if rank() == last
                          else dist.all_reduce(torch.ones(3))),
        "root": lambda: dist.broadcast(torch.ones(3), src=last if rank() == last else 0),
    }
    if world() == 1:
        return
    for field, call in cases.items():
        error = expect_raises(rt.MismatchError, call, match=[f"rank {last}"])
        assert field in str(error) or "collective" in str(error) or "root" in str(error), \
            f"{field}: {error}"
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert_same(tensor, torch.full((2,), float(world())), "after the mismatches")


@check
def all_reduce_of_views_and_coalesced():
    base = torch.arange(24.0).reshape(4, 6) + rank()
    view = base[:, ::2]
    dist.all_reduce(view)
    expected = (torch.arange(24.0).reshape(4, 6) * world() + sum(range(world())))[:, ::2]
    assert_same(view, expected, "a strided view")
    tensors = [make(rank(), 5, torch.float32, "coalesced", i) for i in range(3)] + \
        [make(rank(), 4, torch.int64, "coalesced", 3)]
    expected = [reference([make(r, t.numel(), t.dtype, "coalesced", i) for r in range(world())],
                          RED.SUM) for i, t in enumerate(tensors)]
    dist.all_reduce_coalesced(tensors[:3])
    dist.all_reduce_coalesced(tensors[3:])
    for i, (tensor, wanted) in enumerate(zip(tensors, expected)):
        assert_close(tensor, wanted, f"coalesced {i}")


@check
def broadcast_from_every_root():
    for dtype in DTYPES:
        for root in range(world()):
            for count in (1, 1001):
                tensor = make(rank(), count, dtype, "broadcast")
                dist.broadcast(tensor, src=root)
                assert_same(tensor, make(root, count, dtype, "broadcast"), f"{dtype} root {root}")
    matrix = torch.zeros(6, 4)
    if rank() == 0:
        matrix.copy_(torch.arange(24.0).reshape(6, 4))
    column = matrix[:, 1]
    dist.broadcast(column, src=0)
    assert_same(column, torch.arange(24.0).reshape(6, 4)[:, 1], "a strided broadcast")


@check
def all_gather_forms():
    for dtype in DTYPES:
        inputs = [make(r, 5, dtype, "all_gather") for r in range(world())]
        outputs = [torch.empty(5, dtype=dtype) for _ in range(world())]
        dist.all_gather(outputs, inputs[rank()])
        for r in range(world()):
            assert_same(outputs[r], inputs[r], f"all_gather {dtype} from {r}")
        flat = torch.empty(5 * world(), dtype=dtype)
        dist.all_gather_into_tensor(flat, inputs[rank()])
        assert_same(flat, torch.cat(inputs), f"all_gather_into_tensor {dtype}")
        stacked = torch.empty(world(), 5, dtype=dtype)
        dist.all_gather_into_tensor(stacked, inputs[rank()])
        assert_same(stacked, torch.stack(inputs), f"all_gather_into_tensor stacked {dtype}")
    # outputs[r][i]: rank r's input i (inputs of different sizes)
    inputs = [torch.full((1,), 10.0 * rank()), torch.arange(6.0).reshape(2, 3) + 10 * rank()]
    outputs = [[torch.empty(1), torch.empty(2, 3)] for _ in range(world())]
    dist.all_gather_coalesced(outputs, inputs)
    for r in range(world()):
        assert_same(outputs[r][0], torch.full((1,), 10.0 * r), f"all_gather_coalesced {r} 0")
        assert_same(outputs[r][1], torch.arange(6.0).reshape(2, 3) + 10 * r,
                    f"all_gather_coalesced {r} 1")


@check
def reduce_scatter_forms():
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.bool):
        for op in ([RED.SUM, RED.MAX] if dtype is not torch.float32
                   else [RED.SUM, RED.AVG, RED.MIN, "premul"]):
            passed, reference_op, factor = torch_op(op)
            count = 3
            inputs = [make(r, count * world(), dtype, "reduce_scatter", op=reference_op)
                      for r in range(world())]
            expected = reference(inputs, reference_op, factor)
            mine = expected[rank() * count:(rank() + 1) * count]
            output = torch.empty(count, dtype=dtype)
            dist.reduce_scatter_tensor(output, inputs[rank()].clone(), op=passed)
            assert_close(output, mine, f"reduce_scatter_tensor {dtype} {reference_op}")
            output = torch.empty(count, dtype=dtype)
            pieces = list(inputs[rank()].clone().split(count))
            dist.reduce_scatter(output, pieces, op=passed)
            assert_close(output, mine, f"reduce_scatter {dtype} {reference_op}")
    inputs = [make(r, 4 * world(), torch.int64, "bitwise", op=RED.BXOR) for r in range(world())]
    output = torch.empty(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(output, inputs[rank()], op=RED.BXOR)
    assert_close(output, reference(inputs, RED.BXOR)[4 * rank():4 * rank() + 4], "bitwise share")


@check
def all_to_all_even_and_uneven():
    n = world()
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool):
        even = [make(r, 2 * n, dtype, "a2a") for r in range(n)]
        output = torch.empty(2 * n, dtype=dtype)
        dist.all_to_all_single(output, even[rank()])
        expected = torch.cat([even[r][2 * rank():2 * rank() + 2] for r in range(n)])
        assert_same(output, expected, f"all_to_all_single even {dtype}")
    # rank r sends r + j + 1 rows of 3 to rank j
    sends = [[r + j + 1 for j in range(n)] for r in range(n)]
    rows = [torch.arange(sum(sends[r]) * 3, dtype=torch.float64).reshape(-1, 3) + 1000 * r
            for r in range(n)]
    received = [sends[r][rank()] for r in range(n)]
    output = torch.empty(sum(received), 3, dtype=torch.float64)
    dist.all_to_all_single(output, rows[rank()], output_split_sizes=received,
                           input_split_sizes=sends[rank()])
    expected = torch.cat([rows[r][sum(sends[r][:rank()]):sum(sends[r][:rank() + 1])]
                          for r in range(n)])
    assert_same(output, expected, "all_to_all_single uneven")
    inputs = [torch.full((r + j + 1,), float(10 * r + j)) for j in range(n) for r in [rank()]]
    outputs = [torch.empty(r + rank() + 1) for r in range(n)]
    dist.all_to_all(outputs, inputs)
    for r in range(n):
        assert_same(outputs[r], torch.full((r + rank() + 1,), float(10 * r + rank())),
                    f"all_to_all from {r}")


@check
def reduce_gather_scatter_to_every_root():
    n = world()
    for root in range(n):
        inputs = [make(r, 6, torch.float32, "reduce", root) for r in range(n)]
        tensor = inputs[rank()].clone()
        dist.reduce(tensor, dst=root, op=RED.SUM)
        if rank() == root:
            assert_close(tensor, reference(inputs, RED.SUM), f"reduce to {root}")
        else:
            assert_same(tensor, inputs[rank()], f"reduce leaves rank {rank()}'s tensor")
        mine = torch.full((2, 2), float(rank()), dtype=torch.int16)
        gathered = [torch.empty(2, 2, dtype=torch.int16) for _ in range(n)] \
            if rank() == root else None
        dist.gather(mine, gathered, dst=root)
        if rank() == root:
            for r in range(n):
                assert_same(gathered[r], torch.full((2, 2), r, dtype=torch.int16),
                            f"gather to {root} from {r}")
        pieces = [torch.arange(3.0) + 10 * r for r in range(n)] if rank() == root else None
        output = torch.empty(3)
        dist.scatter(output, pieces, src=root)
        assert_same(output, torch.arange(3.0) + 10 * rank(), f"scatter from {root}")


@check
def async_work_and_futures():
    tensor = torch.ones(4)
    work = dist.all_reduce(tensor, async_op=True)
    chained = work.get_future().then(lambda future: future.value()[0] * 2)
    assert_same(chained.wait(), torch.full((4,), 2.0 * world()), "a chained future")
    assert work.is_completed() and work.is_success()
    assert_same(work.result()[0], torch.full((4,), float(world())), "work.result()")
    works = [dist.all_reduce(torch.full((3,), float(i)), async_op=True) for i in range(5)]
    for i, w in enumerate(works):
        w.wait()
        assert_same(w.result()[0], torch.full((3,), float(i * world())), f"queued {i}")
    output = torch.empty(world())
    work = dist.all_gather_into_tensor(output, torch.tensor([float(rank())]), async_op=True)
    work.wait()
    assert_same(output, torch.arange(float(world())), "async all_gather")
    dist.barrier()
    dist.barrier(async_op=True).wait()


@check
def point_to_point():
    n, me = world(), rank()
    if n == 1:
        return
    right, left = (me + 1) % n, (me - 1) % n
    ops = [dist.P2POp(dist.isend, torch.full((5,), float(me)), right),
           dist.P2POp(dist.irecv, torch.empty(5), left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert_same(ops[1].tensor, torch.full((5,), float(left)), "a ring of isend/irecv")
    if me == 0:
        for _ in range(n - 1):
            tensor = torch.empty(2, dtype=torch.int64)
            sender = dist.recv(tensor, tag=7)  # from any rank
            assert_same(tensor, torch.tensor([sender, 7 * sender]), f"any source {sender}")
    else:
        dist.send(torch.tensor([me, 7 * me]), dst=0, tag=7)
    if me < 2:
        if me == 0:
            dist.send(torch.arange(6.0).reshape(2, 3).t(), dst=1, tag=3)
        else:
            target = torch.empty(3, 2)
            dist.recv(target, src=0, tag=3)
            assert_same(target, torch.arange(6.0).reshape(2, 3).t(), "a transposed message")


@check
def object_collectives():
    n, me = world(), rank()
    objects = [{"rank": me, "data": list(range(me))}]
    gathered = [None] * n
    dist.all_gather_object(gathered, objects[0])
    assert gathered == [{"rank": r, "data": list(range(r))} for r in range(n)]
    message = [("hello", me)]
    dist.broadcast_object_list(message, src=n - 1)
    assert message == [("hello", n - 1)]
    at_root = [None] * n if me == 0 else None
    dist.gather_object(me * 3, at_root, dst=0)
    if me == 0:
        assert at_root == [3 * r for r in range(n)]
    received = [None]
    dist.scatter_object_list(received, [f"to {r}" for r in range(n)] if me == 0 else None, src=0)
    assert received == [f"to {me}"]


@check
def subgroups():
    n, me = world(), rank()
    evens = list(range(0, n, 2))
    group = dist.new_group(evens)
    if me in evens:
        assert dist.get_backend(group) == "ringtrain"
        tensor = torch.tensor([float(me)])
        dist.all_reduce(tensor, group=group)
        assert_same(tensor, torch.tensor([float(sum(evens))]), "a group of the even ranks")
        tensor = torch.tensor([float(me)])
        dist.broadcast(tensor, src=evens[-1], group=group)
        assert_same(tensor, torch.tensor([float(evens[-1])]), "a broadcast in the group")
        assert ringtrain.torch.process_set_of(group).ranks == evens
    mine, everyone = dist.new_subgroups(group_size=1 if n % 2 else min(2, n))
    tensor = torch.tensor([1.0])
    dist.all_reduce(tensor, group=mine)
    assert_same(tensor, torch.tensor([float(dist.get_world_size(mine))]), "new_subgroups")
    for g in [group, *everyone]:
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


@check(min_size=4)
def device_mesh_of_two_dimensions():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world() // 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    tensor = torch.tensor([float(rank())])
    dist.all_reduce(tensor, group=dp)
    column = [r for r in range(world()) if r % (world() // 2) == rank() % (world() // 2)]
    assert_same(tensor, torch.tensor([float(sum(column))]), "the dp dimension")
    tensor = torch.tensor([float(rank())])
    dist.all_reduce(tensor, group=tp)
    row = [r for r in range(world()) if r // (world() // 2) == rank() // (world() // 2)]
    assert_same(tensor, torch.tensor([float(sum(row))]), "the tp dimension")
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(16.0).reshape(4, 4)
    sharded = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert_same(sharded.redistribute(mesh, [Replicate(), Replicate()]).to_local(), full,
                "a DTensor redistributed")


@check
def the_timeline_and_the_stall_inspector_see_torchs_calls():
    """RINGTRAIN_STALL_CHECK_SECONDS=1: the last rank comes 2.5 s late to an all_reduce;
    the others' stall inspector names it. The timeline records torch's calls as the
    collectives they run."""
    path = os.path.join(tempfile.gettempdir(), f"ringtrain-torch-timeline-{os.getpid()}.json")
    written = rank_path(path, rt.rank(), rt.size())
    rt.start_timeline(path)
    try:
        dist.all_reduce(torch.ones(4))
        dist.all_gather_into_tensor(torch.empty(world()), torch.ones(1))
    finally:
        rt.stop_timeline()
    with open(written) as file:
        text = file.read()
    os.remove(written)
    assert '"allreduce' in text and '"allgather' in text, text[:1000]
    if world() == 1:
        return
    records = _Records()
    logger = logging.getLogger("ringtrain")
    logger.addHandler(records)
    try:
        if rank() == world() - 1:
            time.sleep(2.5)
        dist.all_reduce(torch.ones(2))
    finally:
        logger.removeHandler(records)
    if rank() == 0:
        assert any("allreduce" in line and f"rank {world() - 1}" in line and "waited" in line
                   for line in records.lines), records.lines


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@check
def monitored_barrier_is_refused_clearly():
    expect_raises((ValueError, RuntimeError), dist.monitored_barrier, match=["GLOO"])


@contextlib.contextmanager
def variables(**values: str):
    """The torch variables set to ``values`` for the block (none set before or after)."""
    os.environ.update(values)
    try:
        yield
    finally:
        for name in values:
            os.environ.pop(name, None)


def free_port() -> str:
    """A port free on rank 0's node, the same on every rank."""
    port = None
    if rt.rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    return str(MPI.COMM_WORLD.bcast(port, root=0))


def init_and_reduce(**arguments) -> None:
    dist.init_process_group("ringtrain", **arguments)
    try:
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert_same(tensor, torch.tensor([float(rt.size())]), "after init_process_group")
    finally:
        dist.destroy_process_group()


@check
def started_again_with_the_users_variables():
    dist.destroy_process_group()
    assert not dist.is_initialized()
    init_and_reduce()
    with variables(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()):
        init_and_reduce()
    with variables(MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RANK=str(rt.rank()),
                   WORLD_SIZE=str(rt.size())):
        init_and_reduce()
    init_and_reduce(rank=rt.rank(), world_size=rt.size())


@check
def variables_that_disagree_with_mpi_fail_on_every_rank():
    last = rt.size() - 1
    wrong = str(rt.rank() + 1 if rt.rank() == last else rt.rank())
    with variables(RANK=wrong):
        expect_raises(ValueError, dist.init_process_group, "ringtrain",
                      match=[f"rank {last}: RANK={last + 1}", f"MPI says {last}"])
    with variables(WORLD_SIZE=str(rt.size() + 1)):
        expect_raises(ValueError, dist.init_process_group, "ringtrain",
                      match=[f"WORLD_SIZE={rt.size() + 1}"])
    assert not dist.is_initialized()
    init_and_reduce()


if __name__ == "__main__":
    main()
