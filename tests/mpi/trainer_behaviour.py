"""DistributedOptimizer behaviour on any number of ranks: the contracts users rely on and
every misuse refused with a message that says what happened.

Run: mpiexec -n K python tests/mpi/trainer_behaviour.py [--only SUBSTRING]
"""

from __future__ import annotations

import copy
import traceback
import warnings

import numpy as np

import ringtrain as rt
from _harness import Digests, check, expect_raises, main, rng

try:
    import torch
except ImportError:
    torch = None

LR = 0.1


# --------------------------------------------------------------------------- helpers

def mlp(seed: int = 3, depth: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(5, 5), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(5, 2))


def batch(rank: int, step: int = 0, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = rng(rank, "batch", step)
    return (torch.from_numpy(generator.standard_normal((rows, 5)).astype(np.float32)),
            torch.from_numpy(generator.standard_normal((rows, 2)).astype(np.float32)))


def loss_of(model: torch.nn.Module, rank: int, step: int = 0) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def wrapped(model: torch.nn.Module, **options) -> rt.DistributedOptimizer:
    options.setdefault("fusion_threshold", 200)
    options.setdefault("first_bucket_bytes", 50)
    return rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters(), **options)


def all_ranks_gradients(model: torch.nn.Module, step: int = 0) -> list[list[np.ndarray]]:
    """Every rank's local gradients, computed here from every rank's batch."""
    everyone = []
    for rank in range(rt.size()):
        replica = copy.deepcopy(model)
        loss_of(replica, rank, step).backward()
        everyone.append([p.grad.numpy().copy() for p in replica.parameters()])
    return everyone


def assert_identical_across_ranks(model: torch.nn.Module, what: str) -> None:
    digests = Digests()
    for name, parameter in model.named_parameters():
        digests.add(f"{what} {name}", parameter.detach().numpy())
    digests.verify()


def torch_check(function):
    if torch is not None:
        check(function)
    return function


# --------------------------------------------------------------------------- PyTorch

@torch_check
def torch_averages_like_the_reference():
    model = mlp()
    everyone = all_ranks_gradients(model)
    optimizer = wrapped(model)
    loss_of(model, rt.rank()).backward()
    optimizer.synchronize()
    for index, parameter in enumerate(model.parameters()):
        expected = np.mean([grads[index] for grads in everyone], axis=0)
        np.testing.assert_allclose(parameter.grad.numpy(), expected, rtol=1e-6, atol=1e-7)
    with optimizer.skip_synchronize():
        optimizer.step()
    assert_identical_across_ranks(model, "after step")


@torch_check
def torch_unused_parameters_do_not_hang():
    """Rank 0 skips the middle layers; the others use them: rank 0 contributes zeros."""
    model = mlp(depth=3)
    everyone = all_ranks_gradients(model)
    optimizer = wrapped(model)
    x, y = batch(rt.rank())
    output = model[-1](model[0](x)) if rt.rank() == 0 else model(x)
    torch.nn.functional.mse_loss(output, y).backward()
    optimizer.step()
    middle = model[2].weight
    index = [p is middle for p in model.parameters()].index(True)
    contributions = [np.zeros_like(everyone[0][index])] + \
        [everyone[r][index] for r in range(1, rt.size())]
    np.testing.assert_allclose(middle.grad.numpy(), np.mean(contributions, axis=0),
                               rtol=1e-6, atol=1e-7)
    assert_identical_across_ranks(model, "after a step with unused parameters")


@torch_check
def torch_zero_grad_between_backward_and_step_is_refused():
    model = mlp()
    optimizer = wrapped(model)
    loss_of(model, rt.rank()).backward()
    expect_raises(rt.UsageError, optimizer.zero_grad,
                  match=["zero_grad() was called after loss.backward()", "before"])
    optimizer.step()
    optimizer.zero_grad()
    assert_identical_across_ranks(model, "after the refused zero_grad")


