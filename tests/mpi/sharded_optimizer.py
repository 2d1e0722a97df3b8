"""ShardedOptimizer (ZeRO stage 1 and 2) on any number of ranks.

Gold checks: N ranks with the sharded optimizer end every step with the parameters of N
ranks with the plain DistributedOptimizer and of one process training on the global
batch. Tolerances:

- against the DistributedOptimizer: both average the same per-rank gradients, the
  sharded one by reduce-scatter (ring), the plain one by allreduce (recursive doubling
  for these small buckets), and the optimizer's elementwise update is the same code on
  the same values. With N <= 2 the average is one addition (commutative) and one
  division: the results are bit-identical, and the check asserts equality. With N > 2
  the additions are associated differently: each averaged gradient differs by at most
  (N-1)·2⁻²⁴ of the sum of magnitudes, which SGD carries into the update times lr·2
  (momentum 0.5) and Adam's scale-free update m/√v turns into a relative change of the
  same order; over STEPS steps and with parameters near 1 that stays below 2e-6 (about
  30 ulps); measured at N = 3, 4: up to 3e-8.
- against one process: the global batch's mean is summed in another order too (the
  bound of trainer_gold.py: a few ulps per step), and Adam divides by √v + eps, which
  amplifies relative gradient differences where |g| is tiny; 2e-5 covers it over STEPS
  steps (measured: up to 3e-8).

The model has 5 tensors of mixed shapes (2-D, 1-D and 3-D), 113 elements (not a
multiple of 2, 3 or 4), in several buckets, so parameters span ranks.

Run: mpiexec -n K python tests/mpi/sharded_optimizer.py [--only SUBSTRING]
Set RINGTRAIN_SHARDED_CHECKPOINT=DIR to save a consolidated checkpoint there (when none
is there) or, when one saved with another number of ranks is there, to load it and check
that training continues as if uninterrupted.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import tempfile

import numpy as np
import torch

import ringtrain as rt
from ringtrain import elastic
from _harness import Digests, check, expect_raises, main, rng

GLOBAL_BATCH = 24
STEPS = 4
BUCKETS = dict(fusion_threshold=160, first_bucket_bytes=64)
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.5),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1),
}
AGAINST_PLAIN = 2e-6
AGAINST_ONE_PROCESS = 2e-5


class Net(torch.nn.Module):
    """5 -> 9 -> 5 with a 3-D scale tensor, and optionally a parameter never used."""

    def __init__(self, unused: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(11)
        self.fc1 = torch.nn.Linear(5, 9)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(1, 3, 3))
        self.fc2 = torch.nn.Linear(9, 5)
        if unused:
            self.unused = torch.nn.Parameter(torch.randn(7))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(x))
        hidden = hidden * self.scale.reshape(-1)
        return self.fc2(hidden)


def global_data(step: int, dtype: torch.dtype = torch.float32):
    generator = rng(0, "sharded data", step)
    inputs = generator.standard_normal((GLOBAL_BATCH, 5)).astype(np.float32)
    targets = generator.standard_normal((GLOBAL_BATCH, 5)).astype(np.float32)
    return torch.from_numpy(inputs).to(dtype), torch.from_numpy(targets).to(dtype)


def my_shard(tensor: torch.Tensor) -> torch.Tensor:
    share = len(tensor) // rt.size()
    return tensor[rt.rank() * share:(rt.rank() + 1) * share]


def train_step(model, optimizer, inputs, targets, passes: int = 1, clip: float | None = None):
    optimizer.zero_grad()
    for x, y in zip(inputs.chunk(passes), targets.chunk(passes)):
        loss = torch.nn.functional.mse_loss(model(x), y) / passes
        loss.backward()
    if clip is None:
        optimizer.step()
        return None
    if hasattr(optimizer, "clip_grad_norm_"):
        norm = optimizer.clip_grad_norm_(clip)
        optimizer.step()
        return float(norm)
    if isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(optimizer.master_parameters(), clip)
        with optimizer.skip_synchronize():
            optimizer.step()
        return float(norm)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return float(norm)


def max_difference(a: torch.nn.Module, b: torch.nn.Module) -> tuple[float, str]:
    worst, where = 0.0, ""
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        error = float((x.detach().double() - y.detach().double()).abs().max())
        if error > worst:
            worst, where = error, name
    return worst, where


def sharded(model, kind: str, stage: int, **options):
    return rt.ShardedOptimizer(OPTIMIZERS[kind](model.parameters()),
                               named_parameters=model.named_parameters(), stage=stage,
                               **BUCKETS, **options)


def plain(model, kind: str, **options):
    return rt.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()),
                                   named_parameters=model.named_parameters(), **BUCKETS,
                                   **options)


def gold(kind: str, stage: int, passes: int = 1, clip: float | None = None) -> None:
    single = Net()
    single_optimizer = OPTIMIZERS[kind](single.parameters())
    reference, model = Net(), Net()
    reference_optimizer = plain(reference, kind, backward_passes_per_step=passes)
    optimizer = sharded(model, kind, stage, backward_passes_per_step=passes)
    assert len(optimizer.partition.buckets) >= 3, optimizer.partition
    digests = Digests()
    for step in range(STEPS):
        inputs, targets = global_data(step)
        train_step(single, single_optimizer, inputs, targets, passes, clip)
        norm_plain = train_step(reference, reference_optimizer, my_shard(inputs),
                                my_shard(targets), passes, clip)
        norm = train_step(model, optimizer, my_shard(inputs), my_shard(targets), passes, clip)
        if clip is not None:
            assert math.isclose(norm, norm_plain, rel_tol=1e-5), (step, norm, norm_plain)
        error, where = max_difference(model, reference)
        if rt.size() <= 2 and clip is None:
            assert error == 0.0, f"step {step} {where}: differs from DistributedOptimizer " \
                                 f"by {error:.3g} (expected bit-identical)"
        assert error <= AGAINST_PLAIN, f"step {step} {where}: {error:.3g} from plain"
        error, where = max_difference(model, single)
        assert error <= AGAINST_ONE_PROCESS, f"step {step} {where}: {error:.3g} from one process"
        for name, parameter in model.named_parameters():
            digests.add(f"step {step} {name}", parameter.detach().numpy())
    digests.verify()


for _kind in OPTIMIZERS:
    for _stage in (1, 2):
        check(lambda k=_kind, s=_stage: gold(k, s), name=f"gold_{_kind}_stage{_stage}")
check(lambda: gold("adam", 2, passes=2), name="gold_adam_stage2_two_backward_passes")
check(lambda: gold("sgd", 1, passes=2), name="gold_sgd_stage1_two_backward_passes")
check(lambda: gold("adamw", 2, clip=0.05), name="gold_adamw_stage2_clip_grad_norm")
check(lambda: gold("sgd", 1, clip=0.05), name="gold_sgd_stage1_clip_grad_norm")


@check
def compressed_reduce_scatter() -> None:
    """compression=fp16/bf16 gives the DistributedOptimizer's parameters with the same
    compression: both encode the same buckets with the same scale (the range agreed over
    all ranks) and decode the 16-bit sums. At N <= 2 a sum is one rounded addition and the
    results are bit-identical; at N > 2 the ring and the allreduce round partial sums in
    another order, a few 16-bit ulps of the gradients (2^-11 relative for float16, 2^-8 for
    bfloat16) carried into the update times lr·2 (momentum 0.5) per step, or for Adam into
    m/√v's relative change of the same order times lr: 8·ulp·lr per step bounds it
    (measured at N = 3, 4 over 4 steps: up to 3.4e-5 for float16, 3.4e-4 for bfloat16)."""
    for compression, ulp in ((rt.Compression.fp16, 2.0 ** -11), (rt.Compression.bf16, 2.0 ** -8)):
        for kind, stage, lr in (("sgd", 1, 0.1), ("adam", 2, 0.01)):
            reference, model = Net(), Net()
            reference_optimizer = plain(reference, kind, compression=compression)
            optimizer = sharded(model, kind, stage, compression=compression)
            for step in range(STEPS):
                inputs, targets = global_data(step)
                train_step(reference, reference_optimizer, my_shard(inputs), my_shard(targets))
                train_step(model, optimizer, my_shard(inputs), my_shard(targets))
                error, where = max_difference(model, reference)
                bound = 0.0 if rt.size() <= 2 else 8 * ulp * lr * (step + 1)
                assert error <= bound, \
                    f"{compression.name} {kind} step {step} {where}: {error:.3g} from plain"


@check
def stage2_frees_full_gradients() -> None:
    for stage in (1, 2):
        model = Net()
        optimizer = sharded(model, "adam", stage)
        inputs, targets = global_data(0)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(my_shard(inputs)), my_shard(targets)).backward()
        kept = [name for name, p in model.named_parameters() if p.grad is not None]
        if stage == 2:
            assert kept == [], f"stage 2 kept full gradients of {kept}"
        else:
            assert len(kept) == 5, kept
        optimizer.synchronize()
        owned = sum(s.grad.numel() for s in optimizer.shards)
        assert owned == optimizer.partition.elements(rt.rank()), owned
        optimizer.step()


@check
def unused_parameter_and_reduced_precision() -> None:
    """An unused parameter steps with zero gradients, as in the DistributedOptimizer;
    float16 and bfloat16 models give the DistributedOptimizer's parameters within the
    16-bit formats' rounding: the two average in differently ordered or rounded steps (the
    allreduce of a fused bucket and the ring reduce-scatter round the sum and the quotient
    differently), each a few ulps of the gradient, times lr·2 (momentum) per step: 8 ulps
    of a parameter near 1 per step bounds it. float32 at N <= 2 is bit-identical."""
    for dtype, ulp in ((torch.float32, 2.0 ** -23), (torch.float16, 2.0 ** -10),
                       (torch.bfloat16, 2.0 ** -7)):
        for stage in (1, 2):
            reference, model = Net(unused=True, dtype=dtype), Net(unused=True, dtype=dtype)
            reference_optimizer = plain(reference, "sgd")
            optimizer = sharded(model, "sgd", stage)
            for step in range(STEPS):
                inputs, targets = global_data(step, dtype)
                train_step(reference, reference_optimizer, my_shard(inputs), my_shard(targets))
                train_step(model, optimizer, my_shard(inputs), my_shard(targets))
                error, where = max_difference(model, reference)
                exact = rt.size() <= 2 and dtype == torch.float32
                bound = 0.0 if exact else 4 * ulp * 2 * (step + 1)
                assert error <= bound, f"{dtype} stage {stage} step {step} {where}: {error:.3g}"


def trained_with_masters(model, kind: str, stage: int, steps: int, start: int = 0,
                         optimizer=None, dtype=torch.bfloat16):
    optimizer = optimizer or sharded(model, kind, stage, master_weights=True)
    for step in range(start, steps):
        inputs, targets = global_data(step, dtype)
        train_step(model, optimizer, my_shard(inputs), my_shard(targets))
    return optimizer


def full_masters(optimizer) -> dict[int, torch.Tensor]:
    """Every rank's copy of the consolidated float32 master weights, by position."""
    state = optimizer.state_dict(consolidate=True)
    return rt.broadcast_object(state, root_rank=0, name="consolidated state")


