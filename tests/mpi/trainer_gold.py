"""The gold check of data parallelism, on any number of ranks.

N ranks, each training on its shard of a global batch with a DistributedOptimizer, end
every step with the parameters one process gets by training on the whole global batch
(within float tolerance), and bit-identical to each other. Checked for PyTorch and for
the numpy protocol, fused and unfused, overlapped or not, with several backward passes
per step, and with fp16/bf16 compression.

Run: mpiexec -n K python tests/mpi/trainer_gold.py [--only SUBSTRING]
"""

from __future__ import annotations

import copy

import numpy as np

import ringtrain as rt
from _harness import Digests, check, main, rng

try:
    import torch
except ImportError:  # the numpy checks still run
    torch = None

GLOBAL_BATCH = 24           # divisible by 1, 2, 3, 4 ranks times 2 micro-batches
STEPS = 4
LR = 0.1
UNIT_ROUNDOFF = {"none": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
COMPRESSION = {"none": rt.Compression.none, "fp16": rt.Compression.fp16,
               "bf16": rt.Compression.bf16}
# Bucket settings: fused into several small buckets, and one allreduce per tensor.
FUSION = {"fused": dict(fusion_threshold=300, first_bucket_bytes=100),
          "unfused": dict(fusion_threshold=0)}


def global_data(step: int) -> tuple[np.ndarray, np.ndarray]:
    generator = rng(0, "data", step)
    inputs = generator.standard_normal((GLOBAL_BATCH, 6)).astype(np.float32)
    targets = generator.standard_normal((GLOBAL_BATCH, 3)).astype(np.float32)
    return inputs, targets


def my_shard(array: np.ndarray) -> np.ndarray:
    share = len(array) // rt.size()
    return array[rt.rank() * share:(rt.rank() + 1) * share]


def tolerance(compression: str, gradient_max: float) -> float:
    """How far the distributed parameters may be from the single-process ones.

    Uncompressed, only the order of float32 additions differs: a few ulps of the
    parameters (about 0.5 here, ulp 6e-8). Compressed, each step's averaged gradient is
    off by at most 2·N·u·max|g| (each rank's value and each of the N-1 partial sums
    rounded once to the 16-bit format, u its unit roundoff); the update multiplies that
    by the learning rate, and momentum adds up to 1/(1-0.5) = 2 of it per step; a factor
    2 covers the change of later gradients caused by earlier errors. Summed over the
    steps.
    """
    per_step = 2 * rt.size() * UNIT_ROUNDOFF[compression] * gradient_max * LR * 2 * 2
    return 1e-6 + STEPS * per_step


# --------------------------------------------------------------------------- PyTorch

def torch_model() -> torch.nn.Module:
    torch.manual_seed(7)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
              torch.nn.Linear(8, 3)]
    return torch.nn.Sequential(*layers)


def torch_step(model, optimizer, inputs, targets, passes: int) -> None:
    optimizer.zero_grad()
    for part_x, part_y in zip(np.array_split(inputs, passes), np.array_split(targets, passes)):
        prediction = model(torch.from_numpy(part_x))
        loss = torch.nn.functional.mse_loss(prediction, torch.from_numpy(part_y)) / passes
        loss.backward()
    optimizer.step()


def torch_gold(fusion: str, passes: int, compression: str) -> None:
    reference = torch_model()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.5)
    model = copy.deepcopy(reference)
    optimizer = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5),
        named_parameters=model.named_parameters(), backward_passes_per_step=passes,
        compression=COMPRESSION[compression], **FUSION[fusion])
    if fusion == "fused":
        assert len(optimizer.reducer.buckets) >= 3, optimizer.reducer
    digests = Digests()
    gradient_max = 0.0
    for step in range(STEPS):
        inputs, targets = global_data(step)
        torch_step(reference, reference_optimizer, inputs, targets, passes)
        gradient_max = max(gradient_max, max(float(p.grad.abs().max())
                                             for p in reference.parameters()))
        torch_step(model, optimizer, my_shard(inputs), my_shard(targets), passes)
        bound = tolerance(compression, gradient_max)
        for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
            error = float((mine.detach() - theirs.detach()).abs().max())
            assert error <= bound, f"step {step} {name}: off by {error:.3g} > {bound:.3g}"
            digests.add(f"step {step} {name}", mine.detach().numpy())
    digests.verify()


