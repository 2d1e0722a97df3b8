"""fp32 master weights, bfloat16 views of torch tensors and the loss scaler's 16-bit
checks, without MPI (the multi-rank checks are in tests/mpi/trainer_mixed_precision.py)."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ringtrain.collectives import engine  # noqa: E402
from ringtrain.collectives.errors import InvalidArgumentError  # noqa: E402
from ringtrain.kernels import BFLOAT16 as BF16  # noqa: E402
from ringtrain.trainer import _dtypes  # noqa: E402
from ringtrain.trainer.loss_scaling import _nonfinite, _unscale  # noqa: E402
from ringtrain.trainer.master_weights import STATE_KEY, MasterWeights  # noqa: E402


def model(dtype=torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    net[2].to(dtype)
    return net


def wrapped(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> MasterWeights:
    return MasterWeights(optimizer, list(net.named_parameters()))


def train_step(net: torch.nn.Module, masters: MasterWeights, optimizer, seed: int) -> None:
    """One step as the DistributedOptimizer takes it (without the reduction)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=generator)
    masters.zero_model_gradients(set_to_none=True)
    optimizer.zero_grad()
    out = net[2](net[1](net[0](x)).to(net[2].weight.dtype))
    out.float().square().mean().backward()
    masters.take_from_model()
    masters.upcast_gradients()
    optimizer.step()
    masters.end_step()


# --------------------------------------------------------------------------- bfloat16 views

def test_bfloat16_tensors_are_viewed_without_a_copy():
    tensor = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16)
    array = engine.torch_view(tensor, "allreduce", "t")
    assert array.dtype == BF16
    array[1] = 7.0
    assert tensor[1].item() == 7.0
    back = engine.torch_from_host(array)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == tensor.data_ptr()
    assert engine.torch_view(torch.ones(2), "allreduce", "t").dtype == np.float32
    assert engine.is_torch_tensor(tensor) and not engine.is_torch_tensor(array)


def test_numpy_dtypes_of_torch_dtypes():
    assert _dtypes.numpy_dtype(torch.bfloat16) == BF16
    assert _dtypes.numpy_dtype(torch.float16) == np.float16
    with pytest.raises(TypeError):
        _dtypes.numpy_dtype(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32])
def test_the_loss_scaler_checks_and_unscales_16_bit_gradients(dtype):
    gradient = np.array([1.0, -2.0, 0.5], np.float32).astype(dtype)
    assert not _nonfinite(gradient)
    _unscale(gradient, 0.25)
    assert gradient.astype(np.float32).tolist() == [0.25, -0.5, 0.125]
    gradient[2] = np.inf
    assert _nonfinite(gradient)
    gradient[2] = np.nan
    assert _nonfinite(gradient)


# --------------------------------------------------------------------------- master weights

def test_the_copies_take_the_low_precision_parameters_places():
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    group, params = sgd.param_groups[0], sgd.param_groups[0]["params"]
    masters = wrapped(net, sgd)
    assert len(masters) == 2 and "2 float32 copies" in repr(masters)
    assert sgd.param_groups[0] is group and group["params"] is params and group["lr"] == 0.1
    assert params[0] is net[0].weight and params[1] is net[0].bias
    assert [p.dtype for p in params] == [torch.float32] * 4
    assert params[2] is masters.master_of(2) and params[3] is masters.master_of(3)
    assert masters.master_of(0) is None
    assert all(p.is_leaf and p.requires_grad for p in params)


def test_state_held_before_wrapping_moves_to_the_copies_in_float32():
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    buffer = torch.ones(2, 3, dtype=torch.bfloat16)
    sgd.state[net[2].weight]["momentum_buffer"] = buffer
    masters = wrapped(net, sgd)
    moved = sgd.state[masters.master_of(2)]["momentum_buffer"]
    assert moved.dtype == torch.float32 and torch.equal(moved, buffer.float())
    assert net[2].weight not in sgd.state


