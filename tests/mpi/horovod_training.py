"""Horovod's training API (``ringtrain.horovod``) on any number of ranks, against
single-process references: DistributedOptimizer and its options, the state broadcasts,
the object collectives and SyncBatchNorm.

Run: mpiexec -n K python tests/mpi/horovod_training.py [--only SUBSTRING]
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import numpy as np
import torch

import ringtrain as rt
import ringtrain.horovod as hvd
from _harness import Digests, adasum_reference, check, expect_raises, main, rng

LR = 0.1


# --------------------------------------------------------------------------- helpers

def mlp(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def batch(rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = rng(rank, "batch", step)
    return (torch.from_numpy(generator.standard_normal((4, 5)).astype(np.float32)),
            torch.from_numpy(generator.standard_normal((4, 2)).astype(np.float32)))


def loss_of(model: torch.nn.Module, rank: int, step: int = 0) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def local_gradients(model: torch.nn.Module, rank: int, steps=(0,)) -> list[torch.Tensor]:
    """``rank``'s gradients (summed over ``steps``' batches), computed on a copy."""
    replica = copy.deepcopy(model)
    for step in steps:
        loss_of(replica, rank, step).backward()
    return [p.grad.clone() for p in replica.parameters()]


def combined_gradients(model: torch.nn.Module, reduce=torch.mean, ranks=None,
                       steps=(0,)) -> list[torch.Tensor]:
    """The ranks' gradients reduced (mean by default), computed here from their batches."""
    ranks = range(rt.size()) if ranks is None else ranks
    everyone = [local_gradients(model, r, steps) for r in ranks]
    return [reduce(torch.stack(per_rank), 0) for per_rank in zip(*everyone)]


def stepped_reference(model: torch.nn.Module, gradients: list[torch.Tensor],
                      make_optimizer=lambda ps: torch.optim.SGD(ps, lr=LR)) -> torch.nn.Module:
    """A copy of ``model`` after one step of a plain optimizer on ``gradients``."""
    replica = copy.deepcopy(model)
    for parameter, gradient in zip(replica.parameters(), gradients):
        parameter.grad = gradient.clone()
    make_optimizer(list(replica.parameters())).step()
    return replica


def sgd(model: torch.nn.Module, **options) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                    named_parameters=model.named_parameters(), **options)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str,
                 rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if not torch.allclose(actual, expected, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: largest difference "
                             f"{(actual - expected).abs().max().item():.3g}\n{actual}\n{expected}")


def assert_models_close(actual: torch.nn.Module, expected: torch.nn.Module, what: str,
                        **tolerance: float) -> None:
    for (name, a), b in zip(actual.named_parameters(), expected.parameters()):
        assert_close(a.detach(), b.detach(), f"{what}: {name}", **tolerance)


def assert_identical_across_ranks(model: torch.nn.Module, what: str, ranks=None) -> None:
    digests = Digests()
    for name, parameter in model.named_parameters():
        digests.add(f"{what} {name}", parameter.detach().numpy())
    if ranks is None:
        digests.verify()
    else:
        everyone = rt.allgather_object(digests.entries, name=f"digests {what}")
        for r in ranks:
            assert everyone[r] == everyone[ranks[0]], f"{what}: rank {r} differs"


# --------------------------------------------------------------------------- optimizer

@check
def init_and_sizes_match_ringtrain():
    hvd.init()
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size()) == (rt.rank(), rt.size())


@check
def averages_like_the_reference():
    model = mlp()
    expected = stepped_reference(model, combined_gradients(model))
    optimizer = sgd(model)
    assert isinstance(optimizer, torch.optim.SGD) and type(optimizer).__name__ == "SGD"
    optimizer.zero_grad()
    loss_of(model, rt.rank()).backward()
    optimizer.step()
    assert_models_close(model, expected, "after one averaged step")
    assert_identical_across_ranks(model, "after one averaged step")


