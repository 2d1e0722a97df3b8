"""Pruning in data-parallel training, on any number of ranks.

Every method and scope gives bit-identical masks on every rank, equal to a numpy or
``torch.nn.utils.prune`` reference; a rank whose weights differ makes every rank raise a
MismatchError naming the layer, and pruning works again once the weights are equal;
pruned weights and their optimizer state stay exactly zero through SGD with momentum and
weight decay, Adam and AdamW; the schedule's sparsity is reached at its steps.

With the masks handed to the DistributedOptimizer, its buckets carry only the kept
elements: the reduced values equal a numpy reference for every dtype, the bytes the
reducer counts per step equal the kept elements' bytes, and N ranks training with
pruning end every step with one process's masks and parameters (the gold check).

Run: mpiexec -n K python tests/mpi/pruning.py [--only SUBSTRING]
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import torch
from torch.nn.utils import prune

import ringtrain as rt
from _harness import (REDUCE_DTYPES, WORLD, Digests, assert_reduced, check, expect_raises, main,
                      make_input, reduce_reference, rng)
from ringtrain import elastic, pruning
from ringtrain.trainer import sharded_optimizer
from ringtrain.trainer.sharded_optimizer import TorchShardedOptimizer

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


WRAPPERS = {
    "none": None,
    "distributed": lambda optimizer, model: rt.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters()),
    "sharded stage 1": lambda optimizer, model: rt.ShardedOptimizer(
        optimizer, named_parameters=model.named_parameters(), stage=1, fusion_threshold=300,
        first_bucket_bytes=100),
    "sharded stage 2": lambda optimizer, model: rt.ShardedOptimizer(
        optimizer, named_parameters=model.named_parameters(), stage=2),
    "sharded, master weights": lambda optimizer, model: rt.ShardedOptimizer(
        optimizer, named_parameters=model.named_parameters(), master_weights=True),
}
"""How the torch optimizer is wrapped (None: not at all)."""


def pruned_state(optimizer, parameter: torch.Tensor, mask: torch.Tensor):
    """``(what, values)`` of the pruned elements of ``parameter`` in every tensor where
    ``optimizer`` keeps them on this rank: its state, or the state and float32 copies of
    this rank's pieces for a ShardedOptimizer."""
    pruned = (mask == 0).reshape(-1)
    if isinstance(optimizer, TorchShardedOptimizer):
        for piece, shard in zip(optimizer.pieces, optimizer.shards):
            if optimizer.parameters[piece.parameter] is parameter:
                here = pruned[piece.start:piece.stop]
                yield f"piece {piece.start}:{piece.stop}", shard[here]
                for key, value in optimizer.optimizer.state.get(shard, {}).items():
                    if isinstance(value, torch.Tensor) and value.shape == shard.shape:
                        yield f"{key} of piece {piece.start}:{piece.stop}", value[here]
        return
    for key, value in optimizer.state[parameter].items():
        if isinstance(value, torch.Tensor) and value.shape == mask.shape:
            yield key, value.reshape(-1)[pruned]


def train_and_check_zeros(make_optimizer, dtype: torch.dtype, wrapper: str) -> None:
    model = convnet(dtype=dtype)
    optimizer = make_optimizer(model.parameters())
    wrap = WRAPPERS[wrapper]
    if wrap is not None:
        optimizer = wrap(optimizer, model)
    pruner = pruning.Pruner(model, pruning.GradualSchedule(0.7, 1, 5, frequency=2),
                            optimizer=optimizer)
    for step in range(7):
        # Without a wrapper every rank must see the same data to stay equal.
        inputs, targets = batch(step, dtype=dtype, source=0 if wrap is None else rt.rank())
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        pruner.step()
        for name, (module, mask) in zip(pruner.names, ((model[i], model[i].weight_mask)
                                                        for i in (0, 3, 5))):
            what = f"{wrapper} {dtype} {name} step {step}"
            pruned = mask == 0
            assert torch.all(module.weight_orig[pruned] == 0), what
            assert torch.all(module.weight[pruned] == 0), what
            for key, values in pruned_state(optimizer, module.weight_orig, mask):
                assert torch.all(values == 0), f"{what}: {key}"
    assert pruner.sparsity() > 0.69


@check
def pruned_weights_stay_zero_through_sgd_with_momentum_and_weight_decay():
    for dtype in (torch.float32, torch.float64):
        for wrapper in ("none", "distributed", "sharded stage 1", "sharded stage 2"):
            train_and_check_zeros(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9,
                                                            weight_decay=0.01),
                                  dtype, wrapper)