@check
def master_weights_match_the_distributed_optimizer() -> None:
    """With master_weights=True the sharded optimizer steps float32 copies of its pieces
    only, and gives the DistributedOptimizer's float32 copies (master_weights=True) within
    the bound of unused_parameter_and_reduced_precision scaled by the learning rate: the
    averaged 16-bit gradients the two upcast differ by a few 16-bit ulps (differently
    rounded reductions), which each step carries into the copies times lr·2 (momentum
    0.5) or, for Adam, into a relative change of m/√v of the same order (lr 0.01);
    measured at N = 3, 4: up to 3e-5 (float16) and 2.2e-4 (bfloat16). At N <= 2 the
    averages are one addition and one division, and the copies are bit-identical. The
    model's parameters are exactly the rounded copies."""
    for dtype, ulp in ((torch.float16, 2.0 ** -10), (torch.bfloat16, 2.0 ** -7)):
        for kind, stage, lr in (("sgd", 1, 0.1), ("adam", 2, 0.01)):
            reference, model = Net(unused=True, dtype=dtype), Net(unused=True, dtype=dtype)
            reference_optimizer = plain(reference, kind, master_weights=True)
            optimizer = sharded(model, kind, stage, master_weights=True)
            for step in range(STEPS):
                inputs, targets = global_data(step, dtype)
                train_step(reference, reference_optimizer, my_shard(inputs), my_shard(targets))
                train_step(model, optimizer, my_shard(inputs), my_shard(targets))
            owned = [s for s in optimizer.shards if s.dtype == torch.float32]
            assert sum(s.numel() for s in owned) == optimizer.partition.elements(rt.rank())
            assert optimizer.state_elements() == \
                (2 if kind == "adam" else 1) * optimizer.partition.elements(rt.rank())
            saved = full_masters(optimizer)["master_weights"]
            expected = reference_optimizer.state_dict()["master_weights"]
            assert sorted(saved) == sorted(expected) == list(range(6)), sorted(saved)
            parameters = list(model.parameters())
            bound = 4 * ulp * 2 * lr * STEPS
            for position, copy_ in saved.items():
                assert copy_.dtype == torch.float32, copy_.dtype
                assert torch.equal(copy_.to(dtype), parameters[position].detach()), position
                error = float((copy_ - expected[position]).abs().max())
                assert error <= (bound if rt.size() > 2 else 0.0), \
                    f"{dtype} {kind} parameter {position}: {error:.3g} from plain"