def test_a_step_upcasts_steps_the_copies_and_rounds_them_into_the_model():
    net = model()
    reference = copy.deepcopy(net)
    sgd = torch.optim.SGD(net.parameters(), lr=0.001)
    masters = wrapped(net, sgd)
    for step in range(3):
        train_step(net, masters, sgd, step)
    # By hand: float32 copies of the bfloat16 layer, stepped with upcast gradients.
    copies = [p.detach().float().clone() for p in reference[2].parameters()]
    by_hand = torch.optim.SGD(list(reference[0].parameters()) + copies, lr=0.001)
    for step in range(3):
        by_hand.zero_grad()
        reference.zero_grad()
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(5, 4, generator=generator)
        out = reference[2](reference[1](reference[0](x)).to(torch.bfloat16))
        out.float().square().mean().backward()
        for master, parameter in zip(copies, reference[2].parameters()):
            master.grad = parameter.grad.float()
        by_hand.step()
        with torch.no_grad():
            for master, parameter in zip(copies, reference[2].parameters()):
                parameter.copy_(master)
    assert torch.equal(masters.master_of(2), copies[0])
    assert torch.equal(masters.master_of(3), copies[1])
    for mine, theirs in zip(net.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    # lr 0.001: the bfloat16 parameters lag behind their copies, which keep the small updates
    assert not torch.equal(masters.master_of(2), net[2].weight.detach().float())


def test_the_copies_are_taken_from_the_model_when_first_needed():
    net = model()
    masters = wrapped(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with torch.no_grad():
        net[2].weight.fill_(0.375)
    assert torch.equal(masters.state_dict()[2], torch.full((2, 3), 0.375))
    with torch.no_grad():
        net[2].weight.fill_(1.0)  # after the copies were taken: the copies are the weights
    masters.take_from_model()
    assert float(masters.master_of(2).detach()[0, 0]) == 0.375


def test_state_dict_round_trip_and_pickle():
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    masters = wrapped(net, sgd)
    for step in range(2):
        train_step(net, masters, sgd, step)
    saved = pickle.loads(pickle.dumps({STATE_KEY: masters.state_dict(),
                                       **sgd.state_dict()}))
    assert sorted(saved[STATE_KEY]) == [2, 3]
    other_net = model(seed=5)
    other_sgd = torch.optim.SGD(other_net.parameters(), lr=0.001, momentum=0.9)
    other = wrapped(other_net, other_sgd)
    other.load_state_dict(saved.pop(STATE_KEY))
    other_sgd.load_state_dict(saved)
    other_net[0].load_state_dict(net[0].state_dict())
    assert torch.equal(other.master_of(2), masters.master_of(2))
    assert torch.equal(other_net[2].weight, net[2].weight)  # rounded from the copies
    train_step(net, masters, sgd, 7)
    train_step(other_net, other, other_sgd, 7)
    for mine, theirs in zip(net.parameters(), other_net.parameters()):
        assert torch.equal(mine, theirs)
    assert torch.equal(other.master_of(3), masters.master_of(3))


def test_loading_no_copies_takes_them_from_the_model_again():
    net = model()
    masters = wrapped(net, torch.optim.SGD(net.parameters(), lr=0.1))
    masters.take_from_model()
    with torch.no_grad():
        net[2].bias.fill_(2.0)
    masters.load_state_dict(None)
    masters.take_from_model()
    assert torch.equal(masters.master_of(3), torch.full((2,), 2.0))


def test_copies_that_do_not_fit_are_refused_naming_the_parameter():
    net = model()
    masters = wrapped(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(InvalidArgumentError, match=r"'2.weight'.*shape \(3,\).*\(2, 3\)"):
        masters.load_state_dict({2: torch.zeros(3), 3: torch.zeros(2)})
    with pytest.raises(InvalidArgumentError, match=r"positions \[2\].*at \[2, 3\]"):
        masters.load_state_dict({2: torch.zeros(2, 3)})
    with pytest.raises(InvalidArgumentError, match="dict of tensors"):
        masters.load_state_dict([torch.zeros(2, 3)])


def test_model_gradients_changed_after_the_upcast_are_used_with_a_warning():
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    masters = wrapped(net, sgd)
    net[2].weight.grad = torch.ones(2, 3, dtype=torch.bfloat16)
    net[2].bias.grad = torch.ones(2, dtype=torch.bfloat16)
    masters.upcast_gradients()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        masters.gradients_for_step()  # unchanged: nothing to say
    net[2].weight.grad.mul_(0.5)
    with pytest.warns(UserWarning, match=r"'2.weight'.*master_parameters\(\)"):
        masters.gradients_for_step()
    assert torch.equal(masters.master_of(2).grad, torch.full((2, 3), 0.5))
    masters.zero_model_gradients(set_to_none=False)
    assert torch.equal(net[2].weight.grad, torch.zeros(2, 3, dtype=torch.bfloat16))
