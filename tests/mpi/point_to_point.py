"""Point-to-point tensors: send/recv, isend/irecv, sendrecv and batches, against the data
each rank can compute for every other rank; mismatches on both ranks; process sets.

Run: RINGTRAIN_STALL_CHECK_SECONDS=1 mpiexec -n K python tests/mpi/point_to_point.py
(with one rank, messages go from the rank to itself).
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch

import ringtrain as rt
from ringtrain.collectives.p2p import _p2p_protocol
from ringtrain.collectives import _point_to_point
from ringtrain.kernels import BFLOAT16
from _harness import (COPY_DTYPES, WORLD, assert_equal_arrays, check, expect_raises, main,
                      make_input)

DTYPES = COPY_DTYPES + [np.dtype(BFLOAT16)]
# Below, at and above the size whose data travels with the header (4 KiB).
SHAPES = [(), (0,), (7,), (3, 5), (0, 4), (1024,), (1025,), (3, 40001)]


def data(sender: int, shape, dtype, *key) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == BFLOAT16:
        return make_input(sender, shape, np.float32, None, *key).astype(BFLOAT16)
    return make_input(sender, shape, dtype, None, *key)


def neighbours() -> tuple[int, int, int]:
    me, k = rt.rank(), rt.size()
    return me, (me + 1) % k, (me - 1) % k


@check
def every_dtype_and_shape_around_the_ring():
    me, right, left = neighbours()
    for dtype in DTYPES:
        for shape in SHAPES:
            if dtype.itemsize > 2 and np.prod(shape) > 20000 and dtype.kind != "f":
                continue  # the large sizes once per itemsize class are enough
            mine = data(me, shape, dtype, "ring")
            got = rt.sendrecv(mine, right, left, name="ring")
            assert_equal_arrays(got, data(left, shape, dtype, "ring"), f"{dtype} {shape}")
            into = np.empty(shape, dtype)
            assert rt.sendrecv(mine, right, left, recv_tensor=into, tag=3) is into
            assert_equal_arrays(into, data(left, shape, dtype, "ring"), f"into {dtype} {shape}")


@check
def batched_ring_both_ways():
    me, right, left = neighbours()
    for shape in [(5,), (33000,)]:
        to_right, to_left = data(me, shape, np.float32, "r"), data(me, shape, np.float32, "l")
        from_left, from_right = np.empty(shape, np.float32), np.empty(shape, np.float32)
        # Receives first on even ranks, sends first on odd ones: no order deadlocks.
        operations = [rt.RecvOp(from_left, left, tag=1), rt.RecvOp(from_right, right, tag=2),
                      rt.SendOp(to_right, right, tag=1), rt.SendOp(to_left, left, tag=2)]
        if me % 2:
            operations.reverse()
        handles = rt.batch_isend_irecv(operations)
        for handle in reversed(handles):
            rt.synchronize(handle)
        assert_equal_arrays(from_left, data(left, shape, np.float32, "r"), "from the left")
        assert_equal_arrays(from_right, data(right, shape, np.float32, "l"), "from the right")


@check
def order_of_messages_and_tags():
    me, right, left = neighbours()
    sends = [rt.isend(np.full(4, 10 * me + i, np.int64), right, tag=7, name=f"m{i}")
             for i in range(5)]
    sends += [rt.isend(np.full(70000, me, np.int8), right, tag=9)]
    sends += [rt.isend(np.full(2, 100 + i, np.int32), right, tag=20 + i) for i in range(3)]
    # Other tags first, in reverse order of sending, then tag 7 in order.
    for i in reversed(range(3)):
        assert_equal_arrays(rt.synchronize(rt.irecv(None, left, tag=20 + i)),
                            np.full(2, 100 + i, np.int32), f"tag {20 + i}")
    assert_equal_arrays(rt.synchronize(rt.irecv(None, left, tag=9)),
                        np.full(70000, left, np.int8), "tag 9")
    handles = [rt.irecv(None, left, tag=7, name=f"m{i}") for i in range(5)]
    for i, handle in enumerate(handles):
        assert_equal_arrays(rt.synchronize(handle), np.full(4, 10 * left + i, np.int64),
                            f"message {i} of tag 7")
    for handle in sends:
        assert rt.synchronize(handle) is None and rt.poll(handle)


@check(min_size=2)
def blocking_send_and_recv():
    me, k = rt.rank(), rt.size()
    if me == 0:
        for peer in range(1, k):
            rt.send(data(0, (6, peer), np.float64, "b"), peer, name="b")
            got = rt.recv(np.empty((peer,), np.int16), peer, tag=4)
            assert_equal_arrays(got, data(peer, (peer,), np.int16, "back"), "answer")
    else:
        got = rt.recv(None, 0, name="b")
        assert_equal_arrays(got, data(0, (6, me), np.float64, "b"), "from rank 0")
        rt.send(data(me, (me,), np.int16, "back"), 0, tag=4)


@contextlib.contextmanager
def python_steps(on_this_rank: bool):
    """Blocking messages take the Python steps on this rank for the block, if asked; the
    compiled ones otherwise (see collectives/p2p/_p2p_compiled.py). Yields a list that says,
    for each message (or kept plan, collectives/p2p/_p2p_plans.py) that could take the
    compiled steps, whether it did."""
    compiled_messages = _p2p_protocol.compiled_messages
    taken: list[bool] = []

    def counted(channels):
        compiled = None if on_this_rank else compiled_messages(channels)
        taken.append(compiled is not None)
        return compiled

    _drop_kept_plans()
    _p2p_protocol.compiled_messages = counted
    try:
        yield taken
    finally:
        _p2p_protocol.compiled_messages = compiled_messages
        _drop_kept_plans()


def _drop_kept_plans() -> None:
    _point_to_point._SEND_PLANS.clear()
    _point_to_point._RECEIVE_PLANS.clear()


def blocking_in_a_ring(tensor, dst: int, src: int, into, **names):
    """Send to ``dst`` and receive from ``src`` with blocking calls, even ranks sending
    first (no deadlock in a ring of any size)."""
    send_name, recv_name = names.get("send_name"), names.get("recv_name")
    if rt.rank() % 2 == 0:
        rt.send(tensor, dst, tag=2, name=send_name)
        return rt.recv(into, src, tag=2, name=recv_name)
    got = rt.recv(into, src, tag=2, name=recv_name)
    rt.send(tensor, dst, tag=2, name=send_name)
    return got


@check(min_size=2)
def blocking_messages_compiled_and_python_steps():
    """Blocking send and recv take compiled steps; each side may take either form: the
    data, the checks and the errors are the same."""
    me, right, left = neighbours()
    for form, python_here in [("compiled", False), ("python", True),
                              ("mixed", me % 2 == 1)]:
        with python_steps(python_here) as taken:
            for dtype in DTYPES:
                for shape in [(), (0,), (7,), (3, 5), (1024,), (1025,), (3, 40001)]:
                    if dtype.itemsize > 2 and np.prod(shape) > 20000 and dtype.kind != "f":
                        continue
                    mine = data(me, shape, dtype, "blocking")
                    into = np.full(shape, 7, dtype)
                    got = blocking_in_a_ring(mine, right, left, into, send_name="t",
                                             recv_name="t" if len(shape) % 2 else None)
                    assert got is into, f"{form} {dtype} {shape}"
                    assert_equal_arrays(into, data(left, shape, dtype, "blocking"),
                                        f"{form} {dtype} {shape}")
            new = blocking_in_a_ring(np.arange(5.0) + me, right, left, None)
            assert_equal_arrays(new, np.arange(5.0) + left, f"{form} recv(None)")
            strided = np.zeros((6, 4), np.float32)
            blocking_in_a_ring(np.full((4, 6), me, np.float32), right, left, strided.T)
            assert_equal_arrays(strided.T, np.full((4, 6), left, np.float32), f"{form} strided")
            cases = [("shape", np.zeros(5, np.float32), np.zeros(6, np.float32), {}),
                     ("dtype", np.zeros(5, np.float32), np.zeros(5, np.int32), {}),
                     ("shape", np.zeros(40000, np.float32), np.zeros((2, 20000), np.float32),
                      {}),
                     ("name", np.zeros(3), np.zeros(3), {"send_name": "a", "recv_name": "b"}),
                     ("name", np.zeros(9000), np.zeros(9000), {"recv_name": "b"})]
            partner = me + 1 if me % 2 == 0 else me - 1
            for what, sent, expected, names in cases if partner < rt.size() else []:
                for sender in (0, 1):  # the even rank of a pair sends, then the odd one
                    if me % 2 == sender:
                        error = expect_raises(rt.MessageMismatchError, rt.send, sent, partner,
                                              tag=2, name=names.get("send_name"),
                                              match=["(tag 2)", f"expected {what}"])
                    else:
                        error = expect_raises(rt.MessageMismatchError, rt.recv, expected,
                                              partner, tag=2, name=names.get("recv_name"),
                                              match=["(tag 2)", f"expected {what}"])
                        assert not expected.any(), f"{form} {what}: the target was written"
                    assert what in error.differences, (form, error.differences)
            after = blocking_in_a_ring(np.full(3, me), right, left, None)
            assert_equal_arrays(after, np.full(3, left), f"{form} after the errors")
            assert taken and all(taken) != python_here and any(taken) != python_here, \
                f"{form}: compiled steps taken {sum(taken)} times of {len(taken)}"


@check(min_size=2)
def repeated_blocking_calls_keep_their_plans():
    """Blocking calls of numpy arrays keep a plan per kind of call (collectives/
    _p2p_plans.py): repeated calls reuse it with the right data every time; a mismatch
    through kept plans is raised on both ranks with nothing written; a process set
    rebuilt after its removal gets new plans, never its freed communicators. Torch CPU
    tensors take plans over their memory."""
    me, right, left = neighbours()
    kept = (_point_to_point._SEND_PLANS, _point_to_point._RECEIVE_PLANS)
    for shape in [(7,), (1025,), (3, 40001)]:
        _drop_kept_plans()
        into = np.empty(shape, np.float32)
        for step in range(12):
            blocking_in_a_ring(data(me, shape, np.float32, step), right, left, into,
                               send_name="kept", recv_name="kept")
            assert_equal_arrays(into, data(left, shape, np.float32, step), f"{shape} {step}")
        assert [len(plans) for plans in kept] == [1, 1], [len(plans) for plans in kept]
    partner = me + 1 if me % 2 == 0 else me - 1
    if partner < rt.size():
        for shape, expected_shape in [((5,), (6,)), ((9000,), (9001,))]:
            sent = np.ones(shape)
            for _ in range(3):  # the plans are kept before the mismatch meets them
                blocking_in_a_ring(sent, partner, partner, np.empty(shape))
            if me % 2 == 0:
                expect_raises(rt.MessageMismatchError, rt.send, sent, partner, tag=2,
                              match=["(tag 2)", "expected shape"])
            else:
                target = np.zeros(expected_shape)
                expect_raises(rt.MessageMismatchError, rt.recv, target, partner, tag=2,
                              match=["(tag 2)", "expected shape"])
                assert not target.any(), f"{shape}: the target was written"
            after = blocking_in_a_ring(sent * 2, partner, partner, np.empty(shape))
            assert_equal_arrays(after, np.full(shape, 2.0), f"{shape} after the mismatch")
    for dtype in (torch.float32, torch.bfloat16, torch.int64):  # over their memory
        _drop_kept_plans()
        mine = (torch.arange(9000) * (me + 1)).to(dtype).requires_grad_(dtype.is_floating_point)
        into = torch.zeros(9000, dtype=dtype)
        for step in range(3):
            got = blocking_in_a_ring(mine, right, left, into)
            assert got is into and torch.equal(into, (torch.arange(9000) * (left + 1)).to(dtype)), \
                (dtype, step)
        assert [len(plans) for plans in kept] == [1, 1], (dtype, [len(p) for p in kept])
    strided = torch.zeros(6, 4)  # a transposed target takes the general path
    got = blocking_in_a_ring(torch.full((4, 6), float(me)), right, left, strided.t())
    assert torch.equal(strided.t(), torch.full((4, 6), float(left))), "strided torch target"
    everyone = rt.add_process_set(range(rt.size()))
    for round_ in range(2):
        got = np.empty(4, np.int64)
        for step in range(3):
            if me % 2 == 0:
                rt.send(np.full(4, 10 * me + step), right, tag=8, process_set=everyone)
                rt.recv(got, left, tag=8, process_set=everyone)
            else:
                rt.recv(got, left, tag=8, process_set=everyone)
                rt.send(np.full(4, 10 * me + step), right, tag=8, process_set=everyone)
            assert_equal_arrays(got, np.full(4, 10 * left + step), f"set, round {round_}")
        rt.barrier()
        rt.remove_process_set(everyone)  # the next round rebuilds it


@check
def torch_tensors_and_like():
    me, right, left = neighbours()
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        mine = (torch.arange(37) * (me + 1)).to(dtype)
        got = rt.sendrecv(mine, right, left, like=mine)
        assert isinstance(got, torch.Tensor) and got.dtype == dtype, (type(got), dtype)
        assert torch.equal(got, (torch.arange(37) * (left + 1)).to(dtype)), dtype
        into = torch.empty(37, dtype=dtype)
        assert rt.sendrecv(mine, right, left, recv_tensor=into) is into
        assert torch.equal(into, got)
    # A strided target is filled through a copy.
    target = torch.zeros(6, 4)
    rt.sendrecv(torch.full((4, 6), float(me)), right, left, recv_tensor=target.T)
    assert torch.equal(target.T, torch.full((4, 6), float(left)))


@check
def mismatches_on_both_ranks_then_usable():
    me, right, left = neighbours()
    cases = [("shape", np.zeros(5, np.float32), np.zeros(6, np.float32), "sent shape (5,)"),
             ("dtype", np.zeros(5, np.float32), np.zeros(5, np.float64),
              "sent dtype float32"),
             ("large shape", np.zeros(40000, np.float32), np.zeros(40001, np.float32),
              "sent shape (40000,)")]
    for what, sent, expected, words in cases:
        send = rt.isend(sent, right, tag=11, name="w")
        receive = rt.irecv(expected, left, tag=11, name="w")
        for handle in (receive, send):
            expect_raises(rt.MessageMismatchError, rt.synchronize, handle,
                          match=[words, "tag 11", "tensor 'w'", f"expected {what.split()[-1]}"])
        assert not expected.any(), f"{what}: the receive target was written"
    send = rt.isend(np.zeros(3), right, name="a")
    error = expect_raises(rt.MessageMismatchError, rt.recv if rt.size() > 1 else
                          lambda *a, **k: rt.synchronize(rt.irecv(*a, **k)),
                          None, left, name="b", match=["sent name 'a'", "expected name 'b'"])
    assert (error.sender, error.receiver) == (left, me), (error.sender, error.receiver)
    expect_raises(rt.MessageMismatchError, rt.synchronize, send,
                  match=[f"from rank {me} to rank {right}"])
    # Usable afterwards: messages and collectives.
    assert_equal_arrays(rt.sendrecv(np.full(3, me), right, left), np.full(3, left), "after")
    total = rt.allreduce(np.ones(2), op=rt.Sum, name="after")
    assert_equal_arrays(total, np.full(2, float(rt.size())), "allreduce after")


@check
def bad_arguments_refused_before_sending():
    me, right, left = neighbours()
    expect_raises(rt.InvalidArgumentError, rt.isend, np.ones(2), rt.size(), match=["rank"])
    expect_raises(rt.InvalidArgumentError, rt.isend, np.ones(2), right, tag=-1,
                  match=["tag must be"])
    expect_raises(rt.UnsupportedDtypeError, rt.isend, np.ones(2, np.complex64), right)
    expect_raises(rt.InvalidArgumentError, rt.send, np.ones(2), me, match=["itself"])
    expect_raises(rt.InvalidArgumentError, rt.recv, None, me, match=["itself"])


@check(min_size=3)
def inside_process_sets():
    k, me = rt.size(), rt.rank()
    evens = rt.add_process_set(range(0, k, 2))
    odds = rt.add_process_set(range(1, k, 2))
    mine = evens if me % 2 == 0 else odds
    members = mine.ranks
    index = members.index(me)
    right, left = members[(index + 1) % len(members)], members[(index - 1) % len(members)]
    # The same tag in both sets: each set's messages stay in it.
    got = rt.sendrecv(np.full(9, me, np.int32), right, left, tag=5, process_set=mine)
    assert_equal_arrays(got, np.full(9, left, np.int32), "within the set")
    outsider = next(r for r in range(k) if r not in members)
    expect_raises(rt.InvalidArgumentError, rt.isend, np.ones(1), outsider, process_set=mine,
                  match=[f"rank {outsider} is not among"])
    rt.barrier()
    rt.remove_process_set(evens)
    rt.remove_process_set(odds)


@check
def receives_from_any_source():
    """Rank 0 takes one message from every rank (itself included) in whatever order they
    come, each into a tensor of the right shape, and learns who sent it."""
    k, me = rt.size(), rt.rank()
    sent = rt.isend(np.full(3 + me, me, np.int64), 0, tag=11, name="any")
    if me == 0:
        senders = set()
        for _ in range(k):
            handle = rt.irecv(None, src=rt.ANY_SOURCE, tag=11, name="any")
            got = rt.synchronize(handle)
            assert handle.source is not None and handle.source not in senders, handle.source
            senders.add(handle.source)
            assert_equal_arrays(got, np.full(3 + handle.source, handle.source, np.int64),
                                f"from rank {handle.source}")
        assert senders == set(range(k)), senders
        expect_raises(rt.InvalidArgumentError, rt.send, np.ones(1), rt.ANY_SOURCE,
                      match=["rank -1 is not among"])
    rt.synchronize(sent)
    if k > 1 and me == 1:  # a blocking receive from any rank
        got = rt.recv(np.empty(2), src=rt.ANY_SOURCE, tag=12)
        assert_equal_arrays(got, np.array([0.0, 2.0]), "a blocking receive from any rank")
    elif k > 1 and me == 0:
        rt.send(np.array([0.0, 2.0]), 1, tag=12)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@check(min_size=2)
def a_late_sender_is_reported_by_the_stall_inspector():
    """RINGTRAIN_STALL_CHECK_SECONDS=1: rank 0 waits 2.5 s for rank 1's message."""
    me = rt.rank()
    records = _Records()
    logger = logging.getLogger("ringtrain")
    logger.addHandler(records)
    try:
        if me == 1:
            time.sleep(2.5)
            rt.send(np.ones(3), 0, tag=6, name="late")
        elif me == 0:
            rt.recv(np.empty(3), 1, tag=6, name="late")
    finally:
        logger.removeHandler(records)
    if me == 0:
        expected = "recv of tensor 'late' from rank 1 (tag 6) has waited"
        assert any(expected in line and "for rank 1, which" in line
                   for line in records.lines), records.lines


if __name__ == "__main__":
    assert WORLD.Get_size() >= 1
    main()
