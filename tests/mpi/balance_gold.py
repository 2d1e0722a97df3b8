"""The gold check of load balancing: N ranks with uneven shares equal one process.

Every check trains with a LoadBalancer whose shares change every two steps (each rank
reports made-up speeds, so the shares are uneven and move), a BalancedBatchSampler that
some ranks run a batch ahead of training, and an optimizer given ``balance=``; after
every epoch the weights equal, within a float tolerance (see :func:`tolerance`), those
of one process that trained on the same global batches, and are bit-identical across
ranks. Checked for the DistributedOptimizer (PyTorch fused and unfused, numpy), the
ShardedOptimizer (PyTorch stage 2, numpy), ``ringtrain.horovod``'s optimizer, several
backward passes per step, exact epochs with ``join`` (a rank without any of the last
batch), loss scaling, bfloat16 with fp32 master weights, pruning masks, and
``torch.nn.parallel.DistributedDataParallel`` with :func:`ringtrain.balance.scale_loss`.

Run: mpiexec -n K python tests/mpi/balance_gold.py [--only SUBSTRING]
"""

from __future__ import annotations

import collections
import contextlib
import copy
import socket

import numpy as np

import ringtrain as rt
from _harness import WORLD, Digests, check, log, main, rng
from ringtrain.balance import scale_loss
from ringtrain.trainer.distributed_sampler import epoch_order

try:
    import torch
except ImportError:  # the numpy checks still run
    torch = None

LR = 0.1
MOMENTUM = 0.5
EPOCHS = 2
FEATURES, OUTPUTS = 6, 3
SEED = 5


def global_batch_size() -> int:
    return 3 * rt.size() + 2             # never a multiple of the number of ranks


def samples() -> int:
    # Five global batches an epoch; the last has 3 samples in exact mode (at 4 ranks one
    # rank gets none of it).
    return 4 * global_batch_size() + 3


def dataset() -> tuple[np.ndarray, np.ndarray]:
    generator = rng(0, "data")
    inputs = generator.standard_normal((samples(), FEATURES)).astype(np.float32)
    targets = generator.standard_normal((samples(), OUTPUTS)).astype(np.float32)
    return inputs, targets


def global_batches(epoch: int, mode: str) -> list[np.ndarray]:
    """The epoch's global batches as one process sees them: the shares never change
    which samples a global batch holds."""
    n, size = samples(), global_batch_size()
    count = n if mode == "exact" else -(-n // size) * size
    order = np.resize(epoch_order(n, SEED, epoch, True), count)
    return [order[start:start + size] for start in range(0, count, size)]


def balanced(interval: int = 2) -> rt.LoadBalancer:
    """Shares that change at every agreement: made-up speeds, no hysteresis."""
    return rt.LoadBalancer(global_batch_size(), interval=interval, hysteresis=0.0,
                           noise_margin=0.0, smoothing=1.0, measure_steps=False)


def report_speed(balancer: rt.LoadBalancer, step: int, trained: int) -> None:
    seconds = rng(rt.rank(), "speed", step // balancer.interval).uniform(1e-4, 1e-2)
    balancer.record(seconds * trained, trained)


class Prefetched:
    """A sampler's batches, drawn ``ahead`` batches before they are trained (as a loader's
    workers draw them)."""

    def __init__(self, sampler, ahead: int):
        self._batches = iter(sampler)
        self._queue: collections.deque = collections.deque()
        self._ahead = ahead

    def next(self) -> np.ndarray | None:
        while len(self._queue) <= self._ahead:
            batch = next(self._batches, None)
            if batch is None:
                break
            self._queue.append(np.array(batch))
        return self._queue.popleft() if self._queue else None


def tolerance(steps: int, gradient_max: float) -> float:
    """How far the balanced float32 weights may be from one process's.

    Only rounding differs: each rank's mean is over other samples than the global mean
    (a few roundings of sums below the largest gradient G), the weight multiplies it
    (one rounding), and the reduction adds N-1 roundings of partial sums and one of the
    division, so an averaged gradient is within about (N + 4)·u·G of the exact mean
    (u = 2^-24). The update multiplies that by the learning rate and momentum adds up to
    1/(1-m) = 2 of it per step; a factor 2 covers later gradients changed by earlier
    differences, and 1e-6 the float32 rounding of parameters near 1.
    """
    per_step = (rt.size() + 4) * 2.0 ** -24 * gradient_max * LR * 2 * 2
    return 1e-6 + steps * per_step


def compare(mine: list[np.ndarray], theirs: list[np.ndarray], bound: float, what: str,
            digests: Digests) -> float:
    worst = 0.0
    for index, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        error = float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())
        worst = max(worst, error)
        assert error <= bound, f"{what} [{index}]: off by {error:.3g} > {bound:.3g}"
        digests.add(f"{what} [{index}]", np.asarray(a))
    return worst


# --------------------------------------------------------------------------- PyTorch

def torch_model(dtype=None) -> torch.nn.Module:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, OUTPUTS))
    return model if dtype is None else model.to(dtype)