@check
def master_weights_checkpoints() -> None:
    """A state saved with master weights (consolidated or shard) continues exactly as an
    uninterrupted run: the float32 copies are restored, not taken from the rounded model;
    the consolidated form also loads into a DistributedOptimizer with master weights."""
    for form in ("consolidated", "shard"):
        uninterrupted = Net(dtype=torch.bfloat16)
        trained_with_masters(uninterrupted, "adam", 1, STEPS)
        model = Net(dtype=torch.bfloat16)
        optimizer = trained_with_masters(model, "adam", 1, 2)
        saved = full_masters(optimizer) if form == "consolidated" else \
            copy.deepcopy(optimizer.state_dict())
        resumed = copy.deepcopy(model)
        resumed_optimizer = sharded(resumed, "adam", 1, master_weights=True)
        resumed_optimizer.load_state_dict(pickle.loads(pickle.dumps(saved)))
        trained_with_masters(resumed, "adam", 1, STEPS, start=2, optimizer=resumed_optimizer)
        error, where = max_difference(resumed, uninterrupted)
        assert error == 0.0, f"{form}: {where} differs by {error:.3g} after resuming"
    consolidated = full_masters(optimizer)
    plain_optimizer = plain(copy.deepcopy(model), "adam", master_weights=True)
    plain_optimizer.load_state_dict(copy.deepcopy(consolidated))
    loaded = plain_optimizer.state_dict()["master_weights"]
    for position, value in consolidated["master_weights"].items():
        assert torch.equal(loaded[position], value), position


