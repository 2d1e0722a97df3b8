"""The trainer with gradients in device memory: packed on the device, reduced on the GPUs
through IPC (or through pinned host memory, or by a CUDA-aware MPI), unpacked on the
device; identical bits to the same training with host gradients. Runs under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) or on a GPU.

Run: NUMBA_ENABLE_CUDASIM=1 mpiexec -n K python tests/mpi/trainer_device.py
"""

from __future__ import annotations

import os
import warnings

import numpy as np
from numba import cuda

try:
    import torch
except ImportError:
    torch = None

import ringtrain as rt
from ringtrain.kernels.device import SIMULATED
from _harness import Digests, check, configured, expect_raises, main, rng

AWARE = os.environ.get("RINGTRAIN_CUDA_AWARE_MPI") == "1"
# auto reduces device tensors through IPC at every size here, so small arrays test it
os.environ.setdefault("RINGTRAIN_IPC_MIN_BYTES", "0")
LR = 0.25
SHAPES = [(3, 4), (4,), (7,), (2, 5), (1,)]


class DeviceSGD:
    """The numpy protocol over device gradients: step() reads them back to update."""

    def __init__(self, params: list[np.ndarray], grads: list):
        self.params, self.grads = params, grads

    def step(self) -> None:
        for parameter, gradient in zip(self.params, self.grads):
            parameter -= LR * (gradient.copy_to_host()
                               if not isinstance(gradient, np.ndarray) else gradient)


def gradients_of(rank: int, step: int) -> list[np.ndarray]:
    generator = rng(rank, "device gradients", step)
    return [generator.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def train(on_device: bool, steps: int, **options) -> list[np.ndarray]:
    params = [np.ones(shape, np.float32) for shape in SHAPES]
    host_grads = [np.zeros(shape, np.float32) for shape in SHAPES]
    grads = [cuda.to_device(g) for g in host_grads] if on_device else host_grads
    optimizer = rt.DistributedOptimizer(
        DeviceSGD(params, grads),
        [(f"p{i}", p, g) for i, (p, g) in enumerate(zip(params, grads))], **options)
    for step in range(steps):
        for gradient, value in zip(grads, gradients_of(rt.rank(), step)):
            if on_device:
                gradient.copy_to_device(value)
            else:
                gradient[...] = value
        for index in (4, 3, 1):  # some marked early, in no particular order
            optimizer.mark_ready(f"p{index}")
        optimizer.step()
    return params


def compare(options: dict, what: str) -> None:
    # Device buckets that MPI does not reduce (staged mode, or compressed) are reduced on
    # the GPUs through IPC, in the ring's order: the host run takes the ring too.
    through_ipc = rt.size() > 1 and (not AWARE or "compression" in options)
    with configured(allreduce_algorithm="ring" if through_ipc else "auto"):
        on_host = train(False, 3, **options)
    on_device = train(True, 3, **options)
    digests = Digests()
    for index, (host, device) in enumerate(zip(on_host, on_device)):
        assert np.array_equal(host, device), f"{what} p{index}: device run differs"
        digests.add(f"{what} p{index}", device)
    digests.verify()
    expected = [np.ones(s, np.float32) for s in SHAPES]
    for step in range(3):
        everyone = [gradients_of(r, step) for r in range(rt.size())]
        for index in range(len(SHAPES)):
            expected[index] -= LR * np.mean([e[index] for e in everyone], axis=0)
    for index, device in enumerate(on_device):
        tolerance = 2e-3 if "compression" in options else 1e-6
        np.testing.assert_allclose(device, expected[index], rtol=tolerance, atol=tolerance)


@check
def device_gradients_fused():
    compare(dict(fusion_threshold=64, first_bucket_bytes=8), "fused")


@check
def device_gradients_unfused():
    compare(dict(fusion_threshold=0), "unfused")


@check
def device_gradients_fp16():
    compare(dict(fusion_threshold=64, compression=rt.Compression.fp16), "fp16")


@check
def device_gradients_not_marked_become_device_zeros():
    grads = [cuda.to_device(np.full(shape, 2.0, np.float32)) for shape in SHAPES]
    reducer = rt.GradientReducer([(f"p{i}", g) for i, g in enumerate(grads)])
    reducer.mark_ready(0, grads[0])
    expect_raises(rt.UsageError, reducer.wait, match=["'p1', 'p2', 'p3', 'p4'"])
    assert np.all(grads[0].copy_to_host() == 2.0)


@check
def device_gradients_with_the_loss_scaler():
    params = [np.ones(shape, np.float32) for shape in SHAPES]
    grads = [cuda.to_device(np.full(shape, 8.0, np.float32)) for shape in SHAPES]
    optimizer = rt.DistributedOptimizer(
        DeviceSGD(params, grads),
        [(f"p{i}", p, g) for i, (p, g) in enumerate(zip(params, grads))])
    scaler = rt.DynamicLossScaler(init_scale=4.0)
    assert scaler.step(optimizer)
    for parameter in params:
        np.testing.assert_array_equal(parameter, 1.0 - LR * 2.0)
    for gradient in grads:
        gradient.copy_to_device(np.full(gradient.shape, np.inf, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rt.NonFiniteWarning)
        assert scaler.step(optimizer) is False
    assert scaler.loss_scale == 2.0


def torch_cuda_matches_cpu():
    """A PyTorch model on the GPU trains to the parameters of the same model on the CPU."""
    models = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 2)).to(device)
        optimizer = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                            named_parameters=model.named_parameters(),
                                            fusion_threshold=256, first_bucket_bytes=64)
        for step in range(3):
            generator = rng(rt.rank(), "torch batch", step)
            x = torch.from_numpy(generator.standard_normal((4, 6)).astype(np.float32))
            y = torch.from_numpy(generator.standard_normal((4, 2)).astype(np.float32))
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            optimizer.step()
        models[device] = [p.detach().cpu().numpy() for p in model.parameters()]
        optimizer.remove_hooks()
    digests = Digests()
    for index, (on_cpu, on_gpu) in enumerate(zip(models["cpu"], models["cuda"])):
        np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-5, atol=1e-6)
        digests.add(f"parameter {index}", on_gpu)
    digests.verify()


if not SIMULATED and torch is not None and torch.cuda.is_available():
    check(torch_cuda_matches_cpu)


if __name__ == "__main__":
    rt.init()
    main()
