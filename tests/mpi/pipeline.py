"""The pipeline trainer against one process training the whole model on the global batch.

Run: mpiexec -n K python tests/mpi/pipeline.py [--only SUBSTRING]

Every split the world size allows (stages × replicas = K), both schedules, micro-batch
counts that do and do not divide the batch. The models are float64: the pipeline
computes the same operations as the reference, except that the gradients of the
micro-batches are summed one by one (and, with replicas, averaged across ranks) instead
of in one matrix product over the whole batch, and the loss is a weighted sum of the
micro-batches' means. That reorders additions of ~20 terms per gradient element, an
error of a few units in the last place (~1e-16 relative) per step; over 3 steps of SGD
with momentum and values of order 1 a tolerance of 1e-10 is ample, and a wrong
schedule, a missing micro-batch or a gradient averaged over the wrong ranks is off by
1e-3 or more.
"""

from __future__ import annotations

import numpy as np
import torch

import ringtrain as rt
from ringtrain.pipeline import (PipelineTrainer, balanced_split, parameter_costs,
                                peak_in_flight, schedule)
from _harness import check, expect_raises, main

torch.set_num_threads(1)
WIDTHS = [5, 9, 7, 6, 4, 3]
LOCAL_BATCH = 11
STEPS = 3
TOLERANCE = 1e-10


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(1234)
    layers: list[torch.nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).double()  # 9 layers


