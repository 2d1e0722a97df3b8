"""The KVStore's local and sync modes on any number of ranks, against MXNet's semantics.

After ``init`` and a ``push`` of known values from every worker, ``pull`` equals the
exact sum (small integers, exact in every dtype, bfloat16 included), with single keys,
lists of keys, string keys and several values per key; with an optimizer set the value
after k steps equals SGD / Adam computed here; 2-bit compression equals a numpy model of
MXNet's rule; mismatched pushes and bad input give clear errors on every rank, and the
store is usable afterwards.

Run: mpiexec -n K python tests/mpi/kvstore_sync.py [--only SUBSTRING]
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
from ml_dtypes import bfloat16

import ringtrain as rt
from _harness import check, expect_raises, main, same_on_all_ranks
from kvstore_model import adam_reference, sgd_reference, two_bit_model
from ringtrain import kvstore

SYNC_MODES = ["dist_sync", "dist_device_sync", "horovod"]
DTYPES = [np.dtype(t) for t in (np.float16, bfloat16, np.float32, np.float64, np.int8, np.uint8,
                                np.int16, np.int32, np.int64)]
SHAPES = [(7,), (3, 5), ()]


def value(rank: int, shape: tuple[int, ...], dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s push: (rank + 1) times small integers (sums over 4 ranks fit int8)."""
    count = int(np.prod(shape))
    base = (np.arange(count) + salt) % 5 + 1
    return ((rank + 1) * base).reshape(shape).astype(dtype)


def expected_sum(shape: tuple[int, ...], dtype: np.dtype, salt: int = 0) -> np.ndarray:
    return sum(value(r, shape, dtype, salt).astype(np.float64) for r in range(rt.size()))