@check
def state_memory_is_a_shard() -> None:
    model = Net()
    optimizer = sharded(model, "adam", 1)
    inputs, targets = global_data(0)
    train_step(model, optimizer, my_shard(inputs), my_shard(targets))
    total = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    for key in ("exp_avg", "exp_avg_sq"):
        held = sum(optimizer.state[s][key].numel() for s in optimizer.shards)
        assert held <= math.ceil(total / rt.size()) + largest, (key, held, total)
        everyone = rt.allgather(np.array([held]), name=f"state {key}")
        assert int(everyone.sum()) == total, (key, everyone, total)
    assert optimizer.state_elements() == 2 * optimizer.partition.elements(rt.rank())


@check
def lr_scheduler_and_param_groups() -> None:
    def build(model):
        return torch.optim.SGD([{"params": [model.fc1.weight, model.fc1.bias], "lr": 0.05},
                                {"params": [model.scale, model.fc2.weight, model.fc2.bias]}],
                               lr=0.1, momentum=0.9)

    reference, model = Net(), Net()
    reference_optimizer = rt.DistributedOptimizer(
        build(reference), named_parameters=reference.named_parameters(), **BUCKETS)
    optimizer = rt.ShardedOptimizer(build(model), model.named_parameters(), stage=2,
                                    **BUCKETS)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                  for o in (reference_optimizer, optimizer)]
    for step in range(STEPS):
        inputs, targets = global_data(step)
        train_step(reference, reference_optimizer, my_shard(inputs), my_shard(targets))
        train_step(model, optimizer, my_shard(inputs), my_shard(targets))
        for scheduler in schedulers:
            scheduler.step()
        error, where = max_difference(model, reference)
        assert error <= AGAINST_PLAIN, f"step {step} {where}: {error:.3g}"
    assert [g["lr"] for g in optimizer.param_groups] == [0.05 / 16, 0.1 / 16]