@check
def joined_ranks_contribute_zeros_to_the_optimizers_buckets():
    """Rank r trains 2 + r steps, then joins: each step averages (over all ranks) the
    gradients of the ranks still training; ranks that joined stop stepping."""
    k, me = rt.size(), rt.rank()
    model = mlp()
    expected = copy.deepcopy(model)
    for step in range(2 + me):
        active = [r for r in range(k) if step < 2 + r]
        gradients = combined_gradients(expected, torch.sum, ranks=active, steps=(step,))
        expected = stepped_reference(expected, [g / k for g in gradients])
    optimizer = sgd(model)
    for step in range(2 + me):
        optimizer.zero_grad()
        loss_of(model, me, step).backward()
        optimizer.step()
    assert hvd.join() == k - 1
    assert_models_close(model, expected, f"after {2 + me} steps, the last ones with joined ranks")


@check
def sum_op_sums():
    model = mlp()
    expected = combined_gradients(model, torch.sum)
    optimizer = sgd(model, op=hvd.Sum)
    loss_of(model, rt.rank()).backward()
    optimizer.synchronize()
    for parameter, gradient in zip(model.parameters(), expected):
        assert_close(parameter.grad, gradient, "summed gradient")
    with optimizer.skip_synchronize():
        optimizer.step()


@check
def predivide_factor_still_averages():
    model = mlp()
    expected = combined_gradients(model)
    optimizer = sgd(model, gradient_predivide_factor=4.0)
    loss_of(model, rt.rank()).backward()
    optimizer.synchronize()
    for parameter, gradient in zip(model.parameters(), expected):
        assert_close(parameter.grad, gradient, "predivided average")
    with optimizer.skip_synchronize():
        optimizer.step()
    expect_raises(ValueError, sgd, mlp(), op=hvd.Sum, gradient_predivide_factor=2.0,
                  match=["gradient_predivide_factor"])


@check
def backward_passes_accumulate_then_reduce_once():
    model = mlp()
    expected = stepped_reference(model, combined_gradients(model, steps=(0, 1)))
    optimizer = sgd(model, backward_passes_per_step=2)
    assert optimizer.backward_passes_per_step == 2
    loss_of(model, rt.rank(), 0).backward()
    loss_of(model, rt.rank(), 1).backward()
    error = expect_raises(AssertionError, lambda: loss_of(model, rt.rank(), 2).backward(),
                          match=["backward_passes_per_step"])
    assert isinstance(error, rt.UsageError)
    optimizer.step()
    assert_models_close(model, expected, "after two accumulated passes")
    optimizer.set_backward_passes_per_step(1)
    assert optimizer.backward_passes_per_step == 1
    optimizer.zero_grad()
    loss_of(model, rt.rank(), 3).backward()
    expect_raises(AssertionError, lambda: loss_of(model, rt.rank(), 4).backward())
    optimizer.step()
    assert_identical_across_ranks(model, "after passes")


@check
def fp16_compression_is_close_and_custom_ones_need_a_wire():
    model = mlp()
    expected = combined_gradients(model)
    optimizer = sgd(model, compression=hvd.Compression.fp16)
    loss_of(model, rt.rank()).backward()
    optimizer.synchronize()
    for parameter, gradient in zip(model.parameters(), expected):
        assert_close(parameter.grad, gradient, "fp16 average", rtol=2e-3, atol=1e-4)
    with optimizer.skip_synchronize():
        optimizer.step()
    assert_identical_across_ranks(model, "after fp16")

    class Custom(hvd.Compression.none):
        @staticmethod
        def compress(tensor):
            return tensor * 2, None

    expect_raises(ValueError, sgd, mlp(), compression=Custom, match=["wire"])

    class Bf16(hvd.Compression.none):
        wire = rt.Compression.bf16

    sgd(mlp(), compression=Bf16)