def assert_exact(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.array_equal(actual.astype(np.float64), expected), \
        f"{what}: {actual.reshape(-1)[:8]} != {expected.reshape(-1)[:8]}"


@check
def every_sync_mode_sums_every_dtype_and_shape():
    cases = [(10 * i + j, dtype, shape) for i, dtype in enumerate(DTYPES)
             for j, shape in enumerate(SHAPES) if (i + j) % 2 == 0 or dtype == np.float32]
    for mode in SYNC_MODES:
        kv = kvstore.create(mode)
        assert kv.type == mode and kv.rank == rt.rank() and kv.num_workers == rt.size()
        keys = [key for key, _, _ in cases]
        kv.init(keys, [np.zeros(shape, dtype) for _, dtype, shape in cases])
        kv.push(keys, [value(rt.rank(), shape, dtype) for _, dtype, shape in cases])
        outs = [np.empty(shape, dtype) for _, dtype, shape in cases]
        kv.pull(keys, out=outs)
        for (key, dtype, shape), out in zip(cases, outs):
            assert out.dtype == dtype
            assert_exact(out, expected_sum(shape, dtype), f"{mode} {dtype} {shape}")
        kv.close()


@check
def lists_of_keys_string_keys_and_several_values_per_key():
    kv = kvstore.create("dist_sync")
    keys = ["weight", 3, "bias"]
    shapes = [(4, 3), (5,), (1,)]
    kv.init(keys, [np.full(s, 9.0, np.float32) for s in shapes])
    # the initial values are worker 0's, on every worker
    for k, s in zip(keys, shapes):
        assert_exact(kv.pull(k), np.full(s, 9.0), f"init of {k!r}")
    mine = [[value(rt.rank(), s, np.float32, i), value(rt.rank(), s, np.float32, i + 1)]
            for i, s in enumerate(shapes)]
    kv.push(keys, mine)
    outs = [[np.empty(s, np.float32), np.empty(s, np.float32)] for s in shapes]
    kv.pull(keys, out=outs)
    for i, (k, s) in enumerate(zip(keys, shapes)):
        expected = expected_sum(s, np.float32, i) + expected_sum(s, np.float32, i + 1)
        for out in outs[i]:
            assert_exact(out, expected, f"list push of {k!r}")
    # pushpull into the values themselves, as MXNet does without out
    grads = [value(rt.rank(), s, np.float32, 7) for s in shapes]
    kv.pushpull(keys, grads)
    for g, s in zip(grads, shapes):
        assert_exact(g, expected_sum(s, np.float32, 7), "pushpull")
    kv.close()


@check
def many_keys_in_several_buckets():
    kv = kvstore.create("dist_sync")
    keys = list(range(100, 112))
    kv.init(keys, [np.zeros(300, np.float32) for _ in keys])
    with rt_fusion(2000):  # 1200 bytes per key: one or two keys per bucket
        kv.push(keys, [value(rt.rank(), (300,), np.float32, k) for k in keys])
    pulled = kv.pull(keys)
    for k, got in zip(keys, pulled):
        assert_exact(got, expected_sum((300,), np.float32, k), f"key {k}")


class rt_fusion:
    def __init__(self, threshold: int):
        self.threshold = threshold

    def __enter__(self):
        self.saved = rt.current_settings().fusion_threshold
        rt.configure(fusion_threshold=self.threshold)

    def __exit__(self, *exc):
        rt.configure(fusion_threshold=self.saved)


@check
def torch_tensors_in_and_out():
    """At np=2 only: importing torch costs seconds per rank, and the tensors become host
    arrays before anything crosses ranks."""
    if rt.size() != 2:
        return
    import torch
    local = kvstore.create("device")
    local.init("x", torch.zeros(2, 2))
    local.push("x", [torch.ones(2, 2), torch.full((2, 2), 2.0)])  # summed by torch
    assert_exact(local.pull("x"), np.full((2, 2), 3.0), "device mode")
    kv = kvstore.create("dist_device_sync")
    kv.init("t", torch.zeros(2, 3))
    kv.push("t", [torch.from_numpy(value(rt.rank(), (2, 3), np.float32)),
                  torch.from_numpy(value(rt.rank(), (2, 3), np.float32, 1))])
    out = torch.empty(2, 3)
    assert kv.pull("t", out=out) is out
    expected = expected_sum((2, 3), np.float32) + expected_sum((2, 3), np.float32, 1)
    assert_exact(out.numpy(), expected, "torch pull")
    kv.init("b", torch.zeros(5, dtype=torch.bfloat16))
    kv.push("b", torch.from_numpy(value(rt.rank(), (5,), np.float32)).to(torch.bfloat16))
    pulled = torch.empty(5, dtype=torch.bfloat16)
    kv.pull("b", out=pulled)
    assert_exact(pulled.float().numpy(), expected_sum((5,), np.float32), "bfloat16 torch pull")


@check
def broadcast_and_row_sparse_pull():
    kv = kvstore.create("dist_sync")
    mine = value(rt.rank(), (6, 4), np.float32)
    out = np.empty((6, 4), np.float32)
    kv.broadcast("emb", mine, out=out)
    assert_exact(out, value(0, (6, 4), np.float32).astype(np.float64), "broadcast")
    kv.push("emb", mine)
    rows = [4, 1, 1] if rt.rank() % 2 else [0, 5]
    dense = np.full((6, 4), -1.0, np.float32)
    kv.row_sparse_pull("emb", out=dense, row_ids=np.array(rows))
    expected = np.zeros((6, 4))
    expected[rows] = expected_sum((6, 4), np.float32)[rows]
    assert_exact(dense, expected, "row_sparse_pull")
    expect_raises(rt.InvalidArgumentError, kv.row_sparse_pull, "emb", row_ids=[6],
                  match=["'emb'", "[0, 6)"])


@check
def sgd_and_adam_on_the_store_after_k_steps():
    for make, reference in ((lambda: kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                           wd=0.01, rescale_grad=0.5),
                             sgd_reference),
                            (lambda: kvstore.optimizer.Adam(learning_rate=0.05, wd=0.001,
                                                            clip_gradient=6.0),
                             adam_reference)):
        kv = kvstore.create("dist_sync")
        kv.set_optimizer(make())
        initial = np.linspace(-1, 1, 11).astype(np.float32)
        kv.init("w", initial)
        grads = []
        for step in range(3):
            kv.push("w", value(rt.rank(), (11,), np.float32, step) / 4)
            grads.append(sum(value(r, (11,), np.float32, step) / 4 for r in range(rt.size())))
        weight = kv.pull("w")
        expected = reference(make(), initial, grads)
        np.testing.assert_allclose(weight, expected, rtol=2e-6, atol=2e-6)
        same_on_all_ranks(weight.tobytes(), "weights after the updates")