def continue_and_compare(model, optimizer, start: int, reference_steps: int, kind: str) -> None:
    """Train ``model`` from step ``start`` to STEPS and compare with one process trained
    uninterrupted for all STEPS."""
    single = Net()
    single_optimizer = OPTIMIZERS[kind](single.parameters())
    for step in range(reference_steps):
        inputs, targets = global_data(step)
        train_step(single, single_optimizer, inputs, targets)
    for step in range(start, reference_steps):
        inputs, targets = global_data(step)
        if hasattr(optimizer, "shards"):
            train_step(model, optimizer, my_shard(inputs), my_shard(targets))
        else:
            train_step(model, optimizer, inputs, targets)
    error, where = max_difference(model, single)
    assert error <= AGAINST_ONE_PROCESS, f"{where}: {error:.3g} from an uninterrupted run"


def trained(kind: str, stage: int, steps: int):
    model = Net()
    optimizer = sharded(model, kind, stage)
    for step in range(steps):
        inputs, targets = global_data(step)
        train_step(model, optimizer, my_shard(inputs), my_shard(targets))
    return model, optimizer


@check
def consolidated_state_loads_everywhere() -> None:
    for kind in ("adam", "sgd"):
        model, optimizer = trained(kind, 2, 2)
        full = optimizer.state_dict(consolidate=True, to_rank=rt.size() - 1)
        assert (full is None) == (rt.rank() != rt.size() - 1)
        full = rt.broadcast_object(full, root_rank=rt.size() - 1, name="consolidated")
        assert len(full["state"]) == 5, full["state"].keys()
        # into a plain torch optimizer of the same parameters
        plain_model = copy.deepcopy(model)
        plain_optimizer = OPTIMIZERS[kind](plain_model.parameters())
        plain_optimizer.load_state_dict(copy.deepcopy(full))  # it adopts the tensors
        continue_and_compare(plain_model, plain_optimizer, 2, STEPS, kind)
        # into a fresh sharded optimizer, and as the same stage's shard
        for form in ("consolidated", "shard"):
            again = copy.deepcopy(model)
            optimizer_again = sharded(again, kind, 2)
            saved = copy.deepcopy(full) if form == "consolidated" else optimizer.state_dict()
            optimizer_again.load_state_dict(pickle.loads(pickle.dumps(saved)))
            continue_and_compare(again, optimizer_again, 2, STEPS, kind)
        # a plain optimizer's state (one process, unsharded) loads into a sharded one
        single = Net()
        single_optimizer = OPTIMIZERS[kind](single.parameters())
        for step in range(2):
            train_step(single, single_optimizer, *global_data(step))
        restarted = copy.deepcopy(single)
        restarted_optimizer = sharded(restarted, kind, 1)
        restarted_optimizer.load_state_dict(single_optimizer.state_dict())
        continue_and_compare(restarted, restarted_optimizer, 2, STEPS, kind)


@check
def wrapping_an_optimizer_that_already_stepped() -> None:
    single = Net()
    single_optimizer = OPTIMIZERS["adam"](single.parameters())
    for step in range(2):
        train_step(single, single_optimizer, *global_data(step))
    optimizer = rt.ShardedOptimizer(single_optimizer, single.named_parameters(), stage=1,
                                    **BUCKETS)
    continue_and_compare(single, optimizer, 2, STEPS, "adam")


@check
def elastic_state_saves_the_consolidated_form() -> None:
    directory = rt.broadcast_object(tempfile.mkdtemp() if rt.rank() == 0 else None,
                                    root_rank=0, name="elastic directory")
    model, optimizer = trained("adamw", 2, 2)
    state = elastic.State(directory=directory, step=2, model=model, optimizer=optimizer)
    state.commit()
    fresh_model = Net()
    fresh_optimizer = sharded(fresh_model, "adamw", 1)
    restored = elastic.State(directory=directory, step=0, model=fresh_model,
                             optimizer=fresh_optimizer)
    assert restored.restore() and restored.step == 2
    continue_and_compare(fresh_model, fresh_optimizer, 2, STEPS, "adamw")


