"""The trainer's pure parts: bucket assignment, the fusion threshold setting and the
check for repeated names."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ringtrain.collectives.config import reset_settings
from ringtrain.collectives.errors import InvalidArgumentError
from ringtrain.trainer._buckets import (DEFAULT_FUSION_THRESHOLD, GradientSpec, assign_buckets,
                                        fusion_threshold)
from ringtrain.trainer._names import repeated_names

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


def specs(*sizes: int, dtype=F32) -> list[GradientSpec]:
    return [GradientSpec(f"g{i}", (n,), dtype) for i, n in enumerate(sizes)]


def test_buckets_fill_in_reverse_registration_order_with_a_small_first_bucket():
    # 4-byte elements: sizes in bytes 400, 400, 400, 400, 40, 40, 20
    buckets = assign_buckets(specs(100, 100, 100, 100, 10, 10, 5), threshold=800,
                             first_bucket_bytes=60)
    assert buckets == [[6, 5], [4, 3], [2, 1], [0]]


def test_large_gradients_travel_alone_and_small_ones_fuse_across_them():
    # bytes: 4 000 000, 8 000, 4 000 000, 8 000 (weights and biases of large layers)
    buckets = assign_buckets(specs(1_000_000, 2_000, 1_000_000, 2_000), threshold=1 << 20,
                             first_bucket_bytes=1 << 16)
    assert buckets == [[2], [3, 1], [0]]  # ordered by when each is complete
    buckets = assign_buckets(specs(10, 10, 10, 300), threshold=200, first_bucket_bytes=1000)
    assert buckets == [[3], [2, 1, 0]]
    buckets = assign_buckets(specs(100, 100, 100), threshold=1 << 20, alone_bytes=400)
    assert buckets == [[2], [1], [0]]


def test_gradients_copied_anyway_fuse_whatever_their_size():
    # bytes 400 each: alone by size, unless copied into a bucket anyway (masked gradients)
    buckets = assign_buckets(specs(100, 100, 100, 100), threshold=1000, first_bucket_bytes=1000,
                             alone_bytes=400, copied=[True, True, False, True])
    assert buckets == [[2], [3, 1], [0]]
    buckets = assign_buckets(specs(100, 100, 100), threshold=1000, first_bucket_bytes=1000,
                             alone_bytes=400, copied=[True, True, True])
    assert buckets == [[2, 1], [0]]
    buckets = assign_buckets(specs(99, 99, 99), threshold=1 << 20, alone_bytes=400)
    assert buckets == [[2, 1, 0]]


def test_every_gradient_is_in_exactly_one_bucket():
    sizes = list(np.random.default_rng(1).integers(1, 5000, 157))
    buckets = assign_buckets(specs(*sizes), threshold=20_000, first_bucket_bytes=4_000)
    assert sorted(i for bucket in buckets for i in bucket) == list(range(len(sizes)))
    assert len(buckets) > 5
    limits = [4_000] + [20_000] * (len(buckets) - 1)
    for bucket, limit in zip(buckets, limits):
        assert len(bucket) == 1 or sum(sizes[i] * 4 for i in bucket) <= limit
    assert [i for bucket in buckets for i in bucket] == list(reversed(range(len(sizes))))


def test_threshold_zero_gives_one_bucket_per_gradient_in_reverse_order():
    assert assign_buckets(specs(3, 1, 2), threshold=0) == [[2], [1], [0]]


def test_a_bucket_holds_one_dtype_and_buckets_launch_by_their_first_gradient():
    mixed = [GradientSpec("a", (10,), F32), GradientSpec("b", (10,), F16),
             GradientSpec("c", (10,), F32), GradientSpec("d", (10,), F16)]
    buckets = assign_buckets(mixed, threshold=1 << 20, first_bucket_bytes=1 << 20)
    assert buckets == [[3, 1], [2, 0]]
    for bucket in buckets:
        assert len({mixed[i].dtype for i in bucket}) == 1


def test_empty_model_has_no_buckets():
    assert assign_buckets([], threshold=100) == []


def test_fusion_threshold_explicit_then_environment_then_default(monkeypatch):
    # The setting is read from the environment on first use: reset_settings() reads it again.
    monkeypatch.delenv("RINGTRAIN_FUSION_THRESHOLD", raising=False)
    reset_settings()
    assert fusion_threshold() == DEFAULT_FUSION_THRESHOLD
    monkeypatch.setenv("RINGTRAIN_FUSION_THRESHOLD", "4MiB")
    reset_settings()
    assert fusion_threshold() == 4 << 20
    assert fusion_threshold(123) == 123
    monkeypatch.setenv("RINGTRAIN_FUSION_THRESHOLD", "lots")
    reset_settings()
    with pytest.warns(RuntimeWarning, match="ignoring RINGTRAIN_FUSION_THRESHOLD='lots'"):
        assert fusion_threshold() == DEFAULT_FUSION_THRESHOLD
    monkeypatch.delenv("RINGTRAIN_FUSION_THRESHOLD")
    reset_settings()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8M"])
def test_fusion_threshold_refuses_bad_values(bad):
    with pytest.raises(InvalidArgumentError, match="fusion_threshold must be a number of bytes"):
        fusion_threshold(bad)


def test_repeated_names_each_once_in_the_order_they_first_repeat():
    assert repeated_names(["b", "a", "c", "a", "b", "a", "b"]) == ["a", "b"]
    assert repeated_names(iter(["x", "y"])) == []
    assert repeated_names([]) == []


@pytest.mark.processes
def test_importing_the_trainer_imports_neither_mpi_nor_torch():
    code = ("import sys, ringtrain.trainer as t; t.DistributedSampler; "
            "assert 'mpi4py' not in sys.modules and 'torch' not in sys.modules, "
            "sorted(m for m in ('mpi4py', 'torch') if m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("op", ["adasum", "Adasum", "ADASUM"])
def test_gradient_buckets_refuse_adasum_before_anything_is_sent(op):
    """Adasum combines whole parameter changes, not buckets of gradients: refused up front
    (by name or as ringtrain.Adasum), pointing to ringtrain.horovod's optimizer."""
    from ringtrain.collectives import Adasum
    from ringtrain.trainer.gradient_reducer import GradientReducer
    for given in (op, Adasum):
        with pytest.raises(InvalidArgumentError, match="ringtrain.horovod.DistributedOptimizer"):
            GradientReducer([("w", np.zeros(3, np.float32))], op=given)
