"""Mixed precision on any number of ranks: bfloat16 and float16 models trained with the
DistributedOptimizer, with and without fp32 master weights.

Gold checks (as in trainer_gold.py): N ranks, each training on its shard of a global
batch, end every step within a tolerance (see :func:`tolerance`) of one process training
the same model on the whole global batch, and bit-identical to each other.

Exact checks: the semantics of ``master_weights=True`` (upcast the averaged gradient into
a float32 copy, step the copy, round it into the model) are those of a hand-made
reference fed with the same averaged gradients, bit for bit, for SGD with momentum,
Adam and AdamW, with clipping, several backward passes, a learning-rate scheduler, loss
scaling, state dicts, broadcast_optimizer_state and elastic commits.

Run: mpiexec -n K python tests/mpi/trainer_mixed_precision.py [--only SUBSTRING]
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import warnings

import numpy as np

import ringtrain as rt
from _harness import Digests, check, expect_raises, log, main, rng
from ringtrain import elastic
from ringtrain.kernels import BFLOAT16

try:
    import torch
except ImportError:
    torch = None

GLOBAL_BATCH = 24           # divisible by 1, 2, 3, 4 ranks times 2 micro-batches
STEPS = 4
LR = 0.1
MOMENTUM = 0.5
ROUNDINGS = 8               # bf16/fp16 roundings a gradient passes through in backward
# Bucket settings (2-byte gradients): fused into several small buckets, and one
# allreduce per tensor.
FUSION = {"fused": dict(fusion_threshold=150, first_bucket_bytes=50),
          "unfused": dict(fusion_threshold=0)}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp, relative: 2**-8 for bfloat16 (8 significant bits), 2**-11 for float16."""
    return {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]


def tolerance(dtype: torch.dtype, master: bool, steps: int, gradient_max: float,
              parameter_max: float, velocity_max: float) -> tuple[float, float]:
    """How far the distributed weights may be from the single-process ones after
    ``steps`` steps: ``(model parameters, float32 copies)``.

    The averaged gradient differs from the one-process gradient of the global batch by
    at most ``2·(N + D)·u·G`` per element (u the unit roundoff, G the largest gradient
    magnitude): each rank's gradient goes through about D = 8 roundings to 16 bits
    (activations, the loss gradient, each layer's backward) that the one-process
    gradient goes through at other points, each within u of a value below ~G; the
    reduction adds N-1 roundings of partial sums (each below N·G, then divided by N) and
    one of the quotient; the factor 2 covers cancellation in the sums over the batch.

    Without master weights the momentum buffer and the parameter are rounded to 16 bits
    at every step: two values that differ by d before rounding differ by at most
    d + 1 ulp after (1 ulp ≤ 2u·|value|), so each step may add one ulp of the largest
    parameter and, through the learning rate, one of the largest momentum. With master
    weights the float32 copies only drift by the gradient error (float32 rounding is
    negligible here: 1e-6), and the model's parameters, their rounded values, are one
    ulp further at most, whatever the number of steps. The gradient error enters the
    update through the learning rate and the momentum (at most 1/(1-m) of it per step);
    a factor 2 covers the change of later gradients caused by earlier differences.
    """
    u = unit_roundoff(dtype)
    gradient_error = 2 * (rt.size() + ROUNDINGS) * u * gradient_max
    drift = steps * 2 * LR * gradient_error / (1 - MOMENTUM)
    if master:
        return 1e-6 + drift + 2 * u * parameter_max, 1e-6 + drift
    flips = steps * 2 * (LR * 2 * u * velocity_max / (1 - MOMENTUM) + 2 * u * parameter_max)
    return 1e-6 + drift + flips, 0.0


# --------------------------------------------------------------------------- helpers

def torch_model(dtype: torch.dtype = torch.float32, seed: int = 7) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
              torch.nn.Linear(8, 3)]
    return torch.nn.Sequential(*layers).to(dtype)


def global_data(step: int) -> tuple[np.ndarray, np.ndarray]:
    generator = rng(0, "data", step)
    inputs = generator.standard_normal((GLOBAL_BATCH, 6)).astype(np.float32)
    targets = generator.standard_normal((GLOBAL_BATCH, 3)).astype(np.float32)
    return inputs, targets


def my_shard(array: np.ndarray, rank: int | None = None) -> np.ndarray:
    rank = rt.rank() if rank is None else rank
    share = len(array) // rt.size()
    return array[rank * share:(rank + 1) * share]