@check
def checkpoint_across_numbers_of_ranks() -> None:
    """With RINGTRAIN_SHARDED_CHECKPOINT set: save after 2 steps when no checkpoint is
    there; load one saved with another number of ranks and continue."""
    directory = os.environ.get("RINGTRAIN_SHARDED_CHECKPOINT")
    if not directory:
        return
    path = os.path.join(directory, "sharded.pt")
    if not os.path.exists(path):
        model, optimizer = trained("adam", 2, 2)
        full = optimizer.state_dict(consolidate=True)
        if rt.rank() == 0:
            torch.save({"size": rt.size(), "model": model.state_dict(), "optimizer": full},
                       path)
        rt.barrier()
        return
    saved = torch.load(path, weights_only=False)
    assert saved["size"] != rt.size(), "the checkpoint was saved with as many ranks"
    model = Net()
    model.load_state_dict(saved["model"])
    optimizer = sharded(model, "adam", 1)
    optimizer.load_state_dict(saved["optimizer"])
    continue_and_compare(model, optimizer, 2, STEPS, "adam")
    print(f"rank {rt.rank()}: continued a checkpoint of {saved['size']} ranks", flush=True)


@check
def errors_are_clear() -> None:
    model = Net()
    expect_raises(rt.InvalidArgumentError, rt.ShardedOptimizer,
                  torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), stage=3,
                  match=["stage must be 1 or 2", "3"])
    expect_raises(rt.InvalidArgumentError, rt.ShardedOptimizer,
                  torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                  stage=True, match=["stage must be 1 or 2"])
    named = [(n, p) for n, p in model.named_parameters() if n != "scale"]
    expect_raises(rt.InvalidArgumentError, rt.ShardedOptimizer,
                  torch.optim.SGD(model.parameters(), lr=0.1), named,
                  match=[f"rank {rt.rank()}", "missing from named_parameters", "(1, 3, 3)"])
    twice = [("w", model.fc1.weight), ("w", model.fc1.bias), ("scale", model.scale),
             ("fc2.weight", model.fc2.weight), ("fc2.bias", model.fc2.bias)]
    expect_raises(rt.InvalidArgumentError, rt.ShardedOptimizer,
                  torch.optim.SGD(model.parameters(), lr=0.1), twice,
                  match=[f"rank {rt.rank()}", "repeats the name(s) 'w'"])
    expect_raises(rt.InvalidArgumentError, rt.ShardedOptimizer,
                  lambda parameters, gradients: None, [], master_weights=True,
                  match=["master_weights=True needs a torch.optim.Optimizer"])
    expect_raises(rt.InvalidArgumentError, sharded, model, "sgd", 1, master_weights=1,
                  match=["master_weights must be True or False"])
    expect_raises(rt.InvalidArgumentError, sharded, model, "sgd", 1, compression="fp16",
                  match=["compression must be", "'fp16'"])
    optimizer = sharded(model, "sgd", 1)
    inputs, targets = global_data(0)
    torch.nn.functional.mse_loss(model(my_shard(inputs)), my_shard(targets)).backward()
    expect_raises(rt.UsageError, optimizer.zero_grad, match=["before optimizer.step()"])
    expect_raises(rt.UsageError, lambda: torch.nn.functional.mse_loss(
        model(my_shard(inputs)), my_shard(targets)).backward(),
        match=["computed 2 times", "backward_passes_per_step is 1"])
    optimizer.step()
    if rt.size() > 1:
        other = rt.broadcast_object(optimizer.state_dict(), root_rank=1, name="rank 1's shard")
        if rt.rank() != 1:
            expect_raises(rt.InvalidArgumentError, optimizer.load_state_dict, other,
                          match=[f"rank {rt.rank()}", "the shard of rank 1",
                                 "consolidate=True"])


# --------------------------------------------------------------------------- numpy