def torch_checks() -> None:
    for fusion in FUSION:
        for passes in (1, 2):
            for compression in COMPRESSION:
                if passes == 2 and compression != "none":
                    continue
                check(lambda f=fusion, p=passes, c=compression: torch_gold(f, p, c),
                      name=f"torch_{fusion}_passes{passes}_{compression}")


# --------------------------------------------------------------------------- numpy

class NumpyMLP:
    """6 -> 8 -> 3 with tanh, mean squared error; gradients written into fixed arrays."""

    def __init__(self) -> None:
        generator = rng(0, "numpy model")
        self.params = {
            "w1": generator.standard_normal((6, 8)).astype(np.float32) * 0.4,
            "b1": np.zeros(8, np.float32),
            "w2": generator.standard_normal((8, 3)).astype(np.float32) * 0.4,
            "b2": np.zeros(3, np.float32),
        }
        self.grads = {name: np.zeros_like(p) for name, p in self.params.items()}

    def backward(self, x: np.ndarray, y: np.ndarray, scale: float,
                 ready=lambda name: None) -> None:
        """Adds the gradient of scale·mean squared error to the gradient arrays."""
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
    """The small optimizer of the numpy protocol: step() reads gradients, updates params."""

    def __init__(self, params: dict, grads: dict, lr: float, momentum: float):
        self.params, self.grads, self.lr, self.momentum = params, grads, lr, momentum
        self.velocity = {name: np.zeros_like(p) for name, p in params.items()}

    def zero_grad(self) -> None:
        for gradient in self.grads.values():
            gradient[...] = 0

    def step(self) -> None:
        for name, parameter in self.params.items():
            self.velocity[name] = self.momentum * self.velocity[name] + self.grads[name]
            parameter -= self.lr * self.velocity[name]


def numpy_step(model, optimizer, x, y, passes: int, overlap: bool) -> None:
    optimizer.zero_grad()
    for part_x, part_y in zip(np.array_split(x, passes), np.array_split(y, passes)):
        ready = optimizer.mark_ready if overlap else (lambda name: None)
        model.backward(part_x, part_y, 1.0 / passes, ready)
    optimizer.step()


def numpy_gold(fusion: str, passes: int, compression: str, overlap: bool) -> None:
    reference, model = NumpyMLP(), NumpyMLP()
    reference_optimizer = MomentumSGD(reference.params, reference.grads, LR, 0.5)
    optimizer = rt.DistributedOptimizer(
        MomentumSGD(model.params, model.grads, LR, 0.5),
        named_parameters=[(n, p, model.grads[n]) for n, p in model.params.items()],
        backward_passes_per_step=passes, compression=COMPRESSION[compression],
        **FUSION[fusion])
    digests = Digests()
    gradient_max = 0.0
    for step in range(STEPS):
        x, y = global_data(step)
        numpy_step(reference, reference_optimizer, x, y, passes, overlap=False)
        gradient_max = max(gradient_max, max(float(np.abs(g).max())
                                             for g in reference.grads.values()))
        numpy_step(model, optimizer, my_shard(x), my_shard(y), passes, overlap)
        bound = tolerance(compression, gradient_max)
        for name, mine in model.params.items():
            error = float(np.abs(mine - reference.params[name]).max())
            assert error <= bound, f"step {step} {name}: off by {error:.3g} > {bound:.3g}"
            digests.add(f"step {step} {name}", mine)
    digests.verify()


def numpy_checks() -> None:
    for fusion in FUSION:
        for passes in (1, 2):
            for compression in COMPRESSION:
                for overlap in (False, True):
                    if (passes == 2 or overlap) and compression != "none":
                        continue
                    check(lambda f=fusion, p=passes, c=compression, o=overlap:
                          numpy_gold(f, p, c, o),
                          name=f"numpy_{fusion}_passes{passes}_{compression}"
                               f"{'_overlap' if overlap else ''}")


numpy_checks()
if torch is not None:
    torch_checks()

if __name__ == "__main__":
    rt.init()
    main()