@check
def synchronize_skip_synchronize_and_the_warning():
    model = mlp()
    expected_gradients = combined_gradients(model, torch.sum)
    optimizer = sgd(model, op=hvd.Sum)
    loss_of(model, rt.rank()).backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.clone() for p in model.parameters()]
    expected = stepped_reference(model, clipped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with optimizer.skip_synchronize():
            optimizer.step()
    assert_models_close(model, expected, "after clipping")

    optimizer.zero_grad()
    loss_of(model, rt.rank()).backward()
    optimizer.synchronize()
    reduced = [p.grad.clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "optimizer.step() called without optimizer.skip_synchronize()" in messages[0]
    # The gradients were not summed a second time.
    for parameter, gradient in zip(model.parameters(), reduced):
        assert torch.equal(parameter.grad, gradient)
    assert len(expected_gradients) == len(reduced)


@check
def zero_grad_after_backward_is_an_assertion_error():
    model = mlp()
    optimizer = sgd(model)
    loss_of(model, rt.rank()).backward()
    expect_raises(AssertionError, optimizer.zero_grad, match=["zero_grad()"])
    optimizer.step()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@check
def closure_gradients_are_reduced():
    model = mlp()
    expected = stepped_reference(model, combined_gradients(model))
    optimizer = sgd(model)

    def closure():
        optimizer.zero_grad()
        loss = loss_of(model, rt.rank())
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert torch.is_tensor(loss)
    assert_models_close(model, expected, "after a closure step")


@check
def unused_parameters_on_some_ranks_do_not_hang():
    model = mlp()
    optimizer = sgd(model)
    x, y = batch(rt.rank())
    output = model[0](x)[:, :2] if rt.rank() == 0 else model(x)
    torch.nn.functional.mse_loss(output, y).backward()
    optimizer.step()
    assert_identical_across_ranks(model, "after a step with unused parameters")


@check
def names_and_arguments_are_checked():
    model = mlp()
    plain = torch.optim.SGD(model.parameters(), lr=LR)
    named = list(model.named_parameters())
    twice = [("same", p) for _, p in named[:2]] + named[2:]
    expect_raises(ValueError, hvd.DistributedOptimizer, plain, twice, match=["same"])
    expect_raises(ValueError, hvd.DistributedOptimizer, plain, named[1:])
    expect_raises(ValueError, hvd.DistributedOptimizer, plain, [p for _, p in named],
                  match=["tuples"])
    expect_raises(ValueError, hvd.DistributedOptimizer, plain, named,
                  backward_passes_per_step=0)
    expect_raises(ValueError, hvd.DistributedOptimizer, plain, named, groups=-1)
    expect_raises(ValueError, hvd.DistributedOptimizer, plain, named, groups=[[1.0]])
    expect_raises(ValueError, hvd.DistributedOptimizer, plain, named,
                  groups=[[named[0][1]], [named[0][1]]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.DistributedOptimizer(plain, named, num_groups=2)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught), caught


@check
def default_names_are_horovods_and_agree():
    model = mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=LR))
    names = sorted(optimizer._parameter_names.values())
    assert names == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                     "allreduce.noname.1.0", "allreduce.noname.1.1"], names
    assert hvd.allgather_object(names) == [names] * rt.size()


@check
def groups_train_like_the_reference():
    for as_list in (False, True):
        model = mlp()
        groups = [[model[0].weight, model[2].bias]] if as_list else 2
        expected = stepped_reference(model, combined_gradients(model))
        optimizer = sgd(model, groups=groups)
        loss_of(model, rt.rank()).backward()
        optimizer.step()
        assert_models_close(model, expected, f"groups={groups!r}")