def mse(model: torch.nn.Module, inputs: np.ndarray, targets: np.ndarray) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    prediction = model(torch.from_numpy(inputs).to(dtype))
    return torch.nn.functional.mse_loss(prediction, torch.from_numpy(targets).to(dtype))


def torch_gold(kind: str, mode: str = "pad", passes: int = 1) -> None:
    """Train ``kind`` (how the model is wrapped) with balanced shares and one process on
    the global batches; compare after every epoch."""
    inputs, targets = dataset()
    # With several passes a step, shares change after every step, while a rank that
    # draws a batch ahead has dealt half of the next step: they must wait for its end.
    balancer = balanced(interval=1 if passes > 1 else 2)
    sampler = rt.BalancedBatchSampler(samples(), balancer, seed=SEED, mode=mode)
    reference = torch_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    model = copy.deepcopy(reference)
    optimizer, train_step = TORCH_KINDS[kind](model, balancer, passes)
    # The same batches without the weighting: the check's teeth (see below).
    unweighted = copy.deepcopy(reference)
    unweighted_optimizer = rt.DistributedOptimizer(
        torch.optim.SGD(unweighted.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=unweighted.named_parameters(), backward_passes_per_step=passes) \
        if kind == "torch" and mode == "pad" and passes == 1 else None
    digests = Digests()
    gradient_max, steps, uneven = 0.0, 0, False
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = Prefetched(sampler, ahead=rt.rank() % 2)
        everyone = global_batches(epoch, mode)
        epoch_steps = len(everyone) // passes
        with rt.join(optimizer) if mode == "exact" else contextlib.nullcontext():
            for step in range(epoch_steps):
                mine = [batches.next() for _ in range(passes)]
                if mine[0] is None:
                    break               # none of the last batch: join shadows the step
                uneven |= len(set(balancer.shares)) > 1
                report_speed(balancer, steps + step, sum(len(b) for b in mine))
                train_step(optimizer, model, [(inputs[b], targets[b]) for b in mine], passes)
                if unweighted_optimizer is not None:
                    train_step(unweighted_optimizer, unweighted,
                               [(inputs[b], targets[b]) for b in mine], passes)
        for step in range(epoch_steps):
            reference_optimizer.zero_grad()
            for part in everyone[step * passes:(step + 1) * passes]:
                (mse(reference, inputs[part], targets[part]) / passes).backward()
            gradient_max = max(gradient_max, max(float(p.grad.abs().max())
                                                 for p in reference.parameters()))
            reference_optimizer.step()
        steps += epoch_steps
        bound = tolerance(steps, gradient_max)
        worst = compare([p.detach().numpy() for p in model.parameters()],
                        [p.detach().numpy() for p in reference.parameters()], bound,
                        f"{kind} epoch {epoch}", digests)
    digests.verify()
    if unweighted_optimizer is not None and uneven:
        # The average of the ranks' means is off by far more than the tolerance.
        off = max(float((a - b).detach().abs().max())
                  for a, b in zip(unweighted.parameters(), reference.parameters()))
        assert off > 10 * bound, (off, bound)
    if rt.rank() == 0:
        log(f"rank 0: {kind} {mode} passes={passes}: largest error {worst:.3g} "
            f"(tolerance {bound:.3g}), shares {balancer.shares}")


def plain_step(optimizer, model, parts, passes: int) -> None:
    optimizer.zero_grad()
    for x, y in parts:
        (mse(model, x, y) / passes).backward()
    optimizer.step()


def distributed(model, balancer, passes, **options):
    return rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                   momentum=MOMENTUM),
                                   named_parameters=model.named_parameters(),
                                   backward_passes_per_step=passes, balance=balancer,
                                   **options)