@check
def pruned_weights_stay_zero_through_adam_and_adamw():
    for make in (lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
                 lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)):
        for wrapper in ("distributed", "sharded stage 1", "sharded stage 2"):
            train_and_check_zeros(make, torch.float32, wrapper)
    train_and_check_zeros(lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
                          torch.bfloat16, "sharded, master weights")


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


# --------------------------------------------------------------------------- buckets

GRADIENT_SHAPES = [(7, 5), (13,), (3, 4, 3), (1,), (2, 9)]


def random_mask(shape, key) -> np.ndarray:
    """The same on every rank (rank 0's generator)."""
    return rng(0, "mask", shape, key).uniform(size=shape) < 0.6


@check
def masked_buckets_reduce_the_kept_elements_of_every_dtype():
    for dtype in REDUCE_DTYPES:
        op = rt.Average if dtype.kind == "f" else rt.Sum
        for fusion in (dict(fusion_threshold=200, first_bucket_bytes=64),
                       dict(fusion_threshold=0)):
            gradients = [make_input(rt.rank(), shape, dtype, op, "grad", i)
                         for i, shape in enumerate(GRADIENT_SHAPES)]
            reducer = rt.GradientReducer([(f"g{i}", g) for i, g in enumerate(gradients)],
                                         op=op, **fusion)
            masks = [random_mask(shape, i) if i % 2 == 0 else None
                     for i, shape in enumerate(GRADIENT_SHAPES)]
            reducer.set_masks(masks)
            for i, gradient in enumerate(gradients):
                reducer.mark_ready(i, gradient)
            reducer.wait()
            for i, (shape, gradient, mask) in enumerate(zip(GRADIENT_SHAPES, gradients, masks)):
                inputs = [make_input(r, shape, dtype, op, "grad", i) for r in range(rt.size())]
                expected = reduce_reference(inputs, op)
                if mask is not None:
                    expected = np.where(mask, expected, 0).astype(expected.dtype)
                assert_reduced(gradient, expected, dtype, f"{dtype} {fusion} g{i}")
            kept = sum(int(m.sum()) if m is not None else int(np.prod(s))
                       for s, m in zip(GRADIENT_SHAPES, masks))
            if fusion["fusion_threshold"] == 0:
                assert reducer.last_step_bytes == kept * dtype.itemsize


class PlainSGD:
    """An optimizer over arrays: parameter -= lr * gradient."""

    def __init__(self, pairs, lr: float = 0.5):
        self.pairs, self.lr = pairs, lr

    def step(self) -> None:
        for parameter, gradient in self.pairs:
            parameter -= self.lr * gradient


@check
def the_numpy_optimizer_protocol_takes_masks():
    parameters = [np.zeros(shape, np.float64) for shape in GRADIENT_SHAPES]
    gradients = [np.empty(shape, np.float64) for shape in GRADIENT_SHAPES]
    optimizer = rt.DistributedOptimizer(
        PlainSGD(list(zip(parameters, gradients))),
        named_parameters=[(f"w{i}", p, g) for i, (p, g) in enumerate(zip(parameters,
                                                                          gradients))])
    masks = {f"w{i}": random_mask(shape, i) for i, shape in enumerate(GRADIENT_SHAPES)
             if i != 1}
    optimizer.set_gradient_masks(masks)
    for i, (shape, gradient) in enumerate(zip(GRADIENT_SHAPES, gradients)):
        gradient[...] = make_input(rt.rank(), shape, np.float64, rt.Average, "numpy", i)
    optimizer.step()
    kept = 0
    for i, (shape, parameter) in enumerate(zip(GRADIENT_SHAPES, parameters)):
        inputs = [make_input(r, shape, np.float64, rt.Average, "numpy", i)
                  for r in range(rt.size())]
        mask = masks.get(f"w{i}", np.ones(shape, bool))
        expected = -0.5 * np.where(mask, reduce_reference(inputs, rt.Average), 0.0)
        assert_reduced(parameter, expected, np.float64, f"w{i}")
        kept += int(mask.sum())
    assert optimizer.reducer.last_step_bytes == kept * 8


