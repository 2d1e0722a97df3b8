"""ShardedOptimizer: the partition (no MPI), and a checkpoint saved with 2 ranks and
continued with 3 (tests/mpi/sharded_optimizer.py; the other checks of that program run
from tests/test_trainer_mpi.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpi_launch import run_mpi
from ringtrain.trainer._buckets import GradientSpec
from ringtrain.trainer.sharded_partition import Partition, chunk_bounds

SHAPES = [(5, 9), (9,), (1, 3, 3), (9, 5), (5,), (300, 7), (2,)]


def specs(dtypes=("float32",)) -> list[GradientSpec]:
    return [GradientSpec(f"p{i}", shape, np.dtype(dtypes[i % len(dtypes)]))
            for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("total,size", [(0, 3), (1, 4), (10, 4), (113, 3), (12, 4)])
def test_chunk_bounds_follow_array_split(total, size):
    expected = np.cumsum([0] + [len(c) for c in np.array_split(np.arange(total), size)])
    assert chunk_bounds(total, size) == tuple(expected)


@pytest.mark.parametrize("threshold", [0, 64, 160, 1 << 20])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtypes", [("float32",), ("float32", "float16")])
def test_every_element_is_owned_once_and_balanced(size, threshold, dtypes):
    partition = Partition(specs(dtypes), size, threshold, 64)
    owned = {i: np.zeros(int(np.prod(s.shape)), int) for i, s in enumerate(partition.specs)}
    for rank in range(size):
        pieces = partition.pieces(rank)
        assert sum(p.size for p in pieces) == partition.elements(rank)
        for piece in pieces:
            owned[piece.parameter][piece.start:piece.stop] += 1
            bucket = partition.buckets[piece.bucket]
            position = bucket.members.index(piece.parameter)
            low = bucket.bounds[rank]
            assert bucket.offsets[position] + piece.start == low + piece.offset
    assert all((counts == 1).all() for counts in owned.values())
    total = partition.total
    largest = max(int(np.prod(s.shape)) for s in partition.specs)
    counts = [partition.elements(r) for r in range(size)]
    assert max(counts) <= math.ceil(total / size) + len(partition.buckets) - 1
    assert max(counts) <= math.ceil(total / size) + largest
    assert max(counts) - min(counts) <= len(partition.buckets)
    for bucket in partition.buckets:
        assert len({partition.specs[m].dtype for m in bucket.members}) == 1


def test_the_partition_is_deterministic():
    first = Partition(specs(), 3, 160, 64)
    second = Partition(specs(), 3, 160, 64)
    assert [first.pieces(r) for r in range(3)] == [second.pieces(r) for r in range(3)]
    assert [b.name for b in first.buckets] == [b.name for b in second.buckets]


@pytest.mark.processes
def test_a_checkpoint_of_two_ranks_continues_on_three(tmp_path):
    environment = {"RINGTRAIN_SHARDED_CHECKPOINT": str(tmp_path)}
    run_mpi("sharded_optimizer", 2, "--only", "checkpoint_across", timeout=120,
            env=environment)
    assert (tmp_path / "sharded.pt").is_file()
    output = run_mpi("sharded_optimizer", 3, "--only", "checkpoint_across", timeout=120,
                     env=environment)
    assert "continued a checkpoint of 2 ranks" in output, output
    assert "all 1 checks passed" in output, output