class NumpyNet:
    """5 -> 6 -> 5 with tanh (71 elements), gradients written into fixed arrays."""

    def __init__(self) -> None:
        generator = rng(0, "sharded numpy model")
        self.params = {"w1": generator.standard_normal((5, 6)).astype(np.float32) * 0.4,
                       "b1": np.zeros(6, np.float32),
                       "w2": generator.standard_normal((6, 5)).astype(np.float32) * 0.4,
                       "b2": np.zeros(5, np.float32)}
        self.grads = {name: np.zeros_like(p) for name, p in self.params.items()}

    def backward(self, x: np.ndarray, y: np.ndarray, scale: float, ready) -> None:
        p, g = self.params, self.grads
        hidden = np.tanh(x @ p["w1"] + p["b1"])
        error = (hidden @ p["w2"] + p["b2"] - y) * (2 * scale / y.size)
        g["b2"] += error.sum(0)
        ready("b2")
        g["w2"] += hidden.T @ error
        ready("w2")
        back = (error @ p["w2"].T) * (1 - hidden ** 2)
        g["b1"] += back.sum(0)
        ready("b1")
        g["w1"] += x.T @ back
        ready("w1")


class MomentumSGD:
    """An optimizer over arrays: step() reads the gradients and updates the parameters."""

    def __init__(self, params: dict, grads: dict, lr: float = 0.1, momentum: float = 0.5):
        self.params, self.grads, self.lr, self.momentum = params, grads, lr, momentum
        self.velocity = {name: np.zeros_like(p) for name, p in params.items()}

    def step(self) -> None:
        for name, parameter in self.params.items():
            self.velocity[name] = self.momentum * self.velocity[name] + self.grads[name]
            parameter -= self.lr * self.velocity[name]

    def state_dict(self) -> dict:
        return {"velocity": {name: v.copy() for name, v in self.velocity.items()},
                "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = {name: np.array(v) for name, v in state["velocity"].items()}
        self.lr = state["lr"]


def numpy_gold(passes: int, overlap: bool, compression=rt.Compression.none) -> None:
    """Against the numpy DistributedOptimizer, bit-identical at N <= 2; at N > 2 within
    AGAINST_PLAIN, or with fp16 compression the bound of compressed_reduce_scatter."""
    reference, model = NumpyNet(), NumpyNet()
    reference_optimizer = rt.DistributedOptimizer(
        MomentumSGD(reference.params, reference.grads),
        [(n, p, reference.grads[n]) for n, p in reference.params.items()],
        backward_passes_per_step=passes, compression=compression, **BUCKETS)
    optimizer = rt.ShardedOptimizer(
        MomentumSGD, [(n, p, model.grads[n]) for n, p in model.params.items()],
        backward_passes_per_step=passes, fusion_threshold=64, first_bucket_bytes=32,
        compression=compression)
    assert len(optimizer.partition.buckets) >= 2, optimizer.partition
    owned = sum(v.size for v in optimizer.optimizer.velocity.values())
    assert owned == optimizer.partition.elements(rt.rank()), owned
    digests = Digests()
    for step in range(STEPS):
        inputs, targets = (t.numpy() for t in global_data(step))
        for net, opt, ready in ((reference, reference_optimizer, lambda name: None),
                                (model, optimizer, optimizer.mark_ready if overlap
                                 else lambda name: None)):
            opt.zero_grad()
            for x, y in zip(np.array_split(my_shard(inputs), passes),
                            np.array_split(my_shard(targets), passes)):
                net.backward(x, y, 1.0 / passes, ready)
            opt.step()
        for name, mine in model.params.items():
            error = float(np.abs(mine - reference.params[name]).max())
            bound = 0.0 if rt.size() <= 2 else AGAINST_PLAIN \
                if compression is rt.Compression.none else 8 * 2.0 ** -11 * 0.1 * (step + 1)
            assert error <= bound, f"step {step} {name}: {error:.3g} from plain"
            digests.add(f"step {step} {name}", mine)
    digests.verify()
    saved = optimizer.state_dict()
    optimizer.load_state_dict(pickle.loads(pickle.dumps(saved)))


check(lambda: numpy_gold(1, overlap=True), name="numpy_gold_overlapped")
check(lambda: numpy_gold(2, overlap=False), name="numpy_gold_two_backward_passes")
check(lambda: numpy_gold(1, overlap=True, compression=rt.Compression.fp16),
      name="numpy_gold_fp16_compression")


def numpy_train(net, optimizer, start: int, stop: int, clip: float | None = None) -> list:
    norms = []
    for step in range(start, stop):
        inputs, targets = (t.numpy() for t in global_data(step))
        optimizer.zero_grad()
        net.backward(my_shard(inputs), my_shard(targets), 1.0, lambda name: None)
        if clip is not None:
            norms.append(optimizer.clip_grad_norm_(clip))
        optimizer.step()
    return norms


def numpy_sharded(net):
    return rt.ShardedOptimizer(MomentumSGD, [(n, p, net.grads[n]) for n, p in net.params.items()],
                               fusion_threshold=64, first_bucket_bytes=32)


@check
def numpy_consolidated_state_and_clipping() -> None:
    """The consolidated state of a numpy loop is what MomentumSGD over the whole
    parameters holds after the same steps with the DistributedOptimizer (bit-identical at
    N <= 2, within AGAINST_PLAIN otherwise); it resumes a sharded run exactly; clipping
    by the global norm gives the norm computed over the whole averaged gradients."""
    model = NumpyNet()
    optimizer = numpy_sharded(model)
    numpy_train(model, optimizer, 0, 2)
    last = rt.size() - 1
    full = optimizer.state_dict(consolidate=True, to_rank=last)
    assert (full is None) == (rt.rank() != last), type(full)
    full = rt.broadcast_object(full, root_rank=last, name="numpy consolidated")
    reference = NumpyNet()
    reference_optimizer = rt.DistributedOptimizer(
        MomentumSGD(reference.params, reference.grads),
        [(n, p, reference.grads[n]) for n, p in reference.params.items()], **BUCKETS)
    numpy_train(reference, reference_optimizer, 0, 2)
    expected = reference_optimizer.state_dict()
    assert full["lr"] == expected["lr"] and set(full["velocity"]) == set(model.params)
    for name, velocity in expected["velocity"].items():
        assert full["velocity"][name].shape == velocity.shape, name
        error = float(np.abs(full["velocity"][name] - velocity).max())
        assert error <= (0.0 if rt.size() <= 2 else AGAINST_PLAIN), (name, error)
    resumed = copy.deepcopy(model)
    numpy_train(model, optimizer, 2, STEPS)
    resumed_optimizer = numpy_sharded(resumed)
    resumed_optimizer.load_state_dict(pickle.loads(pickle.dumps(full)))
    numpy_train(resumed, resumed_optimizer, 2, STEPS)
    for name, value in model.params.items():
        assert np.array_equal(resumed.params[name], value), name
    clipped, plain_net = NumpyNet(), NumpyNet()
    norms = numpy_train(clipped, numpy_sharded(clipped), 0, STEPS, clip=0.05)
    plain_optimizer = rt.DistributedOptimizer(
        MomentumSGD(plain_net.params, plain_net.grads),
        [(n, p, plain_net.grads[n]) for n, p in plain_net.params.items()], **BUCKETS)
    for step in range(STEPS):
        inputs, targets = (t.numpy() for t in global_data(step))
        plain_optimizer.zero_grad()
        plain_net.backward(my_shard(inputs), my_shard(targets), 1.0, lambda name: None)
        plain_optimizer.synchronize()
        norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum())
                             for g in plain_net.grads.values()))
        assert math.isclose(norms[step], norm, rel_tol=1e-5), (step, norms[step], norm)
        for gradient in plain_net.grads.values():
            gradient *= np.float32(min(1.0, 0.05 / (norm + 1e-6)))
        with plain_optimizer.skip_synchronize():
            plain_optimizer.step()
    for name, value in plain_net.params.items():
        error = float(np.abs(clipped.params[name] - value).max())
        assert error <= AGAINST_PLAIN, (name, error)
    expect_raises(rt.InvalidArgumentError, numpy_sharded(NumpyNet()).load_state_dict,
                  {"velocity": {"w1": np.zeros(3, np.float32)}, "lr": 0.1},
                  match=[f"rank {rt.rank()}", "'velocity'", "'w1'", "(5, 6)"])


if __name__ == "__main__":
    main()