@check(min_size=2)
def masks_that_differ_across_ranks_fail_the_bucket_on_every_rank_without_a_hang():
    gradients = [make_input(rt.rank(), shape, np.float32, rt.Average, "differ", i)
                 for i, shape in enumerate(GRADIENT_SHAPES)]
    reducer = rt.GradientReducer([(f"g{i}", g) for i, g in enumerate(gradients)],
                                 fusion_threshold=0)
    for swap in (False, True):  # a swap keeps as many elements
        masks = [random_mask(shape, i) for i, shape in enumerate(GRADIENT_SHAPES)]
        if rt.rank() == rt.size() - 1:
            masks[0] = flat = masks[0].copy().reshape(-1)
            flat[0] = not flat[0]
            if swap:
                other = int(np.flatnonzero(flat == flat[0])[1])
                flat[other] = not flat[other]
            assert swap == (flat.sum() == random_mask(GRADIENT_SHAPES[0], 0).sum())
            masks[0] = flat.reshape(GRADIENT_SHAPES[0])
        reducer.set_masks(masks)
        for i, gradient in enumerate(gradients):
            reducer.mark_ready(i, gradient)
        expect_raises(rt.MismatchError, reducer.wait,
                      match=["[g0]", f"rank {rt.size() - 1} sent"])
        reducer.set_masks([None] * len(gradients))  # usable again once the masks agree
        for i, gradient in enumerate(gradients):
            reducer.mark_ready(i, gradient)
        reducer.wait()


@check
def sharded_buckets_carry_only_the_kept_elements_both_ways():
    """The ShardedOptimizer's reduce-scatters get the kept gradients alone, its
    allgathers every rank's kept parameters alone; pieces get zero gradients at pruned
    elements, and the parameters match a DistributedOptimizer pruning alike."""
    handed: dict[str, list[int]] = {"reducescatter": [], "allgather": []}
    originals = {name: getattr(sharded_optimizer, f"{name}_async") for name in handed}

    def recording(name):
        def call(tensor, *args, **kwargs):
            handed[name].append(tensor.numel())
            return originals[name](tensor, *args, **kwargs)
        return call

    for name in handed:
        setattr(sharded_optimizer, f"{name}_async", recording(name))
    try:
        for stage, fusion, compression, wire in (
                (1, dict(fusion_threshold=300, first_bucket_bytes=100), rt.Compression.none, 4),
                (2, dict(fusion_threshold=0), rt.Compression.none, 4),
                (1, dict(fusion_threshold=1 << 20), rt.Compression.fp16, 2)):
            model, reference = convnet(), convnet()
            optimizer = rt.ShardedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                named_parameters=model.named_parameters(), stage=stage,
                compression=compression, **fusion)
            distributed = rt.DistributedOptimizer(
                torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9),
                named_parameters=reference.named_parameters(), compression=compression)
            pruner = pruning.Pruner(model, optimizer=optimizer)
            reference_pruner = pruning.Pruner(reference, optimizer=distributed)
            everything = sum(p.numel() for p in model.parameters())
            for step, sparsity in enumerate((0.0, 0.5, 0.8, 0.95)):
                what = f"stage {stage} {fusion} {compression.name} sparsity {sparsity}"
                if sparsity:
                    pruner.prune(sparsity)
                    reference_pruner.prune(sparsity)
                kept = everything - sum(int((m == 0).sum()) for m in pruner.masks().values())
                for record in handed.values():
                    record.clear()
                model_gradients_step(model, optimizer, step)
                model_gradients_step(reference, distributed, step)
                assert sum(handed["reducescatter"]) == kept, (what, handed, kept)
                assert sum(WORLD.allgather(sum(handed["allgather"]))) == kept, (what, kept)
                assert optimizer.bytes_per_step == kept * wire, (what, kept)
                for piece, shard in zip(optimizer.pieces, optimizer.shards):
                    parameter = optimizer.parameters[piece.parameter]
                    for module in model:
                        if getattr(module, "weight_orig", None) is parameter:
                            pruned = (module.weight_mask == 0).reshape(-1)
                            assert torch.all(shard.grad[pruned[piece.start:piece.stop]] == 0), \
                                what
                tolerance = 1e-2 if compression is rt.Compression.fp16 else 1e-5
                for name, value in model.state_dict().items():
                    difference = float((value - reference.state_dict()[name]).abs().max())
                    assert difference <= tolerance, f"{what} {name}: {difference}"
    finally:
        for name, original in originals.items():
            setattr(sharded_optimizer, f"{name}_async", original)
    expect_raises(rt.InvalidArgumentError, optimizer.mask_elements, torch.zeros(3),
                  torch.ones(3), match=[f"rank {rt.rank()}", "mask_elements", "(3,)"])
    inputs, targets = batch(9, source=rt.rank())
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    expect_raises(rt.UsageError, optimizer.set_gradient_masks, [], match=[
        f"rank {rt.rank()}", "set_gradient_masks() was called while gradients are being"])
    optimizer.step()