@torch_check
def torch_too_many_backward_passes_are_refused():
    model = mlp()
    optimizer = wrapped(model, backward_passes_per_step=1)
    loss_of(model, rt.rank()).backward()
    error = expect_raises(rt.UsageError, lambda: loss_of(model, rt.rank(), 1).backward(),
                          match=["computed 2 times", "backward_passes_per_step is 1"])
    assert "'" in str(error)
    optimizer.step()
    assert_identical_across_ranks(model, "after the refused pass")


@torch_check
def torch_names_are_checked():
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    named = list(model.named_parameters())
    twice = [("same", p) for _, p in named[:2]] + named[2:]
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, sgd, twice,
                  match=["repeats the name(s) 'same'"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, sgd, named[1:],
                  match=["1 parameter(s) of the optimizer are missing from named_parameters",
                         "(5, 5)"])
    eight = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3, dtype=torch.float8_e4m3fn))],
                            lr=1)
    expect_raises(rt.UnsupportedDtypeError, rt.DistributedOptimizer, eight,
                  match=[f"rank {rt.rank()}", "param_groups[0][0]", "float8_e4m3fn"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, sgd, named,
                  op=rt.Sum, gradient_predivide_factor=2.0, match=["needs op=Average"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, sgd, named,
                  backward_passes_per_step=0, match=["backward_passes_per_step"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, sgd, named,
                  fusion_threshold=-1, match=["fusion_threshold"])


@torch_check
def torch_different_models_fail_on_every_rank_then_recover():
    model = mlp(depth=2 if rt.rank() == 0 else 3)
    optimizer = wrapped(model)
    loss_of(model, rt.rank()).backward()
    if rt.size() > 1:
        error = expect_raises(rt.MismatchError, optimizer.synchronize,
                              match=["gradient bucket 1/", "rank 0 sent"])
        notes = "".join(getattr(error, "__notes__", []))
        assert "while reducing gradient bucket 1/" in notes, notes
        frames = "".join(traceback.format_exception(error))
        assert "_resolution.py" in frames, frames  # raised on the collectives thread
    model = mlp()
    optimizer = wrapped(model)
    loss_of(model, rt.rank()).backward()
    optimizer.step()
    assert_identical_across_ranks(model, "after recovering")


@torch_check
def torch_synchronize_then_clip_inside_skip_synchronize():
    model = mlp()
    optimizer = wrapped(model)
    loss_of(model, rt.rank()).backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
    assert float(norm) <= 0.0101, float(norm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with optimizer.skip_synchronize():
            optimizer.step()
    loss_of(model, rt.rank(), 1).backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert any("skip_synchronize" in str(w.message) for w in caught), caught
    assert_identical_across_ranks(model, "after clipping")


@torch_check
def torch_closure_step_and_lr_scheduler():
    reference = mlp()
    model = copy.deepcopy(reference)
    optimizer = wrapped(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    reference_sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_sgd, step_size=1,
                                                          gamma=0.5)
    for step in range(2):
        everyone = all_ranks_gradients(reference, step)
        reference_sgd.zero_grad()
        for parameter, *grads in zip(reference.parameters(), *everyone):
            parameter.grad = torch.from_numpy(np.mean(grads, axis=0))
        reference_sgd.step()
        reference_scheduler.step()

        def closure():
            optimizer.zero_grad()
            loss = loss_of(model, rt.rank(), step)
            loss.backward()
            return loss

        optimizer.step(closure)
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == LR / 4
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(mine.detach().numpy(), theirs.detach().numpy(),
                                   rtol=1e-6, atol=1e-7)
    assert_identical_across_ranks(model, "after closure steps")


@torch_check
def torch_state_dict_passes_through():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    optimizer = rt.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    loss_of(model, rt.rank()).backward()
    optimizer.step()
    state = optimizer.state_dict()
    assert state == inner.state_dict() or len(state["state"]) == len(inner.state)
    optimizer.load_state_dict(state)
    assert isinstance(optimizer, torch.optim.Optimizer)
    expect_raises(rt.UsageError, optimizer.add_param_group, {"params": []},
                  match=["before wrapping"])


@torch_check
def torch_join_with_uneven_batches():
    """Rank r has r + 1 batches: ranks that run out shadow the others' steps."""
    reference = mlp()
    model = copy.deepcopy(reference)
    optimizer = wrapped(model)
    with rt.join(optimizer) as joined:
        for step in range(rt.rank() + 1):
            optimizer.zero_grad()
            loss_of(model, rt.rank(), step).backward()
            optimizer.step()
    assert joined.last_rank == rt.size() - 1, joined
    assert joined.shadow_steps == rt.size() - 1 - rt.rank(), joined
    reference_sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(rt.size()):
        everyone = all_ranks_gradients(reference, step)
        reference_sgd.zero_grad()
        for index, parameter in enumerate(reference.parameters()):
            active = [everyone[r][index] for r in range(rt.size()) if r >= step]
            parameter.grad = torch.from_numpy(np.sum(active, axis=0) / rt.size())
        reference_sgd.step()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(mine.detach().numpy(), theirs.detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
    assert_identical_across_ranks(model, "after join")
    loss_of(model, rt.rank()).backward()  # the optimizer works normally afterwards
    optimizer.step()
    assert_identical_across_ranks(model, "after a step following join")


@torch_check
def torch_loss_scaler_skips_an_overflow_on_every_rank():
    model = mlp()
    optimizer = wrapped(model, compression=rt.Compression.fp16)
    scaler = rt.DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    loss = loss_of(model, rt.rank())
    if rt.rank() == rt.size() - 1:
        loss = loss * float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rt.NonFiniteWarning)
        scaler.scale(loss).backward()
        assert scaler.step(optimizer) is False
    assert scaler.loss_scale == 2.0 ** 9 and scaler.skipped_steps == 1
    for old, new in zip(before, model.parameters()):
        assert torch.equal(old, new.detach())
    for step in range(2):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, rt.rank(), step)).backward()
        assert scaler.step(optimizer) is True
    assert scaler.loss_scale == 2.0 ** 10, scaler
    assert_identical_across_ranks(model, "after scaled steps")


@torch_check
def torch_loss_scaler_unscales_exactly():
    reference = mlp()
    model = copy.deepcopy(reference)
    optimizer = wrapped(model)
    scaler = rt.DynamicLossScaler(init_scale=2.0 ** 8)
    everyone = all_ranks_gradients(reference)
    scaler.scale(loss_of(model, rt.rank())).backward()
    assert scaler.step(optimizer)
    reference_sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    for parameter, *grads in zip(reference.parameters(), *everyone):
        parameter.grad = torch.from_numpy(np.mean(grads, axis=0))
    reference_sgd.step()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(mine.detach().numpy(), theirs.detach().numpy(),
                                   rtol=1e-6, atol=1e-7)


@torch_check
def torch_predivide_and_sum():
    model = mlp()
    everyone = all_ranks_gradients(model)
    for options, factor in (({"gradient_predivide_factor": 4.0}, 1 / rt.size()),
                            ({"op": rt.Sum}, 1.0)):
        optimizer = wrapped(model, **options)
        optimizer.zero_grad()
        loss_of(model, rt.rank()).backward()
        optimizer.synchronize()
        for parameter, *grads in zip(model.parameters(), *everyone):
            np.testing.assert_allclose(parameter.grad.numpy(), np.sum(grads, axis=0) * factor,
                                       rtol=1e-5, atol=1e-7)
        optimizer.remove_hooks()


# --------------------------------------------------------------------------- numpy protocol

class PlainSGD:
    def __init__(self, params, grads):
        self.params, self.grads, self.steps = params, grads, 0

    def step(self):
        self.steps += 1
        for parameter, gradient in zip(self.params, self.grads):
            parameter -= LR * gradient


def numpy_model(rank: int = 0):
    generator = rng(rank, "numpy parameters")
    params = [generator.standard_normal(shape).astype(np.float32)
              for shape in ((3, 4), (4,), (7,), (2, 2))]
    return params, [np.zeros_like(p) for p in params]


@check
def numpy_protocol_errors():
    params, grads = numpy_model()
    named = [(f"p{i}", p, g) for i, (p, g) in enumerate(zip(params, grads))]
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, object(), named,
                  match=["step() method"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, PlainSGD(params, grads),
                  match=["named_parameters is required"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, PlainSGD(params, grads),
                  [("a", params[0], grads[1])], match=["gradient of 'a' has shape (4,)"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, PlainSGD(params, grads),
                  [("a", params[0], grads[0]), ("a", params[1], grads[1])],
                  match=["repeats the name(s) 'a'"])
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, PlainSGD(params, grads),
                  [("a", params[0])], match=["named_parameters[0]", "triple"])
    optimizer = rt.DistributedOptimizer(PlainSGD(params, grads), named)
    expect_raises(rt.InvalidArgumentError, optimizer.mark_ready, "nope",
                  match=["no gradient is called 'nope'"])
    optimizer.mark_ready("p3")
    expect_raises(rt.UsageError, optimizer.zero_grad, match=["being reduced in place"])
    optimizer.step()


@check
def numpy_step_averages_and_keeps_ranks_identical():
    params, grads = numpy_model()
    inner = PlainSGD(params, grads)
    optimizer = rt.DistributedOptimizer(inner, [(f"p{i}", p, g) for i, (p, g)
                                                in enumerate(zip(params, grads))],
                                        fusion_threshold=64, first_bucket_bytes=16)
    everyone = [numpy_model(rank)[0] for rank in range(rt.size())]
    initial = [p.copy() for p in params]
    for gradient, value in zip(grads, numpy_model(rt.rank())[0]):
        gradient[...] = value
    optimizer.mark_ready("p2")  # out of order: buckets still launch in order
    optimizer.mark_ready("p0")
    optimizer.step()
    assert inner.steps == 1
    for index, parameter in enumerate(params):
        expected = initial[index] - LR * np.mean([e[index] for e in everyone], axis=0)
        np.testing.assert_allclose(parameter, expected, rtol=1e-6, atol=1e-7)
    digests = Digests()
    for index, parameter in enumerate(params):
        digests.add(f"p{index}", parameter)
    digests.verify()


@check
def numpy_join_with_uneven_batches():
    params, grads = numpy_model()
    inner = PlainSGD(params, grads)
    optimizer = rt.DistributedOptimizer(inner, [(f"p{i}", p, g) for i, (p, g)
                                                in enumerate(zip(params, grads))])
    with rt.join(optimizer) as joined:
        for _ in range(2 if rt.rank() == 0 else 1):
            for gradient in grads:
                gradient[...] = 1.0
            optimizer.step()
    assert inner.steps == 2 and joined.last_rank == 0, (inner.steps, joined)
    expected = numpy_model()[0]
    for index, parameter in enumerate(params):
        np.testing.assert_allclose(parameter, expected[index] - LR - LR / rt.size(),
                                   rtol=1e-6)
    with rt.join(optimizer):
        expect_raises(rt.UsageError, lambda: rt.join(optimizer).__enter__(),
                      match=["already inside join()"])


@check
def reducer_reports_gradients_not_marked():
    params, grads = numpy_model()
    reducer = rt.GradientReducer([(f"p{i}", g) for i, g in enumerate(grads)])
    for index, gradient in enumerate(grads[:2]):
        gradient[...] = 1.0
        reducer.mark_ready(index, gradient)
    expect_raises(rt.UsageError, reducer.wait, match=["'p2', 'p3'", "not marked ready"])
    assert np.all(grads[0] == 1.0)
    expect_raises(rt.InvalidArgumentError, reducer.mark_ready, 0, grads[1],
                  match=["'p0' has shape (4,)"])
    expect_raises(rt.InvalidArgumentError, rt.GradientReducer, [("a", grads[0]), ("a", grads[1])],
                  match=["repeated: 'a'"])
    expect_raises(rt.InvalidArgumentError, rt.GradientReducer, [("", grads[0])],
                  match=["non-empty string"])


if __name__ == "__main__":
    rt.init()
    main()