def fused(model, balancer, passes):
    optimizer = distributed(model, balancer, passes, fusion_threshold=300,
                            first_bucket_bytes=100)
    assert len(optimizer.reducer.buckets) >= 3, optimizer.reducer
    return optimizer, plain_step


def unfused(model, balancer, passes):
    return distributed(model, balancer, passes, fusion_threshold=0), plain_step


def sharded(model, balancer, passes):
    optimizer = rt.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=LR,
                                                    momentum=MOMENTUM),
                                    model.named_parameters(), stage=2,
                                    backward_passes_per_step=passes, fusion_threshold=300,
                                    first_bucket_bytes=100, balance=balancer)
    return optimizer, plain_step


def horovod(model, balancer, passes):
    import ringtrain.horovod as hvd

    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=model.named_parameters(), backward_passes_per_step=passes,
        balance=balancer)
    return optimizer, plain_step


def loss_scaled(model, balancer, passes):
    """Dynamic loss scaling: the power-of-two scale is exact, so the tolerance holds."""
    scaler = rt.DynamicLossScaler(init_scale=2.0 ** 10)

    def step(optimizer, model, parts, passes):
        optimizer.zero_grad()
        for x, y in parts:
            scaler.scale(mse(model, x, y) / passes).backward()
        assert scaler.step(optimizer)

    return distributed(model, balancer, passes, fusion_threshold=300,
                       first_bucket_bytes=100), step


def pruning_masks(model) -> list:
    """The same masks on every rank: (parameter, mask) for every parameter, None for
    the biases (sent whole)."""
    return [(parameter, torch.from_numpy(rng(0, "mask", index).random(parameter.shape) < 0.6)
             if parameter.dim() == 2 else None)
            for index, parameter in enumerate(model.parameters())]


TORCH_KINDS = {"torch": fused, "torch_unfused": unfused, "sharded": sharded,
               "horovod": horovod, "loss_scaled": loss_scaled}


def pruned_gold() -> None:
    """As torch_gold, with pruning masks on the gradients (the reference masks its own)."""
    inputs, targets = dataset()
    balancer = balanced()
    sampler = rt.BalancedBatchSampler(samples(), balancer, seed=SEED)
    reference = torch_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    model = copy.deepcopy(reference)
    optimizer, _ = fused(model, balancer, 1)
    optimizer.set_gradient_masks(pruning_masks(model))
    masks = dict(enumerate(mask for _, mask in pruning_masks(reference)))
    digests = Digests()
    gradient_max, steps = 0.0, 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = Prefetched(sampler, ahead=rt.rank() % 2)
        everyone = global_batches(epoch, "pad")
        for step, part in enumerate(everyone):
            mine = batches.next()
            report_speed(balancer, steps + step, len(mine))
            plain_step(optimizer, model, [(inputs[mine], targets[mine])], 1)
            reference_optimizer.zero_grad()
            mse(reference, inputs[part], targets[part]).backward()
            for index, parameter in enumerate(reference.parameters()):
                if masks[index] is not None:
                    parameter.grad.mul_(masks[index])
            gradient_max = max(gradient_max, max(float(p.grad.abs().max())
                                                 for p in reference.parameters()))
            reference_optimizer.step()
        steps += len(everyone)
        compare([p.detach().numpy() for p in model.parameters()],
                [p.detach().numpy() for p in reference.parameters()],
                tolerance(steps, gradient_max), f"pruned epoch {epoch}", digests)
    digests.verify()