@check
def optimizer_states_saved_and_loaded():
    def store():
        kv = kvstore.create("dist_sync")
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        kv.init(0, np.zeros(4, np.float32))
        return kv

    kv, n = store(), rt.size()
    expect_raises(rt.UsageError, kvstore.create("dist_sync").save_optimizer_states, "x",
                  match=["no optimizer"])
    kv.push(0, np.ones(4, np.float32))
    first = kv.pull(0)                                      # momentum -0.1 n
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "states")
        kv.save_optimizer_states(path)
        kv.push(0, np.ones(4, np.float32))
        second = kv.pull(0)                                 # + (0.9 * -0.1 n - 0.1 n)
        other = store()
        other.load_optimizer_states(path)
        other.push(0, np.ones(4, np.float32))
        np.testing.assert_allclose(other.pull(0), second - first, rtol=1e-6)
        third = kvstore.create("dist_sync")
        third.set_optimizer(kvstore.optimizer.SGD(learning_rate=0.1, momentum=0.9))
        third.init(1, np.zeros(4, np.float32))
        expect_raises(rt.InvalidArgumentError, third.load_optimizer_states, path,
                      match=["states of 0", "does not have"])
        with open(path, "wb") as file:
            file.write(b"not a states file")
        expect_raises(rt.InvalidArgumentError, other.load_optimizer_states, path,
                      match=["not an optimizer states file"])
    np.testing.assert_allclose(second, -0.1 * n - (0.09 * n + 0.1 * n), rtol=1e-6)


@check
def an_updater_function_accumulates():
    kv = kvstore.create("dist_sync")
    kv.set_optimizer(lambda key, grad, weight: weight.__iadd__(grad))
    kv.init(1, np.zeros(3, np.float32))
    for _ in range(3):
        kv.push(1, np.ones(3, np.float32))
    assert np.allclose(kv.pull(1), 3 * rt.size())


@check
def two_bit_compression_sums_the_quantized_values():
    threshold = 0.5
    kv = kvstore.create("dist_sync")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init("g", np.zeros(37, np.float32))
    residuals = [np.zeros(37, np.float32) for _ in range(rt.size())]
    for step in range(3):
        grads = [np.random.default_rng([r, step]).standard_normal(37).astype(np.float32)
                 for r in range(rt.size())]
        kv.push("g", grads[rt.rank()])
        expected = np.zeros(37, np.float32)
        for r in range(rt.size()):
            quantized, residuals[r] = two_bit_model(grads[r], residuals[r], threshold)
            expected += quantized
        got = kv.pull("g")
        assert np.array_equal(got, expected), (step, got, expected)
    assert np.array_equal(kv._compression.residuals["g"], residuals[rt.rank()])


@check(min_size=2)
def a_key_pushed_by_some_workers_only_is_a_mismatch():
    kv = kvstore.create("dist_sync")
    kv.init(["a", "b"], [np.zeros(3, np.float32), np.zeros(3, np.float32)])
    kv.push("a" if rt.rank() else "b", np.ones(3, np.float32))
    expect_raises(rt.MismatchError, kv.pull, "a" if rt.rank() else "b",
                  match=["kvstore push ['a']", "kvstore push ['b']", "rank 0"])
    # the library and the store keep working
    kv.push("a", np.ones(3, np.float32))
    assert_exact(kv.pull("a"), np.full(3, float(rt.size())), "after a mismatch")


