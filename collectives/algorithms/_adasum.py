"""Adasum allreduce: Horovod's adaptive summation, by recursive vector halving and
distance doubling (the schedule of Horovod's CPU Adasum).

Two vectors combine as ``adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b``,
a coefficient being 1 when its vector's squared norm is below 1e-8 (as Horovod). With
several tensors in one buffer (a grouped allreduce), each tensor has its own
coefficients: its dot product and norms are summed over its own elements only.

Schedule, p ranks, p2 the largest power of two <= p, rem = p - p2:

1. Fold (only when p is not a power of two): among the first 2*rem ranks, each even
   rank sends its whole vector to the odd rank after it, which combines the pair
   (even as ``a``, odd as ``b``); the even rank sits out. The p2 remaining ranks are
   renumbered 0..p2-1 as in ``_recursive_doubling``.
2. Halving, level k = 0 .. lg(p2)-1, distance d = 2^k: new rank r pairs with r ^ d. Both
   hold the same segment of their own vectors (the whole vector at level 0); the rank
   with bit k clear keeps the first half and sends the second, its partner the reverse.
   Each now holds one piece of both vectors being combined: ``a``, the combination of
   the block of 2^k ranks with bit k clear, and ``b``, of the block with bit k set. Its
   pieces' a.b, |a|^2 and |b|^2 (float64, per tensor) are summed over the 2^(k+1) ranks
   that hold pieces of the same a and b (recursive doubling on those ranks: every one
   gets the same sums), and it combines its piece. After lg(p2) levels each rank holds
   1/p2 of the result, computed there only.
3. Allgather, k = lg(p2)-1 .. 0: partners swap their pieces, doubling the segment.
4. Unfold: each odd rank of the first 2*rem sends the result to its even rank.

The tree this defines: for a power of two, Horovod's, pairs (0, 1), (2, 3), ... then
pairs of those; otherwise the folded pairs (0, 1), ..., (2 rem - 2, 2 rem - 1) come first
and take their places as new ranks. p = 3: adasum(adasum(v0, v1), v2); p = 5:
adasum(adasum(adasum(v0, v1), v2), adasum(v3, v4)); p = 6: adasum(adasum(adasum(v0, v1),
adasum(v2, v3)), adasum(v4, v5)).

Cost, n bytes: level k sends n/2^(k+1) bytes and reduces 3 numbers over 2^(k+1) ranks
(k+1 messages of 24 bytes per tensor): lg(p2)*alpha + (p2-1)/p2*n*beta for the halving,
the same for the allgather, sum_k (k+1)*alpha for the scalars, plus 2*(alpha + n*beta)
for the fold. Each combination computes in float64 and stores in the working precision:
float64 for float64 tensors, float32 for the others, so 16-bit tensors travel and combine
in float32 (twice their bytes) until the result is rounded once. Each element of the
result is computed on one rank and copied to the others, so every rank ends with the same
bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ...kernels.adasum import dot_and_norms, scaled_add
from ..base._group import Group
from ..base._tracing import phase
from ..transport._recursive_doubling import unfolded_rank

FOLD_TAG = 61
HALVING_TAG = 62
SUMS_TAG = 63
ALLGATHER_TAG = 64
ZERO_NORM = 1e-8
"""A squared norm below this counts as a zero vector: its coefficient is 1 (Horovod's)."""

SumOver = Callable[[np.ndarray], None]


def working_dtype(dtype: np.dtype) -> np.dtype:
    """The precision Adasum computes ``dtype``'s values in: float64 for float64, float32
    for the others (16-bit values are rounded once, at the end)."""
    return np.dtype(np.float64 if dtype == np.float64 else np.float32)


def allreduce(group: Group, source: np.ndarray, result: np.ndarray,
              finish: Callable[[np.ndarray], None] | None,
              bounds: Sequence[int] | None = None) -> None:
    """Adasum of the ranks' 1-D ``source`` into ``result`` (which may be ``source``).

    Args:
        group: the ranks.
        source: this rank's floating values (float16, bfloat16, float32, float64).
        result: where the result goes, of ``source``'s dtype and size.
        finish: applied to the result in the working precision (float32 for 16-bit
            dtypes, else the dtype itself) before it is rounded; the postscale.
        bounds: offsets of the tensors packed in ``source``: tensor i spans
            ``bounds[i]:bounds[i+1]`` (zero padding after it may be included); None:
            one tensor.
    """
    size = source.size
    tensors = [(0, size)] if bounds is None else list(zip(bounds[:-1], bounds[1:]))
    working = working_dtype(source.dtype)
    if result.dtype == working:
        work = result
        if result is not source:
            work[:] = source
    else:
        work = source.astype(working)
    if group.size > 1 and size:
        own = _reduce_to_pieces(group, work, tensors)
    else:
        own = [(0, size)]
    for lo, hi in own:  # the pieces this rank computed: finished and rounded here only
        if finish is not None:
            finish(work[lo:hi])
        if work is not result:
            result[lo:hi] = work[lo:hi].astype(result.dtype)
    if group.size > 1 and size:
        with phase("allgather", bytes=result.nbytes):
            _gather_pieces(group, result)


def _reduce_to_pieces(group: Group, work: np.ndarray,
                      tensors: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Fold and halve: combine the ranks' ``work`` vectors until this rank holds its
    piece of the result, in ``work``; the pieces it holds ([] for a folded-out rank)."""
    comm, rank, size = group.comm, group.rank, group.size
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    if rank < 2 * rem and rank % 2 == 0:
        with phase("adasum fold", bytes=work.nbytes):
            comm.Send(work, rank + 1, FOLD_TAG)
        return []
    if rank < 2 * rem:
        with phase("adasum fold", bytes=work.nbytes):
            other = np.empty_like(work)
            comm.Recv(other, rank - 1, FOLD_TAG)
            _combine(work, other, 0, mine_is_a=False, tensors=tensors, sum_over=None)
        new_rank = rank // 2
    else:
        new_rank = rank - rem
    lo, hi = 0, work.size
    received = np.empty((hi + 1) // 2, work.dtype)
    mask = 1
    with phase("adasum halving", bytes=work.nbytes):
        while mask < p2:
            partner = unfolded_rank(new_rank ^ mask, rem)
            mid = lo + (hi - lo) // 2
            lower = not new_rank & mask
            keep, give = ((lo, mid), (mid, hi)) if lower else ((mid, hi), (lo, mid))
            other = received[:keep[1] - keep[0]]
            comm.Sendrecv(work[give[0]:give[1]], partner, HALVING_TAG, other, partner,
                          HALVING_TAG)
            _combine(work[keep[0]:keep[1]], other, keep[0], mine_is_a=lower, tensors=tensors,
                     sum_over=_block_sum(group, new_rank, mask << 1, rem))
            lo, hi = keep
            mask <<= 1
    return [(lo, hi)]


def _gather_pieces(group: Group, result: np.ndarray) -> None:
    """Undo the halving on ``result`` (each rank's piece filled): partners swap pieces,
    distance halving; then the odd ranks of the fold send the whole to their even rank."""
    comm, rank, size = group.comm, group.rank, group.size
    p2 = 1 << (size.bit_length() - 1)
    rem = size - p2
    data = result.view(np.uint8).reshape(-1, result.itemsize)
    if rank < 2 * rem and rank % 2 == 0:
        comm.Recv(data, rank + 1, FOLD_TAG)
        return
    new_rank = rank // 2 if rank < 2 * rem else rank - rem
    segments = []
    lo, hi, mask = 0, result.size, 1
    while mask < p2:
        mid = lo + (hi - lo) // 2
        segments.append(((lo, mid), (mid, hi), mask))
        lo, hi = (lo, mid) if not new_rank & mask else (mid, hi)
        mask <<= 1
    for first, second, mask in reversed(segments):
        mine, theirs = (first, second) if not new_rank & mask else (second, first)
        partner = unfolded_rank(new_rank ^ mask, rem)
        comm.Sendrecv(data[mine[0]:mine[1]], partner, ALLGATHER_TAG,
                      data[theirs[0]:theirs[1]], partner, ALLGATHER_TAG)
    if rank < 2 * rem:
        comm.Send(data, rank - 1, FOLD_TAG)


def _block_sum(group: Group, new_rank: int, block: int, rem: int) -> SumOver:
    """Sums of float64 numbers over the ``block`` new ranks aligned around ``new_rank``,
    by recursive doubling: partners add the same two numbers, so all get the same sums."""

    def sum_over(values: np.ndarray) -> None:
        incoming = np.empty_like(values)
        distance = 1
        while distance < block:
            partner = unfolded_rank(new_rank ^ distance, rem)
            group.comm.Sendrecv(values, partner, SUMS_TAG, incoming, partner, SUMS_TAG)
            values += incoming
            distance <<= 1

    return sum_over


def _combine(mine: np.ndarray, other: np.ndarray, offset: int, mine_is_a: bool,
             tensors: list[tuple[int, int]], sum_over: SumOver | None) -> None:
    """Replace ``mine`` (elements ``offset`` on of this rank's vector) by its Adasum with
    ``other`` (the same elements of the partner's).

    ``sum_over`` sums the per-tensor a.b, |a|^2, |b|^2 over the ranks holding the other
    pieces of the same two vectors (None: these are the whole vectors).
    """
    end = offset + mine.size
    pieces = [(max(lo, offset) - offset, min(hi, end) - offset) for lo, hi in tensors]
    a_values, b_values = (mine, other) if mine_is_a else (other, mine)
    sums = np.zeros((len(pieces), 3))  # every tensor's row, so all ranks send as many
    for row, (lo, hi) in enumerate(pieces):
        if lo < hi:
            sums[row] = dot_and_norms(a_values[lo:hi], b_values[lo:hi])
    if sum_over is not None:
        sum_over(sums.reshape(-1))
    for (lo, hi), (dot, norm_a, norm_b) in zip(pieces, sums):
        if lo >= hi:
            continue
        norm_mine, norm_other = (norm_a, norm_b) if mine_is_a else (norm_b, norm_a)
        scaled_add(mine[lo:hi], _coefficient(dot, norm_mine), other[lo:hi],
                   _coefficient(dot, norm_other))


def _coefficient(dot: float, norm_squared: float) -> float:
    """The coefficient of a vector of squared norm ``norm_squared`` in its Adasum with a
    vector whose dot product with it is ``dot``."""
    return 1.0 if norm_squared < ZERO_NORM else 1.0 - dot / (2.0 * norm_squared)


__all__ = ["allreduce"]
