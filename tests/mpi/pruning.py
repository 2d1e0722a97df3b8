"""Pruning in data-parallel training, on any number of ranks.

Every method and scope gives bit-identical masks on every rank, equal to a numpy or
``torch.nn.utils.prune`` reference; a rank whose weights differ makes every rank raise a
MismatchError naming the layer, and pruning works again once the weights are equal;
pruned weights and their optimizer state stay exactly zero through SGD with momentum and
weight decay, Adam and AdamW; the schedule's sparsity is reached at its steps.

Run: mpiexec -n K python tests/mpi/pruning.py [--only SUBSTRING]
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils import prune

import ringtrain as rt
from _harness import Digests, check, expect_raises, main, rng
from ringtrain import pruning

METHODS = [(method, scope) for method in pruning.METHODS for scope in pruning.SCOPES]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


def convnet(seed: int = 11, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Sizes that divide by nothing in particular: 5 filters of 3x3x3, 7 and 3 outputs."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 5, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(5 * 4 * 4, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def batch(step: int, rows: int = 6, dtype: torch.dtype = torch.float32, source: int = 0):
    """Rank ``source``'s inputs and targets of ``step``."""
    generator = rng(source, "batch", step)
    inputs = torch.from_numpy(generator.standard_normal((rows, 3, 6, 6))).to(dtype)
    targets = torch.from_numpy(generator.standard_normal((rows, 3))).to(dtype)
    return inputs, targets


def mask_arrays(pruner: pruning.Pruner) -> list[np.ndarray]:
    return [m.detach().to(torch.float32).numpy().astype(bool) for m in pruner.masks().values()]


@check
def masks_are_identical_on_every_rank_for_every_method_and_dtype():
    digests = Digests()
    for dtype in DTYPES:
        for method, scope in METHODS:
            model = convnet(dtype=dtype)
            pruner = pruning.Pruner(model, method=method, scope=scope, group_size=3)
            weights = [w.detach().to(torch.float64).numpy()
                       for w in (model[0].weight_orig, model[3].weight_orig,
                                 model[5].weight_orig)]
            previous = [np.ones(w.shape, bool) for w in weights]
            for sparsity in (0.3, 0.65, 0.9):
                pruner.prune(sparsity)
                expected = pruning.compute_masks(weights, previous, sparsity, method, scope,
                                                 group_size=3)
                for name, got, want in zip(pruner.names, mask_arrays(pruner), expected):
                    assert np.array_equal(got, want), f"{method}/{scope} {dtype} {name}"
                    digests.add(f"{method}/{scope} {dtype} {sparsity} {name}", got)
                previous = expected
                weights = [w * m for w, m in zip(weights, expected)]
    digests.verify()


@check
def per_layer_masks_equal_torch_prune():
    model = convnet()
    reference = convnet()
    pruner = pruning.Pruner(model, method="magnitude", scope="layer")
    pruner.prune(0.6)
    for name, module in (("0", reference[0]), ("3", reference[3]), ("5", reference[5])):
        prune.l1_unstructured(module, "weight", amount=int(round(0.6 * module.weight.numel())))
        assert torch.equal(pruner.masks()[f"{name}.weight"], module.weight_mask), name
    model, reference = convnet(), convnet()
    pruner = pruning.Pruner(model, method="magnitude", scope="global")
    pruner.prune(0.75)
    targets = [(reference[i], "weight") for i in (0, 3, 5)]
    total = sum(module.weight.numel() for module, _ in targets)
    prune.global_unstructured(targets, prune.L1Unstructured, amount=int(round(0.75 * total)))
    for (module, _), mask in zip(targets, pruner.masks().values()):
        assert torch.equal(mask, module.weight_mask)


@check(min_size=2)
def a_rank_with_a_perturbed_weight_fails_the_check_on_every_rank_naming_the_layer():
    model = convnet()
    pruner = pruning.Pruner(model, method="magnitude", scope="layer")
    before = [m.clone() for m in pruner.masks().values()]
    odd = rt.size() - 1
    if rt.rank() == odd:
        with torch.no_grad():  # the smallest weight of the second layer becomes the largest
            weight = model[3].weight_orig.view(-1)
            weight[int(torch.argmin(weight.abs()))] = 10.0
    error = expect_raises(rt.MismatchError, pruner.prune, 0.5,
                          match=["3.weight", f"rank {odd} sent mask", "pruned",
                                 "broadcast_parameters"])
    assert error.tensor_name == "3.weight" and error.collective == "prune"
    assert sorted(error.differences["mask"]) == list(range(rt.size()))
    for old, new in zip(before, pruner.masks().values()):
        assert torch.equal(old, new), "masks changed although the check failed"
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    pruner.prune(0.5)  # usable again once the weights are equal
    digests = Digests()
    for name, mask in zip(pruner.names, mask_arrays(pruner)):
        digests.add(name, mask)
    digests.verify()


def train_and_check_zeros(make_optimizer, dtype: torch.dtype, distributed: bool) -> None:
    model = convnet(dtype=dtype)
    optimizer = make_optimizer(model.parameters())
    if distributed:
        optimizer = rt.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    pruner = pruning.Pruner(model, pruning.GradualSchedule(0.7, 1, 5, frequency=2),
                            optimizer=optimizer)
    for step in range(7):
        # Without a DistributedOptimizer every rank must see the same data to stay equal.
        inputs, targets = batch(step, dtype=dtype, source=rt.rank() if distributed else 0)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        pruner.step()
        for name, (module, mask) in zip(pruner.names, ((model[i], model[i].weight_mask)
                                                        for i in (0, 3, 5))):
            pruned = mask == 0
            assert torch.all(module.weight_orig[pruned] == 0), f"{name} step {step}"
            assert torch.all(module.weight[pruned] == 0), f"{name} step {step}"
            for key, value in optimizer.state[module.weight_orig].items():
                if isinstance(value, torch.Tensor) and value.shape == mask.shape:
                    assert torch.all(value[pruned] == 0), f"{name} {key} step {step}"
    assert pruner.sparsity() > 0.69


@check
def pruned_weights_stay_zero_through_sgd_with_momentum_and_weight_decay():
    for dtype in (torch.float32, torch.float64):
        for distributed in (False, True):
            train_and_check_zeros(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9,
                                                            weight_decay=0.01),
                                  dtype, distributed)


@check
def pruned_weights_stay_zero_through_adam_and_adamw():
    for make in (lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
                 lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)):
        train_and_check_zeros(make, torch.float32, distributed=True)


@check
def the_schedule_sparsity_is_reached_at_its_steps():
    model = convnet()
    schedule = pruning.GradualSchedule(0.9, begin_step=2, end_step=11, frequency=3,
                                       initial_sparsity=0.1)
    pruner = pruning.Pruner(model, schedule)
    total = sum(m.numel() for m in pruner.masks().values())
    for step in range(14):
        pruned = pruner.step()
        assert pruned == (step in (2, 5, 8, 11)), step
        expected = int(round(schedule.sparsity_at(max(s for s in (0, 2, 5, 8, 11) if s <= step))
                             * total)) if step >= 2 else 0
        assert round(pruner.sparsity() * total) == expected, (step, pruner.sparsity())


if __name__ == "__main__":
    main()
