"""Pruning's pure parts: the gradual schedule against its formula, and the masks of each
method against direct numpy (and ``torch.nn.utils.prune``) references."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.collectives.errors import InvalidArgumentError
from ringtrain.pruning import GradualSchedule, compute_masks
from ringtrain.trainer.pruning_masks import group_ids


def test_schedule_values_equal_the_formula():
    schedule = GradualSchedule(0.9, begin_step=10, end_step=50, frequency=7,
                               initial_sparsity=0.1)
    for step in range(0, 80):
        if step < 10:
            expected = 0.0
        elif step >= 50:
            expected = 0.9
        else:
            expected = 0.9 + (0.1 - 0.9) * (1 - (step - 10) / 40) ** 3
        assert schedule.sparsity_at(step) == pytest.approx(expected, abs=1e-15)
    assert [s for s in range(80) if schedule.prunes_at(s)] == [10, 17, 24, 31, 38, 45, 50]
    cubic = GradualSchedule(0.5, 0, 4)
    assert [cubic.sparsity_at(s) for s in range(5)] == \
        pytest.approx([0.0, 0.5 * (1 - 0.75 ** 3), 0.5 * (1 - 0.5 ** 3), 0.5 * (1 - 0.25 ** 3),
                       0.5])
    assert GradualSchedule(0.8, 5, 5).prunes_at(5) and not GradualSchedule(0.8, 5, 5).prunes_at(6)


@pytest.mark.parametrize("arguments, message", [
    (dict(final_sparsity=1.0, begin_step=0, end_step=1), "final_sparsity"),
    (dict(final_sparsity=0.5, begin_step=3, end_step=1), "end_step 1 is before"),
    (dict(final_sparsity=0.5, begin_step=0, end_step=1, frequency=0), "frequency"),
    (dict(final_sparsity=0.2, begin_step=0, end_step=1, initial_sparsity=0.3), "never come"),
    (dict(final_sparsity=0.5, begin_step=-1, end_step=1), "begin_step"),
])
def test_schedule_refuses_bad_arguments(arguments, message):
    with pytest.raises(InvalidArgumentError, match=message):
        GradualSchedule(**arguments)


def weights(seed: int, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    generator = np.random.default_rng(seed)
    return [generator.standard_normal(shape).astype(np.float32) for shape in shapes]


def ones(arrays):
    return [np.ones(a.shape, bool) for a in arrays]


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.77, 0.95])
def test_global_magnitude_prunes_the_smallest_weights_of_all_layers(sparsity):
    ws = weights(1, (7, 5), (3, 11), (13,))
    masks = compute_masks(ws, ones(ws), sparsity, "magnitude", "global")
    flat = np.concatenate([np.abs(w).ravel() for w in ws])
    pruned = int(round(sparsity * flat.size))
    threshold = np.sort(flat)[pruned - 1] if pruned else -1.0
    kept = np.concatenate([m.ravel() for m in masks])
    assert np.array_equal(kept, flat > threshold)
    assert [m.shape for m in masks] == [w.shape for w in ws]


def test_layer_magnitude_equals_torch_l1_unstructured():
    torch = pytest.importorskip("torch")
    from torch.nn.utils import prune
    ws = weights(2, (9, 7), (4, 3, 5))
    masks = compute_masks(ws, ones(ws), 0.6, "magnitude", "layer")
    for w, mask in zip(ws, masks):
        expected = prune.L1Unstructured(amount=int(round(0.6 * w.size))).compute_mask(
            torch.from_numpy(w), torch.ones(w.shape))
        assert np.array_equal(mask, expected.numpy().astype(bool))


def test_structured_equals_torch_ln_structured_on_rows():
    torch = pytest.importorskip("torch")
    from torch.nn.utils import prune
    ws = weights(3, (6, 3, 3, 3), (10, 7))
    masks = compute_masks(ws, ones(ws), 0.5, "structured", "layer", norm=2)
    for w, mask in zip(ws, masks):
        expected = prune.LnStructured(amount=w.shape[0] // 2, n=2, dim=0).compute_mask(
            torch.from_numpy(w), torch.ones(w.shape))
        assert np.array_equal(mask, expected.numpy().astype(bool))


def test_group_l2_prunes_whole_runs_of_the_last_dimension_by_their_norm():
    (w,) = weights(4, (5, 10))  # runs of 4, 4 and 2 elements per row
    ids = group_ids(w.shape, "group_l2", 4)
    assert ids[0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2] and ids[1, 0] == 3
    (mask,) = compute_masks([w], ones([w]), 0.4, "group_l2", "layer", group_size=4)
    scores = {}
    for row in range(5):
        for start in (0, 4, 8):
            run = w[row, start:start + 4].astype(np.float64)
            scores[(row, start)] = np.sqrt(np.mean(run ** 2))
            assert len(set(mask[row, start:start + 4].tolist())) == 1, "a run is cut"
    pruned = {key for key in scores if not mask[key[0], key[1]]}
    assert 20 - 4 <= 50 - mask.sum() <= 20  # round(0.4 * 50): at most one run short
    assert max(scores[k] for k in pruned) < min(scores[k] for k in scores if k not in pruned)


@pytest.mark.parametrize("method", ["magnitude", "group_l2", "structured"])
@pytest.mark.parametrize("scope", ["global", "layer"])
def test_masks_only_lose_elements_and_reach_the_target(method, scope):
    ws = weights(5, (8, 6), (12, 5), (7, 3, 2))
    masks = ones(ws)
    for sparsity in (0.2, 0.5, 0.8):
        # New weights each time: what was pruned must stay pruned all the same.
        new = compute_masks(weights(int(sparsity * 10), *[w.shape for w in ws]), masks,
                            sparsity, method, scope)
        for old, mask in zip(masks, new):
            assert not np.any(mask & ~old)
        masks = new
        total = sum(m.size for m in masks)
        assert sum(m.size - m.sum() for m in masks) <= round(sparsity * total) + \
            (0 if method == "magnitude" else total)


def test_the_same_weights_give_the_same_masks_whatever_the_dtype_and_ties():
    w = np.array([[0.5, 0.5, 0.5, 0.5], [0.25, 0.25, 1.0, 1.0]], np.float64)
    first = compute_masks([w], ones([w]), 0.5, "magnitude", "global")[0]
    assert first.tolist() == [[False, False, True, True], [False, False, True, True]]
    assert np.array_equal(compute_masks([w.astype(np.float16)], ones([w]), 0.5)[0], first)


def test_bad_methods_are_refused():
    ws = weights(6, (3, 3))
    with pytest.raises(InvalidArgumentError, match="method must be one of"):
        compute_masks(ws, ones(ws), 0.5, "random")
    with pytest.raises(InvalidArgumentError, match="scope must be one of"):
        compute_masks(ws, ones(ws), 0.5, "magnitude", "model")
    with pytest.raises(InvalidArgumentError, match="group_size"):
        compute_masks(ws, ones(ws), 0.5, "group_l2", group_size=0)


def test_a_pruner_puts_torch_prune_masks_on_linear_and_conv_weights_and_refuses_bad_input():
    torch = pytest.importorskip("torch")
    from ringtrain.pruning import Pruner
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 2), torch.nn.Flatten(),
                                torch.nn.Linear(6, 4))
    pruner = Pruner(model)
    assert pruner.names == ["0.weight", "2.weight"]
    assert sorted(model.state_dict()) == ["0.bias", "0.weight_mask", "0.weight_orig",
                                          "2.bias", "2.weight_mask", "2.weight_orig"]
    assert pruner.sparsity() == 0.0 and torch.equal(model[2].weight, model[2].weight_orig)
    saved = pruner.state_dict()
    saved["masks"]["2.weight"][0] = 0
    saved["step_count"] = 7
    pruner.load_state_dict(saved)
    assert pruner.step_count == 7 and torch.all(model[2].weight_orig[0] == 0)
    assert pruner.sparsity() == pytest.approx(6 / (12 + 24))
    with pytest.raises(InvalidArgumentError, match="saved masks are for"):
        pruner.load_state_dict({"step_count": 0, "masks": {}})
    with pytest.raises(InvalidArgumentError, match="method must be one of"):
        Pruner(model, method="random")
    with pytest.raises(InvalidArgumentError, match="not a module of the model"):
        Pruner(model, parameters=[(torch.nn.Linear(2, 2), "weight")])
    with pytest.raises(InvalidArgumentError, match="has no parameter 'scale'"):
        Pruner(model, parameters=[(model[2], "scale")])
    with pytest.raises(InvalidArgumentError, match="nothing to prune"):
        Pruner(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(InvalidArgumentError, match="schedule must be a GradualSchedule"):
        Pruner(model, schedule=0.8)


def test_masks_handed_to_an_optimizer_are_checked():
    torch = pytest.importorskip("torch")
    from ringtrain.trainer.torch_optimizer import host_masks

    weight, bias = torch.zeros(2, 3), torch.zeros(3)
    named = [("weight", weight), ("bias", bias)]
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 2.0]])
    arrays = host_masks([(weight, mask), (bias, None)], named, "steps")
    assert arrays[1] is None
    assert arrays[0].tolist() == [[True, False, True], [False, False, True]]
    with pytest.raises(InvalidArgumentError, match="shape \\(4,\\) is not one this optimizer "
                                                   "steps"):
        host_masks([(torch.zeros(4), None)], named, "steps")
    with pytest.raises(InvalidArgumentError, match="'bias'.*mask has shape \\(2,\\)"):
        host_masks([(bias, torch.ones(2))], named, "steps")
    elsewhere = torch.zeros(3, device="meta")
    with pytest.raises(InvalidArgumentError, match="'far'.*on meta.*host memory"):
        host_masks([(elsewhere, torch.tensor([1.0, 0.0, 1.0]))], [("far", elsewhere)], "steps")
    assert host_masks([(elsewhere, torch.ones(3))], [("far", elsewhere)], "steps")[0].all()