def backward(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, passes: int = 1,
             scale: float = 1.0) -> None:
    """Add the gradient of the mean squared error (times ``scale``) over ``passes``
    micro-batches, in the model's dtype."""
    dtype = next(model.parameters()).dtype
    for part_x, part_y in zip(np.array_split(x, passes), np.array_split(y, passes)):
        prediction = model(torch.from_numpy(part_x).to(dtype))
        loss = torch.nn.functional.mse_loss(prediction, torch.from_numpy(part_y).to(dtype))
        (loss * scale / passes).backward()


def distributed(model: torch.nn.Module, inner: torch.optim.Optimizer, **options):
    options.setdefault("fusion_threshold", 300)
    options.setdefault("first_bucket_bytes", 100)
    return rt.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **options)


class HandMadeMasters:
    """fp32 master weights by hand, in one process: what ``master_weights=True`` promises.

    ``step()`` upcasts each parameter's gradient into its float32 copy, clips the copies'
    gradients if asked, steps the optimizer over the copies and rounds them into the
    model.
    """

    def __init__(self, model: torch.nn.Module, make_optimizer):
        self.model = model
        self.masters = [p.detach().float().clone() for p in model.parameters()]
        self.optimizer = make_optimizer(self.masters)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, clip: float | None = None) -> None:
        for master, parameter in zip(self.masters, self.model.parameters()):
            master.grad = parameter.grad.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, clip)
        self.optimizer.step()
        with torch.no_grad():
            for master, parameter in zip(self.masters, self.model.parameters()):
                parameter.copy_(master)