@check(min_size=2)
def sharded_masks_that_differ_across_ranks_fail_on_every_rank_without_a_hang():
    for swap in (False, True):  # a swap keeps as many elements in every chunk
        model = convnet()
        optimizer = rt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                        named_parameters=model.named_parameters(),
                                        fusion_threshold=0)
        weight = model[3].weight
        mask = torch.ones_like(weight)
        mask.view(-1)[:weight.numel() // 2:2] = 0
        if rt.rank() == rt.size() - 1:
            mask.view(-1)[0] = 1
            if swap:  # elements 0 and 1 lie in rank 0's chunk at every size tested
                mask.view(-1)[1] = 0
        optimizer.set_gradient_masks([(weight, mask)])
        expect_raises(rt.MismatchError, model_gradients_step, model, optimizer, 0,
                      match=["3.weight", f"rank {rt.size() - 1} sent"])
        optimizer.set_gradient_masks([(weight, None)])  # usable again once they agree
        model_gradients_step(model, optimizer, 1)


def model_gradients_step(model, optimizer, step: int) -> None:
    inputs, targets = batch(step, source=rt.rank())
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()


@check
def bytes_on_the_wire_per_step_equal_the_kept_elements_bytes():
    for biases, fusion, compression, wire in (
            (False, dict(fusion_threshold=0), rt.Compression.none, 4),
            (True, dict(fusion_threshold=256, first_bucket_bytes=128), rt.Compression.none, 4),
            (True, dict(fusion_threshold=1 << 20), rt.Compression.fp16, 2)):
        model = convnet()
        optimizer = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(), compression=compression, **fusion)
        targets = [(m, name) for m in model.modules() if isinstance(m, pruning.PRUNABLE_LAYERS)
                   for name in (("weight", "bias") if biases else ("weight",))]
        pruner = pruning.Pruner(model, parameters=targets, optimizer=optimizer)
        everything = sum(p.numel() for p in model.parameters())
        model_gradients_step(model, optimizer, 0)
        if not biases:  # alone and dense: no padding in any bucket
            assert optimizer.reducer.last_step_bytes == everything * wire
        previous = None
        for step, sparsity in enumerate((0.5, 0.8, 0.95), start=1):
            pruner.prune(sparsity)
            model_gradients_step(model, optimizer, step)
            pruned = sum(int((m == 0).sum()) for m in pruner.masks().values())
            sent = optimizer.reducer.last_step_bytes
            assert sent == (everything - pruned) * wire == optimizer.reducer.bytes_per_step, \
                (biases, fusion, sparsity, sent, everything - pruned)
            assert previous is None or sent < previous
            previous = sent


def gold_tolerance(dtype: torch.dtype) -> float:
    """How far N ranks' parameters may be from one process's.

    Both average the same per-sample gradients; only the order of the additions differs
    (N partial means summed across ranks against one mean over the global batch), a few
    units in the last place of each averaged gradient. The parameters stay below 1 in
    magnitude and move by lr times that error per step, with momentum adding up to
    1/(1 - 0.9) = 10 times; over 6 steps that is far below 1e-5 in float32 (ulp 6e-8)
    and 1e-12 in float64.
    """
    return 1e-5 if dtype == torch.float32 else 1e-12


GOLD_BATCH = 24  # divides by 1, 2, 3 and 4 ranks
GOLD_OPTIMIZERS = [(None, dict(fusion_threshold=400, first_bucket_bytes=100)),
                   (None, dict(fusion_threshold=0)),
                   (1, dict(fusion_threshold=400, first_bucket_bytes=100)),
                   (2, dict(fusion_threshold=0))]
"""The DistributedOptimizer (stage None) and the ShardedOptimizer's stages, with buckets."""