def bfloat16_master_gold() -> None:
    """bfloat16 model, fp32 master weights: within the mixed-precision tolerance of one
    process doing the same (float32 copies stepped, rounded into the model)."""
    inputs, targets = dataset()
    balancer = balanced()
    sampler = rt.BalancedBatchSampler(samples(), balancer, seed=SEED)
    reference = torch_model(torch.bfloat16)
    masters = [p.detach().float().clone() for p in reference.parameters()]
    reference_optimizer = torch.optim.SGD(masters, lr=LR, momentum=MOMENTUM)
    model = copy.deepcopy(reference)
    optimizer = distributed(model, balancer, 1, fusion_threshold=150, first_bucket_bytes=50,
                            master_weights=True)
    digests = Digests()
    gradient_max, steps = 0.0, 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = Prefetched(sampler, ahead=rt.rank() % 2)
        for step, part in enumerate(global_batches(epoch, "pad")):
            mine = batches.next()
            report_speed(balancer, steps + step, len(mine))
            plain_step(optimizer, model, [(inputs[mine], targets[mine])], 1)
            reference.zero_grad(set_to_none=True)
            mse(reference, inputs[part], targets[part]).backward()
            for master, parameter in zip(masters, reference.parameters()):
                master.grad = parameter.grad.float()
            gradient_max = max(gradient_max, max(float(m.grad.abs().max()) for m in masters))
            reference_optimizer.step()
            with torch.no_grad():
                for master, parameter in zip(masters, reference.parameters()):
                    parameter.copy_(master)
            steps += 1
        # As in trainer_mixed_precision.py: each rank's gradient passes about 8 roundings
        # to 16 bits that the one-process gradient passes elsewhere, the reduction N more
        # (u = 2^-8); through the learning rate and momentum, times 2 for later gradients.
        gradient_error = 2 * (rt.size() + 8) * 2.0 ** -8 * gradient_max
        bound = 1e-6 + steps * 2 * LR * gradient_error / (1 - MOMENTUM)
        compare([m.detach().numpy() for m in optimizer.master_parameters()],
                [m.detach().numpy() for m in masters], bound,
                f"bfloat16 master weights epoch {epoch}", digests)
    digests.verify()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ddp_scale_loss_gold() -> None:
    """torch's DistributedDataParallel (gloo) averages the ranks' gradients; scale_loss
    weights each rank's loss by its samples, so the average is the global mean."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a torch.distributed process group is in use already"
    port = WORLD.bcast(free_port() if rt.rank() == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rt.rank(), world_size=rt.size())
    try:
        inputs, targets = dataset()
        balancer = balanced()
        sampler = rt.BalancedBatchSampler(samples(), balancer, seed=SEED)
        reference = torch_model()
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR,
                                              momentum=MOMENTUM)
        model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(reference))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        digests = Digests()
        gradient_max, steps = 0.0, 0
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            batches = Prefetched(sampler, ahead=rt.rank() % 2)
            for step, part in enumerate(global_batches(epoch, "pad")):
                mine = batches.next()
                report_speed(balancer, steps, len(mine))
                optimizer.zero_grad()
                scale_loss(mse(model, inputs[mine], targets[mine]), balancer).backward()
                optimizer.step()
                balancer.step()
                reference_optimizer.zero_grad()
                mse(reference, inputs[part], targets[part]).backward()
                gradient_max = max(gradient_max, max(float(p.grad.abs().max())
                                                     for p in reference.parameters()))
                reference_optimizer.step()
                steps += 1
            compare([p.detach().numpy() for p in model.module.parameters()],
                    [p.detach().numpy() for p in reference.parameters()],
                    tolerance(steps, gradient_max), f"DDP epoch {epoch}", digests)
        digests.verify()
    finally:
        dist.destroy_process_group()


def torch_checks() -> None:
    for kind in TORCH_KINDS:
        check(lambda k=kind: torch_gold(k), name=f"gold_{kind}")
    check(lambda: torch_gold("torch", passes=2), name="gold_torch_passes2")
    check(lambda: torch_gold("sharded", passes=2), name="gold_sharded_passes2")
    check(lambda: torch_gold("torch", mode="exact"), name="gold_torch_exact_epochs_with_join")
    check(pruned_gold, name="gold_torch_pruning_masks")
    check(bfloat16_master_gold, name="gold_bfloat16_master_weights")
    check(ddp_scale_loss_gold, name="gold_ddp_scale_loss")


# --------------------------------------------------------------------------- numpy

class Linear:
    """``x @ w + b`` with the gradient of the mean squared error, in numpy."""

    def __init__(self):
        generator = rng(0, "linear")
        self.params = {"w": generator.standard_normal((FEATURES, OUTPUTS)).astype(np.float32),
                       "b": np.zeros(OUTPUTS, np.float32)}
        self.grads = {name: np.zeros_like(p) for name, p in self.params.items()}

    def backward(self, x: np.ndarray, y: np.ndarray, ready=None) -> None:
        residual = (x @ self.params["w"] + self.params["b"] - y) * np.float32(2 / y.size)
        self.grads["b"] += residual.sum(axis=0)
        if ready:
            ready("b")
        self.grads["w"] += x.T @ residual
        if ready:
            ready("w")


class SGD:
    def __init__(self, params: dict, grads: dict):
        self.params, self.grads = params, grads

    def step(self) -> None:
        for name, parameter in self.params.items():
            parameter -= np.float32(LR) * self.grads[name]

    def zero_grad(self) -> None:
        for gradient in self.grads.values():
            gradient[...] = 0


def numpy_gold(sharded_state: bool) -> None:
    inputs, targets = dataset()
    balancer = balanced()
    sampler = rt.BalancedBatchSampler(samples(), balancer, seed=SEED)
    reference, model = Linear(), Linear()
    reference_sgd = SGD(reference.params, reference.grads)
    triples = [(name, model.params[name], model.grads[name]) for name in ("w", "b")]
    if sharded_state:
        optimizer = rt.ShardedOptimizer(SGD, triples, balance=balancer)
    else:
        optimizer = rt.DistributedOptimizer(SGD(model.params, model.grads), triples,
                                            fusion_threshold=0, balance=balancer)
    digests = Digests()
    gradient_max, steps = 0.0, 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        batches = Prefetched(sampler, ahead=rt.rank() % 2)
        for step, part in enumerate(global_batches(epoch, "pad")):
            mine = batches.next()
            report_speed(balancer, steps + step, len(mine))
            optimizer.zero_grad()
            model.backward(inputs[mine], targets[mine], ready=optimizer.mark_ready)
            optimizer.step()
            reference_sgd.zero_grad()
            reference.backward(inputs[part], targets[part])
            gradient_max = max(gradient_max, max(float(np.abs(g).max())
                                                 for g in reference.grads.values()))
            reference_sgd.step()
        steps += len(global_batches(epoch, "pad"))
        # Plain SGD: no momentum to double the error; the bound is looser than needed.
        compare(list(model.params.values()), list(reference.params.values()),
                tolerance(steps, gradient_max), f"numpy epoch {epoch}", digests)
    digests.verify()


if torch is not None:
    torch_checks()
check(lambda: numpy_gold(False), name="gold_numpy_distributed")
check(lambda: numpy_gold(True), name="gold_numpy_sharded")


if __name__ == "__main__":
    main()