def sgd(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


OPTIMIZERS = {"sgd": sgd, "adam": adam, "adamw": adamw}


def largest(tensors) -> float:
    return max(float(t.detach().float().abs().max()) for t in tensors)


def assert_same(actual: list, expected: list, what: str) -> None:
    for index, (mine, theirs) in enumerate(zip(actual, expected, strict=True)):
        assert mine.dtype == theirs.dtype, f"{what} [{index}]: {mine.dtype} != {theirs.dtype}"
        if not torch.equal(mine.detach(), theirs.detach()):
            error = float((mine.detach().double() - theirs.detach().double()).abs().max())
            raise AssertionError(f"{what} [{index}]: differs by up to {error:.3g}")


def assert_identical_across_ranks(tensors, what: str) -> None:
    digests = Digests()
    for index, tensor in enumerate(tensors):
        digests.add(f"{what} [{index}]", tensor.detach().double().numpy())
    digests.verify()


def torch_check(function=None, **options):
    def register(f):
        if torch is not None:
            check(f, **options)
        return f

    return register(function) if function is not None else register


# --------------------------------------------------------------------------- gold

def gold(dtype: torch.dtype, master: bool, fusion: str, passes: int = 1) -> None:
    reference = torch_model(dtype)
    model = copy.deepcopy(reference)
    if master:
        reference_masters = HandMadeMasters(reference, sgd)
        reference_optimizer = reference_masters.optimizer
    else:
        reference_optimizer = sgd(reference.parameters())
    optimizer = distributed(model, sgd(model.parameters()), master_weights=master,
                            backward_passes_per_step=passes, **FUSION[fusion])
    if fusion == "fused":
        assert len(optimizer.reducer.buckets) >= 3, optimizer.reducer
    digests = Digests()
    gradient_max = 0.0
    worst = 0.0
    start = [p.detach().double().clone() for p in reference.parameters()]
    for step in range(STEPS):
        x, y = global_data(step)
        if master:
            reference_masters.zero_grad()
            backward(reference, x, y, passes)
            reference_masters.step()
        else:
            reference_optimizer.zero_grad()
            backward(reference, x, y, passes)
            reference_optimizer.step()
        gradient_max = max(gradient_max, largest(p.grad for p in reference.parameters()))
        velocity_max = 0.0 if master else largest(
            reference_optimizer.state[p]["momentum_buffer"] for p in reference.parameters())
        optimizer.zero_grad()
        backward(model, my_shard(x), my_shard(y), passes)
        optimizer.step()
        bound, master_bound = tolerance(dtype, master, step + 1, gradient_max,
                                        largest(reference.parameters()), velocity_max)
        pairs = list(zip(model.named_parameters(), reference.parameters()))
        if master:
            pairs += [((f"float32 copy of {name}", mine), theirs) for (name, _), mine, theirs in
                      zip(model.named_parameters(), optimizer.master_parameters(),
                          reference_masters.masters)]
        for (name, mine), theirs in pairs:
            assert mine.dtype == theirs.dtype, (name, mine.dtype, theirs.dtype)
            limit = master_bound if name.startswith("float32 copy") else bound
            error = float((mine.detach().double() - theirs.detach().double()).abs().max())
            worst = max(worst, error / limit)
            assert error <= limit, f"step {step} {name}: off by {error:.3g} > {limit:.3g}"
            digests.add(f"step {step} {name}", mine.detach().double().numpy())
    digests.verify()
    moved = max(float((p.detach().double() - p0).abs().max())
                for p, p0 in zip(reference.parameters(), start))
    # The check has teeth: a gradient dropped or not averaged would be off by about the
    # whole movement of the weights (or N-1 times it), beyond the tolerance.
    assert bound < moved, (bound, moved)
    if rt.rank() == 0:
        log(f"rank 0: {dtype} master={master} {fusion} passes={passes}: largest error "
            f"{worst:.2f} of the tolerance {bound:.3g} (weights moved up to {moved:.3g})")


for _dtype in ("bfloat16", "float16"):
    for _master in (False, True):
        for _fusion in FUSION:
            torch_check(lambda d=_dtype, m=_master, f=_fusion: gold(getattr(torch, d), m, f),
                        name=f"gold_{_dtype}_{'master' if _master else 'plain'}_{_fusion}")
torch_check(lambda: gold(torch.bfloat16, True, "fused", passes=2),
            name="gold_bfloat16_master_fused_passes2")


# --------------------------------------------------------------------------- buckets

class MixedNet(torch.nn.Module if torch is not None else object):
    """A float32 layer, then bfloat16 layers: buckets of both dtypes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.first = torch.nn.Linear(6, 8)
        self.second = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.last = torch.nn.Linear(8, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x.float())).to(torch.bfloat16)
        return self.last(torch.tanh(self.second(hidden))).float()


def reduced_like_the_exact_mean(compression) -> None:
    """Each bucket holds one dtype. The bfloat16 gradients averaged across ranks are
    within 2·N·u·G of the exact mean of every rank's gradient, G the largest of them: N-1
    partial sums (each below N·G) and the quotient are rounded once each to bfloat16,
    the factor 2 a margin. bf16 compression applies to float32 gradients only, so this
    holds with it too; the float32 ones are checked (within float32 rounding)
    uncompressed."""
    model = MixedNet()
    x, y = global_data(0)
    everyone = []
    for rank in range(rt.size()):
        replica = copy.deepcopy(model)
        backward(replica, my_shard(x, rank), my_shard(y, rank))
        everyone.append([p.grad.double() for p in replica.parameters()])
    optimizer = distributed(model, sgd(model.parameters()), compression=compression,
                            fusion_threshold=120, first_bucket_bytes=40)
    dtypes = [{optimizer.reducer.specs[i].dtype for i in bucket.members}
              for bucket in optimizer.reducer.buckets]
    assert all(len(kinds) == 1 for kinds in dtypes), dtypes
    assert {str(kinds.pop()) for kinds in dtypes} == {"float32", "bfloat16"}, dtypes
    backward(model, my_shard(x), my_shard(y))
    optimizer.synchronize()
    for (name, parameter), *grads in zip(model.named_parameters(), *everyone):
        exact = torch.stack(grads).mean(0)
        scale = float(torch.stack(grads).abs().max())
        u = unit_roundoff(torch.bfloat16) if parameter.dtype == torch.bfloat16 else 2.0 ** -24
        bound = 2 * rt.size() * u * scale + 1e-12
        if compression is rt.Compression.none or parameter.dtype == torch.bfloat16:
            error = float((parameter.grad.double() - exact).abs().max())
            assert error <= bound, f"{name}: off by {error:.3g} > {bound:.3g}"
        assert parameter.grad.dtype == parameter.dtype, (name, parameter.grad.dtype)
    assert_identical_across_ranks([p.grad for p in model.parameters()], "mixed gradients")
    with optimizer.skip_synchronize():
        optimizer.step()
    assert_identical_across_ranks(list(model.parameters()), "mixed parameters")


torch_check(lambda: reduced_like_the_exact_mean(rt.Compression.none),
            name="bfloat16_buckets_average")
torch_check(lambda: reduced_like_the_exact_mean(rt.Compression.bf16),
            name="bfloat16_buckets_with_bf16_compression")


@torch_check
def fp16_compression_refuses_bfloat16_models_and_leaves_float16_ones():
    """As the collectives define it: fp16 compression of a bfloat16 tensor is refused (it
    would narrow the range and save no bytes), when wrapping, naming the rank and the
    bucket, before the optimizer changes; float16 gradients travel as they are."""
    model = MixedNet()
    inner = sgd(model.parameters())
    params = list(inner.param_groups[0]["params"])
    expect_raises(rt.UnsupportedDtypeError, distributed, model, inner,
                  compression=rt.Compression.fp16, master_weights=True,
                  match=[f"rank {rt.rank()}", "gradient bucket", "last.weight",
                         "fp16 compression", "bfloat16"])
    assert inner.param_groups[0]["params"] == params
    reference = torch_model(torch.float16)
    model = copy.deepcopy(reference)
    plain = distributed(reference, sgd(reference.parameters()))
    compressed = distributed(model, sgd(model.parameters()), compression=rt.Compression.fp16)
    for optimizer, net in ((plain, reference), (compressed, model)):
        x, y = global_data(0)
        optimizer.zero_grad()
        backward(net, my_shard(x), my_shard(y))
        optimizer.step()
    assert_same(list(model.parameters()), list(reference.parameters()), "float16 compressed")


@check
def numpy_protocol_bfloat16_gradients():
    """An optimizer over ``ml_dtypes.bfloat16`` arrays: its gradients are averaged within
    2·N·u·G of the exact mean (as above), identically on every rank."""
    bfloat16 = BFLOAT16

    def gradient(rank: int, name: str, shape) -> np.ndarray:
        return rng(rank, "bf16 gradient", name).standard_normal(shape).astype(bfloat16)

    shapes = {"w": (5, 3), "b": (3,), "big": (70,)}
    params = {name: np.zeros(shape, bfloat16) for name, shape in shapes.items()}
    grads = {name: gradient(rt.rank(), name, shape) for name, shape in shapes.items()}

    class PlainSGD:
        def step(self):
            for name in params:
                params[name] -= grads[name] * np.asarray(LR, bfloat16)

    optimizer = rt.DistributedOptimizer(PlainSGD(), [(n, params[n], grads[n]) for n in shapes],
                                        fusion_threshold=100, first_bucket_bytes=20)
    for name in reversed(list(shapes)):
        optimizer.mark_ready(name)
    optimizer.step()
    digests = Digests()
    for name, shape in shapes.items():
        everyone = np.stack([gradient(r, name, shape).astype(np.float64)
                             for r in range(rt.size())])
        bound = 2 * rt.size() * 2.0 ** -8 * np.abs(everyone).max()
        error = np.abs(grads[name].astype(np.float64) - everyone.mean(0)).max()
        assert grads[name].dtype == bfloat16 and error <= bound, (name, error, bound)
        digests.add(name, params[name].astype(np.float64))
    digests.verify()


# --------------------------------------------------------------------------- exact semantics

def exact_master_semantics(kind: str, dtype: torch.dtype, passes: int = 1,
                           clip: float | None = None, scheduler: bool = False) -> None:
    model = torch_model(dtype)
    reference = HandMadeMasters(copy.deepcopy(model), OPTIMIZERS[kind])
    optimizer = distributed(model, OPTIMIZERS[kind](model.parameters()), master_weights=True,
                            backward_passes_per_step=passes)
    schedulers = []
    if scheduler:
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                      for o in (optimizer, reference.optimizer)]
    for step in range(STEPS):
        x, y = global_data(step)
        optimizer.zero_grad()
        backward(model, my_shard(x), my_shard(y), passes)
        optimizer.synchronize()
        averaged = [p.grad.detach().clone() for p in model.parameters()]
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(optimizer.master_parameters(), clip)
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(m.grad)
                             for m in optimizer.master_parameters()]))
            assert float(norm) <= clip * 1.001, float(norm)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with optimizer.skip_synchronize():
                optimizer.step()
        reference.zero_grad()
        for parameter, gradient in zip(reference.model.parameters(), averaged):
            parameter.grad = gradient
        reference.step(clip)
        for s in schedulers:
            s.step()
        assert_same(optimizer.master_parameters(), reference.masters, f"step {step} copies")
        assert_same(list(model.parameters()), list(reference.model.parameters()),
                    f"step {step} parameters")
        assert all(m.dtype == torch.float32 for m in optimizer.master_parameters())
    if scheduler:
        assert optimizer.param_groups[0]["lr"] == optimizer.defaults["lr"] * 0.5 ** STEPS
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert value.dtype == torch.float32, (key, value.dtype)
    assert_identical_across_ranks(optimizer.master_parameters(), f"{kind} copies")


for _kind in OPTIMIZERS:
    torch_check(lambda k=_kind: exact_master_semantics(k, torch.bfloat16),
                name=f"master_{_kind}_bfloat16_exact")
torch_check(lambda: exact_master_semantics("adam", torch.float16),
            name="master_adam_float16_exact")
torch_check(lambda: exact_master_semantics("sgd", torch.bfloat16, passes=2, clip=0.05,
                                           scheduler=True),
            name="master_passes2_clipped_scheduled_exact")


@torch_check
def master_parameters_and_param_groups():
    model = MixedNet()
    inner = sgd(model.parameters())
    group = inner.param_groups[0]
    optimizer = distributed(model, inner, master_weights=True)
    assert optimizer.param_groups[0] is group and group["lr"] == LR
    masters = optimizer.master_parameters()
    assert masters[0] is model.first.weight and masters[1] is model.first.bias
    assert [m.dtype for m in masters] == [torch.float32] * 6
    assert all(m is not p for m, p in zip(masters[2:], list(model.parameters())[2:]))
    assert [id(p) for p in group["params"]] == [id(m) for m in masters]
    assert "MasterWeights(4 float32 copies)" in repr(optimizer), repr(optimizer)
    x, y = global_data(0)
    backward(model, my_shard(x), my_shard(y))
    optimizer.step()
    for parameter, master in zip(model.parameters(), masters):
        assert torch.equal(parameter.detach(), master.detach().to(parameter.dtype))
    assert_identical_across_ranks(masters, "mixed copies")


@torch_check
def clipping_the_model_gradients_after_synchronize_warns_and_is_used():
    model = torch_model(torch.bfloat16)
    reference = HandMadeMasters(copy.deepcopy(model), sgd)
    optimizer = distributed(model, sgd(model.parameters()), master_weights=True)
    x, y = global_data(0)
    backward(model, my_shard(x), my_shard(y))
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped = [p.grad.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimizer.skip_synchronize():
            optimizer.step()
    assert any("master_parameters()" in str(w.message) for w in caught), caught
    for parameter, gradient in zip(reference.model.parameters(), clipped):
        parameter.grad = gradient
    reference.step()
    assert_same(optimizer.master_parameters(), reference.masters, "copies")


@torch_check
def master_weights_are_refused_for_an_optimizer_over_arrays():
    params = [np.zeros(3, np.float16)]

    class Plain:
        def step(self):
            pass

    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, Plain(),
                  [("w", params[0], np.zeros(3, np.float16))], master_weights=True,
                  match=["master_weights=True needs a torch.optim.Optimizer"])
    model = torch_model(torch.bfloat16)
    expect_raises(rt.InvalidArgumentError, rt.DistributedOptimizer, sgd(model.parameters()),
                  master_weights="yes", match=["master_weights must be True or False"])


# --------------------------------------------------------------------------- loss scaling

def loss_scaling_is_exact(master: bool) -> None:
    """A power-of-two loss scale changes no bit of a bfloat16 model's training: scaled
    gradients, their reduction and the unscaling are exact (no overflow, no subnormals)."""
    model = torch_model(torch.bfloat16)
    twin = copy.deepcopy(model)
    scaled = distributed(model, sgd(model.parameters()), master_weights=master)
    plain = distributed(twin, sgd(twin.parameters()), master_weights=master)
    scaler = rt.DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=2)
    for step in range(3):
        x, y = global_data(step)
        scaled.zero_grad()
        backward(model, my_shard(x), my_shard(y), scale=scaler.loss_scale)
        assert scaler.step(scaled) is True
        plain.zero_grad()
        backward(twin, my_shard(x), my_shard(y))
        plain.step()
        assert_same(list(model.parameters()), list(twin.parameters()), f"step {step}")
        assert_same(scaled.master_parameters(), plain.master_parameters(), f"step {step}")
    assert scaler.loss_scale == 2.0 ** 9, scaler
    before = [t.detach().clone() for t in scaled.master_parameters()]
    scaled.zero_grad()
    scale = float("inf") if rt.rank() == rt.size() - 1 else 1.0
    backward(model, *global_data(5), scale=scale)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rt.NonFiniteWarning)
        assert scaler.step(scaled) is False
    assert scaler.loss_scale == 2.0 ** 8 and scaler.skipped_steps == 1, scaler
    assert_same(scaled.master_parameters(), before, "after the skipped step")
    assert_identical_across_ranks(list(model.parameters()), "after scaling")


torch_check(lambda: loss_scaling_is_exact(False), name="loss_scaler_bfloat16_exact")
torch_check(lambda: loss_scaling_is_exact(True), name="loss_scaler_bfloat16_master_exact")


@torch_check
def loss_scaler_float16_master_weights():
    """The classic setup: a float16 model, float32 copies, a loss scale. The scaled run
    differs from the unscaled one only where unscaled gradients fall among float16's
    subnormals (spacing 6e-8), which the scaled ones escape: far below 1e-5 after three
    SGD steps."""
    model = torch_model(torch.float16)
    twin = copy.deepcopy(model)
    scaled = distributed(model, sgd(model.parameters()), master_weights=True)
    plain = distributed(twin, sgd(twin.parameters()), master_weights=True)
    scaler = rt.DynamicLossScaler(init_scale=2.0 ** 10)
    for step in range(3):
        x, y = global_data(step)
        scaled.zero_grad()
        backward(model, my_shard(x), my_shard(y), scale=scaler.loss_scale)
        assert scaler.step(scaled) is True
        plain.zero_grad()
        backward(twin, my_shard(x), my_shard(y))
        plain.step()
    for mine, theirs in zip(scaled.master_parameters(), plain.master_parameters()):
        error = float((mine - theirs).detach().abs().max())
        assert error <= 1e-5, error
    assert_identical_across_ranks(list(model.parameters()), "float16 scaled")


# --------------------------------------------------------------------------- loss curves

@torch_check
def master_weights_track_the_float32_loss_curve():
    """With a fixed seed, the loss curve of a bfloat16 model trained with float32 copies
    stays closer to the float32 model's than that of the plain bfloat16 model, whose
    updates (below half an ulp of the weights) are mostly rounded away."""
    steps, lr = 25, 0.002
    x, y = global_data(100)
    evaluation = (torch.from_numpy(x), torch.from_numpy(y))
    evaluator = torch_model(torch.float32)
    curves = {}
    for run, (dtype, master) in {"float32": (torch.float32, False),
                                 "bfloat16": (torch.bfloat16, False),
                                 "bfloat16 + master": (torch.bfloat16, True)}.items():
        model = torch_model(dtype, seed=21)
        optimizer = distributed(model, torch.optim.SGD(model.parameters(), lr=lr,
                                                       momentum=0.9),
                                master_weights=master)
        curve = []
        for step in range(steps):
            optimizer.zero_grad()
            backward(model, my_shard(x), my_shard(y))
            optimizer.step()
            with torch.no_grad():
                for mine, weight in zip(evaluator.parameters(), model.parameters()):
                    mine.copy_(weight)
                curve.append(float(torch.nn.functional.mse_loss(evaluator(evaluation[0]),
                                                                evaluation[1])))
        curves[run] = np.array(curve)
    plain = float(np.abs(curves["bfloat16"] - curves["float32"]).sum())
    master = float(np.abs(curves["bfloat16 + master"] - curves["float32"]).sum())
    if rt.rank() == 0:
        log(f"rank 0: loss curves over {steps} steps: float32 {curves['float32'][0]:.4f} -> "
            f"{curves['float32'][-1]:.4f}; distance from it: plain bfloat16 {plain:.4f}, "
            f"bfloat16 with float32 copies {master:.4f}")
    assert master < 0.5 * plain, (master, plain)


# --------------------------------------------------------------------------- state

def trained(kind: str = "adam", seed: int = 7, steps: int = 2):
    model = torch_model(torch.bfloat16, seed=seed)
    optimizer = distributed(model, OPTIMIZERS[kind](model.parameters()), master_weights=True)
    for step in range(steps):
        x, y = global_data(step)
        optimizer.zero_grad()
        backward(model, my_shard(x), my_shard(y))
        optimizer.step()
    return model, optimizer


def one_more_step(model, optimizer, step: int = 9) -> None:
    x, y = global_data(step)
    optimizer.zero_grad()
    backward(model, my_shard(x), my_shard(y))
    optimizer.step()


@torch_check
def state_dict_round_trip_keeps_the_float32_copies():
    model, optimizer = trained()
    state = copy.deepcopy(optimizer.state_dict())
    copies = state["master_weights"]
    assert sorted(copies) == list(range(6)), sorted(copies)
    assert all(t.dtype == torch.float32 for t in copies.values())
    assert any(not torch.equal(copies[i], p.detach().float())
               for i, p in enumerate(model.parameters())), "the copies hold nothing more"
    model_state = copy.deepcopy(model.state_dict())
    other_model = torch_model(torch.bfloat16, seed=99)
    other = distributed(other_model, adam(other_model.parameters()), master_weights=True)
    other_model.load_state_dict(model_state)
    other.load_state_dict(state)
    assert_same(other.master_parameters(), [copies[i] for i in range(6)], "loaded copies")
    assert_same(list(other_model.parameters()), list(model.parameters()), "rounded")
    one_more_step(model, optimizer)
    one_more_step(other_model, other)
    assert_same(other.master_parameters(), optimizer.master_parameters(), "after a step")
    # A state without copies: they are taken from the model's parameters at the next step.
    plain_state = copy.deepcopy(state)
    del plain_state["master_weights"]
    other.load_state_dict(plain_state)
    one_more_step(other_model, other, 10)
    broken = copy.deepcopy(state)
    broken["master_weights"][0] = torch.zeros(2)
    expect_raises(rt.InvalidArgumentError, other.load_state_dict, broken,
                  match=["'0.weight'", "shape (2,)", "(8, 6)"])
    del broken["master_weights"][0]
    expect_raises(rt.InvalidArgumentError, other.load_state_dict, broken,
                  match=["positions [1, 2, 3, 4, 5]", "[0, 1, 2, 3, 4, 5]"])


@torch_check
def broadcast_optimizer_state_carries_the_float32_copies():
    for root in range(rt.size()):
        model, optimizer = trained(seed=7)
        base = [m.detach().clone() for m in optimizer.master_parameters()]

        def noise(rank: int) -> torch.Tensor:
            return torch.from_numpy(rng(rank, "noise", root).standard_normal(6)
                                    .astype(np.float32)) * 1e-3

        state = copy.deepcopy(optimizer.state_dict())
        for index in range(6):
            state["master_weights"][index] += noise(rt.rank())[index]
        optimizer.load_state_dict(state)  # ranks now differ, in float32 and rounded
        expected = [b + noise(root)[index] for index, b in enumerate(base)]
        rt.broadcast_optimizer_state(optimizer, root_rank=root)
        assert_same(optimizer.master_parameters(), expected, f"root {root} copies")
        assert_identical_across_ranks(optimizer.master_parameters(), f"root {root} copies")
        if rt.rank() != root:
            for parameter, master in zip(model.parameters(), optimizer.master_parameters()):
                assert torch.equal(parameter.detach(), master.detach().bfloat16())
        assert_identical_across_ranks(list(model.parameters()), f"root {root} parameters")


@torch_check
def elastic_state_restores_the_float32_copies():
    directory = rt.broadcast_object(tempfile.mkdtemp() if rt.rank() == 0 else None, 0)
    try:
        model, optimizer = trained()
        state = elastic.State(directory=directory, step=2, model=model, optimizer=optimizer)
        state.commit()
        committed = [m.detach().clone() for m in optimizer.master_parameters()]
        one_more_step(model, optimizer)
        state.step = 3
        assert not torch.equal(committed[0], optimizer.master_parameters()[0])
        assert state.restore()
        assert state.step == 2
        assert_same(optimizer.master_parameters(), committed, "restored copies")
        for parameter, master in zip(model.parameters(), committed):
            assert torch.equal(parameter.detach(), master.bfloat16())
    finally:
        rt.barrier()
        if rt.rank() == 0 and os.path.isdir(directory):
            shutil.rmtree(directory)


if __name__ == "__main__":
    rt.init()
    main()