@check
def sparse_gradients_are_averaged_and_stay_sparse():
    def indices(rank: int) -> torch.Tensor:
        return torch.from_numpy(rng(rank, "rows").integers(0, 10, size=(2, 3)))

    for sparse_as_dense in (False, True):
        torch.manual_seed(1)
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        dense_grads = []
        for rank in range(rt.size()):
            replica = copy.deepcopy(embedding)
            replica(indices(rank)).pow(2).sum().backward()
            dense_grads.append(replica.weight.grad.to_dense())
        average = torch.stack(dense_grads).mean(0)
        reference = copy.deepcopy(embedding)
        reference.weight.grad = average.to_sparse(1)
        torch.optim.SparseAdam(list(reference.parameters()), lr=LR).step()

        optimizer = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(embedding.parameters()), lr=LR),
            named_parameters=embedding.named_parameters(), sparse_as_dense=sparse_as_dense)
        embedding(indices(rt.rank())).pow(2).sum().backward()
        optimizer.synchronize()
        gradient = embedding.weight.grad
        assert gradient.is_sparse, f"sparse_as_dense={sparse_as_dense}: gradient is dense"
        assert_close(gradient.to_dense(), average, f"sparse_as_dense={sparse_as_dense}")
        with optimizer.skip_synchronize():
            optimizer.step()
        assert_models_close(embedding, reference, f"SparseAdam, as_dense={sparse_as_dense}")
        assert_identical_across_ranks(embedding, f"sparse, as_dense={sparse_as_dense}")


@check(min_size=2)
def process_set_optimizer_leaves_other_ranks_local():
    even = list(range(0, rt.size(), 2))
    odd = list(range(1, rt.size(), 2))
    even_set = hvd.add_process_set(even)
    odd_set = hvd.add_process_set(odd)
    try:
        model = mlp()
        if rt.rank() in even:
            expected = stepped_reference(model, combined_gradients(model, ranks=even))
        else:
            expected = stepped_reference(model, local_gradients(model, rt.rank()))
        optimizer = sgd(model, process_set=even_set)
        loss_of(model, rt.rank()).backward()
        optimizer.step()
        assert_models_close(model, expected, "process set step")
        assert_identical_across_ranks(model, "even ranks", ranks=even)
    finally:
        hvd.remove_process_set(odd_set)
        hvd.remove_process_set(even_set)


@check
def adasum_combines_the_ranks_updates():
    """Any number of ranks (CPU tensors, as Horovod's CPU Adasum)."""
    model = mlp()
    everyone = [local_gradients(model, r) for r in range(rt.size())]
    optimizer = sgd(model, op=hvd.Adasum)
    starts = [p.detach().clone() for p in model.parameters()]
    expect_raises(AssertionError, optimizer.skip_synchronize().__enter__)
    loss_of(model, rt.rank()).backward()
    optimizer.step()
    for index, (parameter, start) in enumerate(zip(model.parameters(), starts)):
        deltas = [(-LR * grads[index]).double().reshape(-1).numpy() for grads in everyone]
        expected = start.double() + torch.from_numpy(adasum_reference(deltas)).reshape(
            start.shape)
        assert_close(parameter.detach().double(), expected, "adasum step", rtol=1e-5,
                     atol=1e-6)
    assert_identical_across_ranks(model, "after adasum")


@check
def bfloat16_models_average_and_adasum():
    """A bfloat16 model: its gradients travel as bfloat16, within 2·N·2^-8 of the
    largest local gradient from the exact mean (N-1 partial sums and the quotient
    rounded once each); Adasum combines bfloat16 changes. Ranks stay bit-identical."""
    def loss(model: torch.nn.Module, rank: int) -> torch.Tensor:
        x, y = batch(rank)
        return torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16())

    def digests_agree(model: torch.nn.Module, what: str) -> None:
        digests = Digests()
        for name, parameter in model.named_parameters():
            digests.add(f"{what} {name}", parameter.detach().double().numpy())
        digests.verify()

    model = mlp().to(torch.bfloat16)
    everyone = []
    for rank in range(rt.size()):
        replica = copy.deepcopy(model)
        loss(replica, rank).backward()
        everyone.append([p.grad.double() for p in replica.parameters()])
    optimizer = sgd(model)
    optimizer.zero_grad()
    loss(model, rt.rank()).backward()
    optimizer.synchronize()
    for (name, parameter), *grads in zip(model.named_parameters(), *everyone):
        assert parameter.grad.dtype == torch.bfloat16, (name, parameter.grad.dtype)
        stacked = torch.stack(grads)
        bound = 2 * rt.size() * 2.0 ** -8 * float(stacked.abs().max())
        error = float((parameter.grad.double() - stacked.mean(0)).abs().max())
        assert error <= bound, f"{name}: off by {error:.3g} > {bound:.3g}"
    with optimizer.skip_synchronize():
        optimizer.step()
    digests_agree(model, "bfloat16 step")
    optimizer.remove_hooks()
    adasum = sgd(model, op=hvd.Adasum)
    adasum.zero_grad()
    loss(model, rt.rank()).backward()
    adasum.step()
    digests_agree(model, "bfloat16 adasum")


