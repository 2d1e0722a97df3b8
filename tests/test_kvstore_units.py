"""The KVStore in one process: its optimizers against MXNet's update rules, the optimizer
adapters, the ``local`` mode, the compression parameters, where keys live on the servers
and how many ranks serve."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mpi.kvstore_model import adam_reference, sgd_reference
from ringtrain import kvstore
from ringtrain.collectives import InvalidArgumentError, UnsupportedDtypeError
from ringtrain.kvstore import _protocol
from ringtrain.kvstore.optimizer import SGD, Adam, TorchOptimizer, Updater, as_optimizer

GRADS = [np.linspace(-3, 5, 9).astype(np.float32) * (step + 1) for step in range(4)]
INITIAL = np.linspace(1, -1, 9).astype(np.float32)


def run(optimizer, grads=GRADS, initial=INITIAL) -> np.ndarray:
    weight = initial.copy()
    state = optimizer.create_state(0, weight)
    for grad in grads:
        optimizer.update(0, weight, grad, state)
    return weight


@pytest.mark.parametrize("options", [dict(), dict(momentum=0.9), dict(wd=0.1, momentum=0.5),
                                     dict(rescale_grad=0.25, clip_gradient=2.0)])
def test_sgd_follows_mxnet(options):
    optimizer = SGD(learning_rate=0.1, **options)
    np.testing.assert_allclose(run(optimizer), sgd_reference(optimizer, INITIAL, GRADS),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(), dict(wd=0.01, beta1=0.8),
                                     dict(rescale_grad=0.5, clip_gradient=1.0, epsilon=1e-6)])
def test_adam_follows_mxnet(options):
    optimizer = Adam(learning_rate=0.05, **options)
    np.testing.assert_allclose(run(optimizer), adam_reference(optimizer, INITIAL, GRADS),
                               rtol=1e-5, atol=1e-6)


def test_a_torch_optimizer_updates_the_store_s_weight_in_place():
    torch = pytest.importorskip("torch")
    adapter = TorchOptimizer(torch.optim.Adam, lr=0.05)
    weight = INITIAL.copy()
    state = adapter.create_state("w", weight)
    parameter = torch.nn.Parameter(torch.from_numpy(INITIAL.copy()))
    reference = torch.optim.Adam([parameter], lr=0.05)
    for grad in GRADS[:2]:
        adapter.update("w", weight, grad, state)
        parameter.grad = torch.from_numpy(grad)
        reference.step()
    # a state saved and loaded holds a copy of the tensor: it is pointed at the weight again
    state = pickle.loads(pickle.dumps(state))
    for grad in GRADS[2:]:
        adapter.update("w", weight, grad, state)
        parameter.grad = torch.from_numpy(grad)
        reference.step()
    np.testing.assert_array_equal(weight, parameter.detach().numpy())
    assert isinstance(as_optimizer(torch.optim.SGD), TorchOptimizer)


def test_functions_become_updaters_and_other_objects_are_refused():
    def add(key, grad, weight):
        weight += grad

    assert isinstance(as_optimizer(add), Updater)
    np.testing.assert_array_equal(run(as_optimizer(add)), INITIAL + sum(GRADS))
    with pytest.raises(InvalidArgumentError, match="update"):
        as_optimizer(3)
    with pytest.raises(InvalidArgumentError, match="clip_gradient"):
        SGD(clip_gradient=0)


def test_the_local_store_sums_several_values_and_updates_with_its_optimizer():
    kv = kvstore.create("local")
    kv.init(["a", 2], [np.zeros(3, np.float32), np.zeros((2, 2), np.int64)])
    kv.push(["a", 2], [[np.ones(3, np.float32)] * 3, np.full((2, 2), 4)])
    assert kv.pull("a").tolist() == [3, 3, 3]
    outs = [np.empty((2, 2), np.int64), np.empty((2, 2), np.int64)]
    kv.pull(2, out=outs)
    assert all(out.tolist() == [[4, 4], [4, 4]] for out in outs)
    kv.push(["a", 2, "a"], [np.ones(3, np.float32), np.ones((2, 2), np.int64),
                            np.full(3, 2, np.float32)])  # a key listed twice: summed
    assert kv.pull("a").tolist() == [3, 3, 3]
    kv.set_optimizer(SGD(learning_rate=0.5))
    kv.push("a", np.ones(3, np.float32))
    assert kv.pull("a").tolist() == [2.5, 2.5, 2.5]
    with pytest.raises(InvalidArgumentError, match="differ in shape or dtype"):
        kv.push("a", [np.ones(3, np.float32), np.ones(4, np.float32)])
    with pytest.raises(UnsupportedDtypeError, match="bool"):
        kv.init("flag", np.zeros(2, bool))
    with pytest.raises(InvalidArgumentError, match="keys are ints or strings"):
        kv.init(2.5, np.zeros(2))
    with pytest.raises(InvalidArgumentError, match="out has shape"):
        kv.pull("a", out=np.empty(4, np.float32))


def test_2bit_compression_in_the_local_store_keeps_a_residual():
    kv = kvstore.create("local")
    kv.set_gradient_compression({"type": "2bit", "threshold": 1.0})
    kv.init("g", np.zeros(4, np.float32))
    kv.push("g", np.array([0.6, -0.6, 1.5, 0.0], np.float32))
    assert kv.pull("g").tolist() == [0, 0, 1, 0]
    kv.push("g", np.array([0.6, -0.6, 0.0, 0.0], np.float32))
    assert kv.pull("g").tolist() == [1, -1, 0, 0]
    kv.init("i", np.zeros(4, np.int32))
    with pytest.raises(UnsupportedDtypeError, match="key 'i'"):
        kv.push("i", np.ones(4, np.int32))
    with pytest.raises(InvalidArgumentError, match="unknown parameters"):
        kv.set_gradient_compression({"type": "2bit", "threshold": 1.0, "bits": 2})
    kv.set_gradient_compression({"type": "none"})
    kv.push("g", np.array([0.25, 0, 0, 0], np.float32))
    assert kv.pull("g")[0] == 0.25


def test_keys_are_placed_on_the_servers_and_big_values_split_evenly():
    assert _protocol.parts(5, 100, 2, 1000) == [(1, 0, 100)]
    assert _protocol.parts("w", 100, 3, 1000) == _protocol.parts("w", 100, 3, 1000)
    assert _protocol.parts(0, 10, 3, 9) == [(0, 0, 3), (1, 3, 6), (2, 6, 10)]
    assert _protocol.parts(0, 10, 1, 9) == [(0, 0, 10)]
    argument = _protocol.threshold_argument(0.5)
    assert argument != 0 and _protocol.threshold_of(argument) == 0.5


def test_the_number_of_servers(monkeypatch):
    monkeypatch.delenv("RINGTRAIN_KV_SERVERS", raising=False)
    assert kvstore.server_count() == 1
    monkeypatch.setenv("RINGTRAIN_KV_SERVERS", "3")
    assert kvstore.server_count() == 3 and kvstore.server_count(2) == 2
    with pytest.raises(InvalidArgumentError, match="servers"):
        kvstore.server_count(0)