@check
def n_ranks_with_pruning_equal_one_process_on_the_global_batch():
    digests = Digests()
    for dtype in (torch.float32, torch.float64):
        for method in ("magnitude", "structured"):
            for stage, fusion in GOLD_OPTIMIZERS:
                model, reference = convnet(dtype=dtype), convnet(dtype=dtype)
                make = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9,  # noqa: E731
                                                 weight_decay=0.01)
                if stage is None:
                    optimizer = rt.DistributedOptimizer(
                        make(model.parameters()), named_parameters=model.named_parameters(),
                        **fusion)
                else:
                    optimizer = rt.ShardedOptimizer(
                        make(model.parameters()), named_parameters=model.named_parameters(),
                        stage=stage, **fusion)
                single = make(reference.parameters())
                schedule = pruning.GradualSchedule(0.8, begin_step=0, end_step=4, frequency=2)
                pruner = pruning.Pruner(model, schedule, method, optimizer=optimizer)
                reference_pruner = pruning.Pruner(reference, schedule, method, optimizer=single)
                share = GOLD_BATCH // rt.size()
                for step in range(6):
                    inputs, targets = batch(step, rows=GOLD_BATCH, dtype=dtype)
                    mine = slice(rt.rank() * share, (rt.rank() + 1) * share)
                    for net, opt, rows in ((model, optimizer, mine),
                                           (reference, single, slice(None))):
                        opt.zero_grad()
                        torch.nn.functional.mse_loss(net(inputs[rows]), targets[rows]).backward()
                        opt.step()
                    pruner.step()
                    reference_pruner.step()
                    what = f"{dtype} {method} stage {stage} {fusion} step {step}"
                    for name, mask in pruner.masks().items():
                        assert torch.equal(mask, reference_pruner.masks()[name]), f"{what} {name}"
                    state, expected = model.state_dict(), reference.state_dict()
                    for name, value in state.items():
                        difference = float((value - expected[name]).abs().max())
                        assert difference <= gold_tolerance(dtype), f"{what} {name}: {difference}"
                        digests.add(f"{what} {name}", value.numpy())
                assert pruner.sparsity() > (0.79 if method == "magnitude" else 0.5)
    digests.verify()


# --------------------------------------------------------------------------- state

def pruned_on_root_only():
    """Rank 0's model with masks of about 70% sparsity; the others fresh, from other seeds.
    Every rank wraps its model in a DistributedOptimizer and a Pruner."""
    model = convnet(seed=11 if rt.rank() == 0 else 20 + rt.rank())
    optimizer = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        fusion_threshold=300, first_bucket_bytes=100)
    pruner = pruning.Pruner(model, optimizer=optimizer)
    if rt.rank() == 0:  # as if loaded from rank 0's checkpoint
        for name, mask in pruner.masks().items():
            mask.copy_(torch.from_numpy(rng(0, "root mask", name).uniform(size=mask.shape) > 0.7))
        pruner.refresh()
        pruner.step_count = 9
    return model, optimizer, pruner


def check_same_as_root(model, optimizer, pruner, what: str) -> None:
    """Masks, weights and step count as rank 0's; buckets sized to the kept elements."""
    digests = Digests()
    for name, value in model.state_dict().items():
        digests.add(f"{what} {name}", value.numpy())
    digests.verify()
    assert 0.6 < pruner.sparsity() < 0.8 and pruner.step_count == 9, what
    kept = sum(p.numel() for p in model.parameters()) - \
        sum(int((m == 0).sum()) for m in pruner.masks().values())
    assert optimizer.reducer.bytes_per_step == kept * 4, what
    model_gradients_step(model, optimizer, 0)
    assert optimizer.reducer.last_step_bytes == kept * 4, what
    digests = Digests()
    for name, value in model.state_dict().items():
        digests.add(f"{what} after a step {name}", value.numpy())
    digests.verify()


@check
def broadcast_parameters_carries_the_masks_and_broadcast_the_step_count():
    model, optimizer, pruner = pruned_on_root_only()
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    pruner.refresh()
    pruner.step_count = rt.broadcast_object(pruner.step_count, 0)
    check_same_as_root(model, optimizer, pruner, "broadcast_parameters")
    model, optimizer, pruner = pruned_on_root_only()
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    pruner.broadcast(root_rank=0)
    check_same_as_root(model, optimizer, pruner, "Pruner.broadcast")


@check
def an_elastic_state_restores_the_masks_into_fresh_models():
    directory = rt.broadcast_object(tempfile.mkdtemp() if rt.rank() == 0 else None, 0)
    model, optimizer, pruner = pruned_on_root_only()
    rt.broadcast_parameters(model.state_dict(), root_rank=0)
    pruner.broadcast(root_rank=0)
    state = elastic.State(directory=directory, model=model, optimizer=optimizer,
                          pruner=pruner, epoch=2)
    state.commit()
    state.flush()
    model = convnet(seed=40 + rt.rank())  # fresh on every rank, then restored
    optimizer = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        fusion_threshold=300, first_bucket_bytes=100)
    pruner = pruning.Pruner(model, optimizer=optimizer)
    restored = elastic.State(directory=directory, model=model, optimizer=optimizer,
                             pruner=pruner, epoch=0)
    assert restored.restore() and restored.epoch == 2
    check_same_as_root(model, optimizer, pruner, "elastic")
    if rt.rank() == 0:
        shutil.rmtree(directory)


if __name__ == "__main__":
    main()