# --------------------------------------------------------------------------- state

@check
def broadcast_parameters_from_any_root():
    for root in sorted({0, rt.size() - 1}):
        model = mlp(seed=10 + rt.rank())
        expected = mlp(seed=10 + root)
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        assert_models_close(model, expected, f"state_dict from {root}", rtol=0, atol=0)
        model = mlp(seed=20 + rt.rank())
        hvd.broadcast_parameters(list(model.named_parameters()), root_rank=root)
        assert_models_close(model, mlp(seed=20 + root), f"named from {root}", rtol=0, atol=0)
        model = mlp(seed=30 + rt.rank())
        hvd.broadcast_parameters(model.parameters(), root_rank=root, prefix="model.")
        assert_models_close(model, mlp(seed=30 + root), f"list from {root}", rtol=0, atol=0)
    expect_raises(ValueError, hvd.broadcast_parameters, 3, 0, match=["invalid params"])


@check
def broadcast_optimizer_state_gives_the_roots():
    def trained(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = mlp()
        adam = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1),
                                betas=(0.8, 0.9 + 0.01 * rank))
        if rank == 0:
            loss_of(model, 0).backward()
            adam.step()
        return model, adam

    model, adam = trained(rt.rank())
    optimizer = hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    _, expected = trained(0)
    group, expected_group = optimizer.param_groups[0], expected.param_groups[0]
    assert group["lr"] == expected_group["lr"] and group["betas"] == (0.8, 0.9), group
    assert isinstance(group["betas"], tuple)
    state, expected_state = optimizer.state_dict()["state"], expected.state_dict()["state"]
    assert sorted(state) == sorted(expected_state), (sorted(state), sorted(expected_state))
    for key in expected_state:
        for name, value in expected_state[key].items():
            assert_close(state[key][name], value, f"state {key}.{name}", rtol=0, atol=0)

    model = mlp()
    model[0].bias.requires_grad_(False)
    fresh = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    assert model[0].bias.grad is None
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters()
               if p.requires_grad), "a fresh optimizer's parameters get zero gradients"


@check
def broadcast_object_and_allgather_object():
    root = rt.size() - 1
    expected = {"hello": 123, 0: [1, 2], "f": None}
    got = hvd.broadcast_object(expected if rt.rank() == root else None, root_rank=root)
    assert got == expected, got
    offset = rt.rank()
    if importlib.util.find_spec("cloudpickle") is not None:
        double = hvd.broadcast_object(lambda v: 2 * v + offset, root_rank=0, name="lambda")
        assert double(1) == 2, "the root's function, closure included (cloudpickle)"
    else:  # plain pickle: a local function cannot travel, and every rank is told so
        expect_raises(rt.MismatchError, hvd.broadcast_object, lambda v: 2 * v + offset,
                      root_rank=0, name="lambda", match=["pickle"])
    mine = {"rank": rt.rank()} if rt.rank() != 1 else {"rank": 1, "extra": [42]}
    everyone = hvd.allgather_object(mine)
    expected_all = [{"rank": r} for r in range(rt.size())]
    if rt.size() > 1:
        expected_all[1]["extra"] = [42]
    assert everyone == expected_all, everyone


