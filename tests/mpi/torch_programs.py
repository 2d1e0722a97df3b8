"""The torch.distributed programs people run, on "ringtrain" and on gloo in the same
processes: the examples' DDP, FSDP2, checkpoint, Lightning and Accelerate scripts (and,
with 4 ranks, the 2-D DeviceMesh one) must end with the same weights on both backends.

Tolerance: with 2 ranks a sum of two values is the same whichever rank adds it, and
both backends average the same way, so the weights must be bit-identical. With more
ranks the two backends add the ranks' float32 values in different orders: each sum may
differ in its last bit (a relative 6e-8), and a few dozen optimizer steps carry such
differences on, so the weights are compared to 1e-5 relative, 1e-6 absolute.

Run: mpiexec -n K python tests/mpi/torch_programs.py [--only SUBSTRING]
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import ringtrain as rt
import ringtrain.torch  # noqa: F401 (registers the "ringtrain" backend)
from _harness import WORLD, check, expect_raises, main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_same_weights(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor],
                        what: str, rtol: float | None = None, atol: float = 1e-6) -> None:
    assert ours.keys() == theirs.keys(), f"{what}: {sorted(ours)} vs {sorted(theirs)}"
    exact = rtol is None and WORLD.Get_size() <= 2
    rtol = 1e-5 if rtol is None else rtol
    for name, value in ours.items():
        other = theirs[name]
        if exact:
            assert torch.equal(value, other), \
                f"{what}: {name} differs by {(value - other).abs().max().item():.3g}"
        else:
            assert torch.allclose(value, other, rtol=rtol, atol=atol), \
                f"{what}: {name} differs by {(value - other).abs().max().item():.3g}"


@contextlib.contextmanager
def gloo_groups_outliving_their_models():
    """Keep every gloo process group of the block alive until its worker threads are idle.

    torch 2.13's gloo group joins its threads in its destructor while holding the GIL,
    and a thread still dropping its last work (whose tensors are Python objects) waits
    for the GIL: a deadlock when the last reference goes with the DDP model, right after
    the last collective. Here the groups outlive the models, and go only after a pause
    that lets those threads finish.
    """
    kept = []
    destroy = dist.destroy_process_group

    def keeping(group=None):
        kept.extend(dist.distributed_c10d._world.pg_names)
        destroy(group)

    dist.destroy_process_group = keeping
    try:
        yield
    finally:
        dist.destroy_process_group = destroy
        time.sleep(0.2)  # the GIL free for gloo's threads
        kept.clear()


def on_gloo(train: Callable[..., dict[str, torch.Tensor]],
            **arguments) -> dict[str, torch.Tensor]:
    with gloo_groups_outliving_their_models():
        return train("gloo", **arguments)


def on_both(name: str, **arguments) -> None:
    module = example(name)
    theirs = on_gloo(module.train, **arguments)
    ours = module.train("ringtrain", **arguments)
    assert_same_weights(ours, theirs, name)


@check
def ddp_as_on_gloo():
    on_both("torch_ddp", epochs=2, samples=512)


@check
def ddp_with_ringtrains_compression_hooks():
    module = example("torch_ddp")
    plain = on_gloo(module.train, epochs=2, samples=512)
    for hook, tolerance in (("fp16", 2e-3), ("bf16", 2e-2)):
        compressed = module.train("ringtrain", epochs=2, samples=512, hook=hook)
        assert_same_weights(compressed, plain, f"hook {hook}", rtol=tolerance, atol=tolerance)


def ddp_with_hook(backend: str, make_hook: Callable[[], tuple]) -> dict[str, torch.Tensor]:
    """A few DDP steps of a small model with torch's communication hook ``make_hook()``
    (a ``(state, hook)`` pair, made once the group exists)."""
    dist.init_process_group(backend)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(*make_hook())
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(rt.rank())
        for _ in range(6):
            inputs = torch.randn(8, 16, generator=generator)
            optimizer.zero_grad()
            ddp(inputs).square().mean().backward()
            optimizer.step()
        return {name: value.detach().clone() for name, value in model.state_dict().items()}
    finally:
        dist.destroy_process_group()


@check
def ddp_with_torchs_own_hooks_as_on_gloo():
    """torch's fp16 hook and PowerSGD (futures chained with ``then``) give the same
    weights on both backends."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks = {"fp16_compress_hook": lambda: (None, default_hooks.fp16_compress_hook),
             "powerSGD_hook": lambda: (powerSGD_hook.PowerSGDState(
                 process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2),
                 powerSGD_hook.powerSGD_hook)}
    for name, make_hook in hooks.items():
        theirs = on_gloo(lambda backend: ddp_with_hook(backend, make_hook))
        ours = ddp_with_hook("ringtrain", make_hook)
        # float16 sums of more than two values differ in their last bit (2**-11) with
        # the order of the additions
        assert_same_weights(ours, theirs, name, **({"rtol": 2e-3, "atol": 1e-5}
                                                   if rt.size() > 2 else {}))


@check
def fsdp2_as_on_gloo():
    on_both("torch_fsdp", epochs=2, steps=6)


@check
def checkpoint_save_and_load_as_on_gloo():
    folder = tempfile.mkdtemp(prefix="ringtrain-dcp-") if rt.rank() == 0 else None
    folder = WORLD.bcast(folder, root=0)
    try:
        module = example("torch_checkpoint")
        theirs = on_gloo(module.train, steps=4, checkpoint_dir=folder + "/gloo")
        ours = module.train("ringtrain", steps=4, checkpoint_dir=folder + "/ringtrain")
        assert_same_weights(ours, theirs, "torch_checkpoint")
    finally:
        WORLD.Barrier()
        if rt.rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


@check
def lightning_trainer_as_on_gloo():
    on_both("torch_lightning", epochs=1, samples=256)


@check
def accelerate_as_on_gloo():
    on_both("torch_accelerate", epochs=1, samples=256)


@check(min_size=4)
def device_mesh_of_data_and_tensor_parallelism_as_on_gloo():
    on_both("torch_device_mesh", epochs=1, steps=4)


@check(min_size=2)
def models_that_differ_end_in_errors_not_a_hang():
    """DDP compares each rank's parameter shapes with rank 0's (an allgather), so the
    ranks whose model differs raise at once, while rank 0 goes on to broadcast its
    weights; the next call of those ranks meets that broadcast, and every rank raises."""
    dist.init_process_group("ringtrain")
    try:
        width = 4 if rt.rank() == 0 else 5
        if rt.rank() == 0:
            expect_raises(rt.MismatchError, torch.nn.parallel.DistributedDataParallel,
                          torch.nn.Linear(width, 2), match=["broadcast", "allreduce"])
        else:
            expect_raises(RuntimeError, torch.nn.parallel.DistributedDataParallel,
                          torch.nn.Linear(width, 2), match=["not to match sizes"])
            expect_raises(rt.MismatchError, dist.all_reduce, torch.ones(1),
                          match=["broadcast", "allreduce"])
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        assert tensor.item() == rt.size()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
