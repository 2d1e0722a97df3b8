"""Which weights to prune: masks from weights by a norm of groups, per layer or globally.

Every weight tensor is cut into groups, each scored by a norm of its weights; the
lowest-scored groups are pruned until the target share of the elements is reached. The
methods differ in their groups:

- ``"magnitude"``: every element alone, scored by its absolute value (L1, unstructured);
- ``"group_l2"``: runs of ``group_size`` consecutive elements along the last dimension
  (the last run of a row may be shorter), scored by their L2 norm;
- ``"structured"``: the slices along dimension 0 (a convolution's filters, a linear
  layer's output rows), scored by their L``norm`` norm.

A group's score is its norm divided by ``elements ** (1 / p)`` (the p-mean of its
magnitudes), so that groups of different sizes compare fairly when the target is global
(``scope="global"``: one ranking over all layers; ``"layer"``: each layer reaches the
target on its own). Groups already pruned rank first, so masks only ever lose
elements. The selection is a stable sort of float64 scores: the same weights give the
same masks on every rank and every run.

Targets count elements: the pruned groups are the longest prefix of the ranking whose
elements do not exceed ``round(sparsity * elements)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..collectives.errors import InvalidArgumentError

METHODS = ("magnitude", "group_l2", "structured")
SCOPES = ("global", "layer")


def check_method(method: str, scope: str, group_size: int, norm: float) -> None:
    """Raise InvalidArgumentError unless the method's arguments are valid."""
    if method not in METHODS:
        raise InvalidArgumentError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if scope not in SCOPES:
        raise InvalidArgumentError(f"scope must be one of {', '.join(SCOPES)}; got {scope!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise InvalidArgumentError(f"group_size must be an integer >= 1, got {group_size!r}")
    if not isinstance(norm, (int, float)) or isinstance(norm, bool) or not norm >= 1:
        raise InvalidArgumentError(f"norm must be a number >= 1, got {norm!r}")


def group_ids(shape: tuple[int, ...], method: str, group_size: int) -> np.ndarray:
    """The group of each element of a tensor of ``shape``, as an int64 array of that shape."""
    count = int(np.prod(shape, dtype=np.int64))
    if method == "magnitude" or not shape:
        return np.arange(count, dtype=np.int64).reshape(shape)
    if method == "structured":
        return np.repeat(np.arange(shape[0], dtype=np.int64),
                         count // max(shape[0], 1)).reshape(shape)
    columns = shape[-1]
    runs = -(-columns // group_size)
    rows = np.arange(count // max(columns, 1), dtype=np.int64)[:, None]
    ids = rows * runs + (np.arange(columns, dtype=np.int64) // group_size)[None, :]
    return ids.reshape(shape)


def compute_masks(weights: Sequence[np.ndarray], previous: Sequence[np.ndarray],
                  sparsity: float, method: str = "magnitude", scope: str = "global",
                  group_size: int = 4, norm: float = 2.0) -> list[np.ndarray]:
    """New masks (True: kept) for ``weights`` at ``sparsity``.

    Args:
        weights: the weight tensors (any real dtype; scored in float64).
        previous: their current masks (bool, True: kept); pruned elements stay pruned.
        sparsity: the target share of pruned elements, in [0, 1).
        method, scope, group_size, norm: see the module's description (``norm`` is the
            p of ``"structured"``; ``"magnitude"`` uses 1 and ``"group_l2"`` 2).

    Returns:
        One bool array per weight, of its shape, each a subset of its previous mask.
    """
    check_method(method, scope, group_size, norm)
    p = {"magnitude": 1.0, "group_l2": 2.0}.get(method, float(norm))
    ids = [group_ids(w.shape, method, group_size) for w in weights]
    scored = [_group_scores(np.asarray(w, np.float64), i, m, p)
              for w, i, m in zip(weights, ids, previous)]
    if scope == "global":
        scores = np.concatenate([s for s, _ in scored]) if scored else np.empty(0)
        sizes = np.concatenate([n for _, n in scored]) if scored else np.empty(0, np.int64)
        pruned = _lowest_groups(scores, sizes, sparsity)
        bounds = np.cumsum([0] + [len(s) for s, _ in scored])
        per_layer = [pruned[bounds[k]:bounds[k + 1]] for k in range(len(scored))]
    else:
        per_layer = [_lowest_groups(s, n, sparsity) for s, n in scored]
    return [~groups[i] & m for groups, i, m in zip(per_layer, ids, previous)]


def _group_scores(weight: np.ndarray, ids: np.ndarray, mask: np.ndarray,
                  p: float) -> tuple[np.ndarray, np.ndarray]:
    """Each group's p-mean magnitude (-inf when all its elements are pruned) and size."""
    flat_ids = ids.reshape(-1)
    groups = int(flat_ids.max()) + 1 if flat_ids.size else 0
    sizes = np.bincount(flat_ids, minlength=groups).astype(np.int64)
    powered = np.abs(weight.reshape(-1)) ** p
    means = np.bincount(flat_ids, weights=powered, minlength=groups) / np.maximum(sizes, 1)
    scores = means ** (1.0 / p)
    kept = np.bincount(flat_ids, weights=mask.reshape(-1).astype(np.float64), minlength=groups)
    scores[kept == 0] = -np.inf
    return scores, sizes


def _lowest_groups(scores: np.ndarray, sizes: np.ndarray, sparsity: float) -> np.ndarray:
    """Which groups to prune: the longest prefix of the stable ranking by score whose
    elements do not exceed ``round(sparsity * elements)``."""
    target = int(round(sparsity * int(sizes.sum())))
    order = np.argsort(scores, kind="stable")
    taken = int(np.searchsorted(np.cumsum(sizes[order]), target, side="right"))
    pruned = np.zeros(len(scores), bool)
    pruned[order[:taken]] = True
    return pruned