@check(min_size=2)
def init_with_another_shape_on_one_rank_is_a_mismatch():
    kv = kvstore.create("dist_sync")
    shape = (4,) if rt.rank() == 1 else (3,)
    expect_raises(rt.MismatchError, kv.init, "w", np.zeros(shape, np.float32),
                  match=["kvstore init 'w'", "rank 1 sent shape (4,)", "(3,)"])


@check(min_size=2)
def a_push_refused_on_one_rank_is_an_error_on_every_rank():
    kv = kvstore.create("dist_sync")
    kv.init("a", np.zeros(3, np.float32))
    if rt.rank() == 1:
        expect_raises(rt.InvalidArgumentError, kv.push, "a", np.ones(4, np.float32),
                      match=["'a'", "shape [4]", "shape [3]"])
    else:
        kv.push("a", np.ones(3, np.float32))
        expect_raises(rt.MismatchError, kv.pull, "a",
                      match=["rank 1", "refused", "shape [4]"])
    kv.push("a", np.ones(3, np.float32))
    assert_exact(kv.pull("a"), np.full(3, float(rt.size())), "after a refusal")


@check
def bad_input_names_the_key():
    expect_raises(rt.InvalidArgumentError, kvstore.create, "dist_foo",
                  match=["'dist_foo'", "dist_sync", "dist_async", "horovod"])
    for mode in ("local", "dist_sync"):
        kv = kvstore.create(mode)
        expect_raises(rt.InvalidArgumentError, kv.pull, "nope", match=["'nope'", "init"])
        expect_raises(rt.InvalidArgumentError, kv.push, 7, np.ones(2), match=["key 7", "init"])
        kv.init("w", np.zeros((2, 2), np.float32))
        expect_raises(rt.InvalidArgumentError, kv.init, "w", np.zeros((2, 2), np.float32),
                      match=["'w'", "initialised already"])
        expect_raises(rt.InvalidArgumentError, kv.push, "w", np.zeros((2, 2), np.float64),
                      match=["'w'", "float64", "float32"])
        expect_raises(rt.InvalidArgumentError, kv.push, "w", np.zeros(4, np.float32),
                      match=["'w'", "shape [4]", "shape [2, 2]"])
        expect_raises(rt.InvalidArgumentError, kv.set_gradient_compression,
                      {"type": "1bit"}, match=["'1bit'", "2bit"])
        for threshold in (0, -0.5, float("nan")):
            expect_raises(rt.InvalidArgumentError, kv.set_gradient_compression,
                          {"type": "2bit", "threshold": threshold}, match=["threshold"])
        expect_raises(rt.InvalidArgumentError, kv.push, ["w", "v"], [np.zeros(2)],
                      match=["2 keys"])
        kv.push("w", np.ones((2, 2), np.float32))
        assert kv.pull("w").sum() == 4 * kv.num_workers


@check
def local_and_device_modes_in_one_process():
    for mode in ("local", "device"):
        kv = kvstore.create(mode)
        assert kv.rank == 0 and kv.num_workers == 1 and kv.type == mode
        kv.init([1, "x"], [np.zeros(5, np.int32), np.zeros((2, 2), np.float32)])
        kv.push([1, "x"], [[value(0, (5,), np.int32), value(1, (5,), np.int32)],
                           np.ones((2, 2), np.float32)])
        assert_exact(kv.pull(1), value(0, (5,), np.float64) + value(1, (5,), np.float64),
                     mode)
        assert_exact(kv.pull("x"), np.ones((2, 2)), mode)
        kv.set_optimizer(kvstore.optimizer.SGD(learning_rate=1.0))
        kv.push("x", np.ones((2, 2), np.float32))
        assert_exact(kv.pull("x"), np.zeros((2, 2)), f"{mode} with SGD")


if __name__ == "__main__":
    main()