def batches(replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(99)
    total = LOCAL_BATCH * replicas
    return [(torch.randn(total, WIDTHS[0], generator=generator, dtype=torch.float64),
             torch.randn(total, WIDTHS[-1], generator=generator, dtype=torch.float64))
            for _ in range(STEPS)]


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(replicas: int) -> tuple[torch.nn.Sequential, list[float]]:
    """One process, the whole model, the global batch."""
    model = build_model()
    optimizer = sgd(model.parameters())
    losses = []
    for x, y in batches(replicas):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return model, losses


def train(trainer: PipelineTrainer, replicas: int) -> list[float]:
    replica = trainer.layout.replica
    losses = []
    for x, y in batches(replicas):
        rows = slice(replica * LOCAL_BATCH, (replica + 1) * LOCAL_BATCH)
        losses.append(trainer.train_step(x[rows], y[rows]))
    return losses


def assert_matches(trainer: PipelineTrainer, expected: torch.nn.Sequential,
                   losses: list[float], expected_losses: list[float], what: str) -> None:
    bounds = [0, *trainer.split_points, len(expected)]
    stage = trainer.layout.stage
    mine = torch.nn.Sequential(*list(expected)[bounds[stage]:bounds[stage + 1]])
    for (name, got), (_, want) in zip(trainer.module.named_parameters(),
                                      mine.named_parameters()):
        difference = float((got - want).detach().abs().max())
        assert difference <= TOLERANCE, f"{what}: parameter {name} off by {difference}"
    assert np.allclose(losses, expected_losses, rtol=TOLERANCE, atol=0), \
        f"{what}: losses {losses}, expected {expected_losses}"


def splits() -> list[int]:
    return [s for s in range(1, rt.size() + 1) if rt.size() % s == 0]


@check
def gold_every_split_schedule_and_microbatch_count():
    for stages in splits():
        replicas = rt.size() // stages
        expected, expected_losses = reference(replicas)
        points = balanced_split([1.0] * len(expected), stages)
        for kind in ("gpipe", "1f1b"):
            for microbatches in (1, 3, 4):
                trainer = PipelineTrainer(build_model(), sgd, torch.nn.functional.mse_loss,
                                          stages=stages, split_points=points,
                                          microbatches=microbatches, schedule=kind)
                losses = train(trainer, replicas)
                assert_matches(trainer, expected, losses, expected_losses,
                               f"{stages} stages × {replicas}, {kind}, {microbatches} micro")


@check
def activations_held_by_each_schedule():
    stages = rt.size()
    for kind, microbatches in (("1f1b", 8), ("1f1b", 2), ("gpipe", 8)):
        trainer = PipelineTrainer(build_model(), sgd, torch.nn.functional.mse_loss,
                                  microbatches=microbatches, schedule=kind)
        train(trainer, 1)
        stage = trainer.layout.stage
        held = trainer.peak_activations
        if kind == "gpipe":
            assert held == microbatches, (kind, held)
        else:
            assert held == min(stages - stage, microbatches) <= stages, (kind, stage, held)
        assert held == peak_in_flight(schedule(kind, stage, stages, microbatches))


@check
def stages_as_a_list_built_on_their_own_rank():
    built = []

    def stage_builder(index: int, layers: list[torch.nn.Module]):
        def build() -> torch.nn.Module:
            built.append(index)
            return torch.nn.Sequential(*layers)
        return build

    model = list(build_model())
    points = balanced_split([1.0] * len(model), rt.size())
    bounds = [0, *points, len(model)]
    specs = [stage_builder(s, model[bounds[s]:bounds[s + 1]]) for s in range(rt.size())]
    trainer = PipelineTrainer(specs, sgd, torch.nn.functional.mse_loss, microbatches=3)
    assert built == [rt.rank()], built
    trainer.split_points = points
    expected, expected_losses = reference(1)
    assert_matches(trainer, expected, train(trainer, 1), expected_losses, "list of stages")
    # eval: the loss on every rank, outputs on the last stage.
    x, y = batches(1)[0]
    loss = trainer.eval(x, y)
    assert abs(loss - float(torch.nn.functional.mse_loss(expected(x), y).detach())) < TOLERANCE
    outputs = trainer.eval(x)
    if trainer.layout.last:
        assert torch.allclose(outputs, expected(x).detach(), atol=TOLERANCE, rtol=0)
    else:
        assert outputs is None


@check
def automatic_split_is_balanced_and_the_same_everywhere():
    stages = rt.size()
    model = build_model()
    trainer = PipelineTrainer(model, sgd, torch.nn.functional.mse_loss, stages=stages)
    assert trainer.split_points == balanced_split(parameter_costs(list(model)), stages)
    x, y = batches(1)[0]
    timed = PipelineTrainer(build_model(), sgd, torch.nn.functional.mse_loss, stages=stages,
                            sample=x)
    everyone = rt.allgather_object(timed.split_points)
    assert all(points == everyone[0] for points in everyone), everyone
    assert len(timed.split_points) == stages - 1
    expected, expected_losses = reference(1)
    assert_matches(timed, expected, train(timed, 1), expected_losses, "automatic split")


class WidthByRows(torch.nn.Module):
    """Returns 3 columns for micro-batches with an odd number of rows, else 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3] if x.shape[0] % 2 else x[:, :4]


@check
def errors_on_every_rank_then_usable():
    k = rt.size()
    expect_raises(rt.InvalidArgumentError, PipelineTrainer, build_model(), sgd,
                  torch.nn.functional.mse_loss, stages=k + 1, match=["do not divide"])
    expect_raises(rt.InvalidArgumentError, PipelineTrainer,
                  torch.nn.Sequential(*[torch.nn.Tanh()] * (k - 1 or 0)), sgd,
                  torch.nn.functional.mse_loss, stages=k,
                  match=[f"cannot be split into {k} stages"])
    expect_raises(rt.InvalidArgumentError, PipelineTrainer, build_model(), sgd,
                  torch.nn.functional.mse_loss, stages=k, split_points=[0] * (k - 1) + [3],
                  match=["cannot split"])
    # The first stage's output changes width: every rank raises, no parameter moves.
    stages = [WidthByRows()] + [torch.nn.Linear(4, 4).double() for _ in range(k - 1)]
    trainer = PipelineTrainer(stages, sgd, torch.nn.functional.mse_loss, microbatches=2)
    before = [p.detach().clone() for p in trainer.module.parameters()]
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    expect_raises(rt.UsageError, trainer.train_step, x, y,
                  match=["stage 0 (rank 0) output shape changed", "micro-batch 1"])
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.module.parameters()))
    loss = trainer.train_step(x[:4], y[:4])  # two rows per micro-batch: 4 columns
    assert np.isfinite(loss)


if __name__ == "__main__":
    main()