@check(min_size=2)
def object_collectives_over_a_process_set():
    even = list(range(0, rt.size(), 2))
    odd = list(range(1, rt.size(), 2))
    even_set = hvd.add_process_set(even)
    odd_set = hvd.add_process_set(odd)
    try:
        members, this_set = (even, even_set) if rt.rank() in even else (odd, odd_set)
        got = hvd.broadcast_object(f"from {members[-1]}" if rt.rank() == members[-1] else "",
                                   root_rank=members[-1], process_set=this_set)
        assert got == f"from {members[-1]}", got
        assert hvd.allgather_object(rt.rank(), process_set=this_set) == members
    finally:
        hvd.remove_process_set(odd_set)
        hvd.remove_process_set(even_set)


@check
def unpicklable_objects_fail_on_every_rank():
    import threading

    lock = threading.Lock()
    expect_raises(RuntimeError, hvd.broadcast_object, lock if rt.rank() == 0 else None,
                  root_rank=0, match=["lock"])
    expect_raises(RuntimeError, hvd.allgather_object, lock if rt.rank() == 0 else 1,
                  match=["lock"])


# --------------------------------------------------------------------------- batch norm

@check
def sync_batch_norm_matches_batch_norm_on_the_global_batch():
    cases = [((3, 4), 0.1, torch.nn.BatchNorm1d), ((2, 4, 5), 0.3, torch.nn.BatchNorm1d),
             ((2, 4, 3, 2), None, torch.nn.BatchNorm2d)]
    for shape, momentum, reference_class in cases:
        rows = [shape[0] + r % 2 for r in range(rt.size())]  # uneven local batches
        generator = torch.Generator().manual_seed(5)
        full = torch.randn(sum(rows), *shape[1:], generator=generator, dtype=torch.float64)
        full = full * 3 + 2
        upstream = torch.randn(full.shape, generator=generator, dtype=torch.float64)
        weight, bias = torch.randn(4, generator=generator), torch.randn(4, generator=generator)
        start = sum(rows[:rt.rank()])
        mine = slice(start, start + rows[rt.rank()])

        reference = reference_class(4, momentum=momentum).double()
        synced = hvd.SyncBatchNorm(4, momentum=momentum).double()
        for module in (reference, synced):
            with torch.no_grad():
                module.weight.copy_(weight)
                module.bias.copy_(bias)
        what = f"shape {shape}"
        for step in range(2):
            x_full = full.clone().requires_grad_()
            x_mine = full[mine].clone().requires_grad_()
            expected = reference(x_full)
            output = synced(x_mine)
            expected.backward(upstream)
            output.backward(upstream[mine])
            assert_close(output, expected[mine], f"{what} output", rtol=1e-9, atol=1e-9)
            assert_close(x_mine.grad, x_full.grad[mine], f"{what} input grad", rtol=1e-9,
                         atol=1e-9)
        for name in ("running_mean", "running_var"):
            assert_close(getattr(synced, name), getattr(reference, name), f"{what} {name}",
                         rtol=1e-9, atol=1e-9)
        for name in ("weight", "bias"):
            summed = rt.allreduce(getattr(synced, name).grad.numpy(), op=rt.Sum)
            assert_close(torch.from_numpy(summed), getattr(reference, name).grad,
                         f"{what} {name} grad summed over ranks", rtol=1e-9, atol=1e-9)
        synced.eval()
        reference.eval()
        assert_close(synced(full[mine]), reference(full)[mine], f"{what} eval", rtol=1e-9,
                     atol=1e-9)
    expect_raises(ValueError, hvd.SyncBatchNorm(4), torch.zeros(4), match=["2D"])


@check
def sync_batch_norm_float32_training_matches():
    torch.manual_seed(rt.rank())
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), hvd.SyncBatchNorm(4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                         named_parameters=model.named_parameters())
    model(batch(rt.rank())[0]).pow(2).sum().backward()
    optimizer.step()
    assert_identical_across_ranks(model, "after a step through SyncBatchNorm")


if __name__ == "__main__":
    main()
