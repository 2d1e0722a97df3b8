"""ringtrain.trainer.distributed_sampler: DistributedSampler's shards, order and errors."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from ringtrain.collectives.errors import InvalidArgumentError, NotInitializedError
from ringtrain.trainer.distributed_sampler import DistributedSampler

REPLICAS = [1, 2, 3, 4, 7]
LENGTHS = [0, 1, 2, 5, 10, 11, 97]
SAMPLER = Path(__file__).resolve().parents[1] / "trainer" / "distributed_sampler.py"


def shards(n, replicas, **options):
    """Every rank's indices, in the order each rank's sampler yields them."""
    return [list(DistributedSampler(n, replicas, rank, **options)) for rank in range(replicas)]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_pad_deals_every_index_and_pads_from_the_start(n, replicas, shuffle):
    per_rank = math.ceil(n / replicas)
    samplers = [DistributedSampler(n, replicas, rank, shuffle=shuffle)
                for rank in range(replicas)]
    got = [list(sampler) for sampler in samplers]
    assert [len(sampler) for sampler in samplers] == [per_rank] * replicas
    assert [len(indices) for indices in got] == [per_rank] * replicas
    assert all(sampler.total_size == per_rank * replicas for sampler in samplers)
    counts = Counter(index for indices in got for index in indices)
    assert set(counts) == set(range(n))
    # The padding repeats the order from its start, so no index comes more than
    # once more than any other, and the extra copies number total_size - n.
    assert sum(counts.values()) - n == per_rank * replicas - n
    if n:
        assert max(counts.values()) - min(counts.values()) <= 1


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_drop_deals_distinct_indices_evenly(n, replicas, shuffle):
    per_rank = n // replicas
    samplers = [DistributedSampler(n, replicas, rank, shuffle=shuffle, mode="drop")
                for rank in range(replicas)]
    got = [list(sampler) for sampler in samplers]
    assert [len(sampler) for sampler in samplers] == [per_rank] * replicas
    assert [len(indices) for indices in got] == [per_rank] * replicas
    assert all(sampler.total_size == per_rank * replicas for sampler in samplers)
    flat = [index for indices in got for index in indices]
    assert len(set(flat)) == len(flat) == per_rank * replicas
    assert set(flat) <= set(range(n))


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("replicas", REPLICAS)
@pytest.mark.parametrize("n", LENGTHS)
def test_exact_deals_every_index_once(n, replicas, shuffle):
    samplers = [DistributedSampler(n, replicas, rank, shuffle=shuffle, mode="exact")
                for rank in range(replicas)]
    got = [list(sampler) for sampler in samplers]
    expected_lengths = [n // replicas + (rank < n % replicas) for rank in range(replicas)]
    assert [len(sampler) for sampler in samplers] == expected_lengths
    assert [len(indices) for indices in got] == expected_lengths
    assert all(sampler.total_size == n for sampler in samplers)
    assert sorted(index for indices in got for index in indices) == list(range(n))


@pytest.mark.parametrize("mode", ["pad", "drop", "exact"])
def test_without_shuffle_ranks_take_the_natural_order_interleaved(mode):
    assert shards(10, 4, shuffle=False, mode=mode) == {
        "pad": [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]],
        "drop": [[0, 4], [1, 5], [2, 6], [3, 7]],
        "exact": [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]],
    }[mode]


def test_pad_repeats_the_order_when_there_are_fewer_indices_than_ranks():
    assert shards(2, 7, shuffle=False) == [[0], [1], [0], [1], [0], [1], [0]]


@pytest.mark.parametrize("mode", ["pad", "drop", "exact"])
def test_shuffle_is_the_pcg64_permutation_of_seed_plus_epoch(mode):
    n, replicas, seed, epoch = 97, 4, 5, 3
    samplers = [DistributedSampler(n, replicas, rank, seed=seed, mode=mode)
                for rank in range(replicas)]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    order = np.random.Generator(np.random.PCG64(seed + epoch)).permutation(n)
    order = np.resize(order, samplers[0].total_size)
    for rank, sampler in enumerate(samplers):
        assert list(sampler) == order[rank::replicas].tolist()


def test_same_seed_and_epoch_give_every_rank_the_same_permutation():
    n, replicas = 97, 3
    for epoch in range(3):
        samplers = [DistributedSampler(n, replicas, rank, seed=7) for rank in range(replicas)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        # Re-interleaving the shards rebuilds one order: the ranks agreed on it.
        got = [list(sampler) for sampler in samplers]
        order = [got[position % replicas][position // replicas]
                 for position in range(samplers[0].total_size)]
        assert order[:n] != list(range(n)) and sorted(order[:n]) == list(range(n))
        assert order[n:] == order[:len(order) - n]
        again = DistributedSampler(n, replicas, 1, seed=7)
        again.set_epoch(epoch)
        assert list(again) == got[1]


def test_the_order_changes_with_the_epoch_and_the_seed():
    sampler = DistributedSampler(97, 2, 1, seed=1)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
        assert list(sampler) == orders[-1], "iterating twice in an epoch must repeat"
    assert len({tuple(order) for order in orders}) == 3
    assert sorted(orders[0]) != orders[0]
    assert orders[0] != list(DistributedSampler(97, 2, 1, seed=2))


def test_epoch_does_not_change_the_order_without_shuffle():
    sampler = DistributedSampler(11, 3, 2, shuffle=False)
    sampler.set_epoch(4)
    assert sampler.epoch == 4
    assert list(sampler) == [2, 5, 8, 0]


def test_a_sized_dataset_and_its_length_give_the_same_sampler():
    assert shards(list("abcdefghijk"), 3) == shards(11, 3)
    assert shards(np.zeros((11, 2)), 3, mode="exact") == shards(np.int64(11), 3, mode="exact")


def test_properties_and_repr():
    sampler = DistributedSampler(10, num_replicas=4, rank=3, shuffle=False, seed=2,
                                 mode="exact")
    sampler.set_epoch(1)
    assert (sampler.num_replicas, sampler.rank, sampler.mode, sampler.epoch,
            sampler.total_size, len(sampler)) == (4, 3, "exact", 1, 10, 2)
    assert repr(sampler) == ("DistributedSampler(length=10, num_replicas=4, rank=3, "
                             "mode='exact', shuffle=False, seed=2, epoch=1, len=2)")
    with pytest.raises(AttributeError):
        sampler.rank = 0


def test_yields_python_ints():
    assert all(type(index) is int for index in DistributedSampler(10, 3, 0))


def test_a_torch_dataloader_reads_the_ranks_shard():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.arange(100, 111))
    for rank in range(3):
        sampler = DistributedSampler(dataset, num_replicas=3, rank=rank, seed=4)
        sampler.set_epoch(2)
        loader = DataLoader(dataset, batch_size=2, sampler=sampler)
        batches = [batch.tolist() for (batch,) in loader]
        assert len(loader) == math.ceil(len(sampler) / 2)
        assert sum(batches, []) == [100 + index for index in sampler]


@pytest.mark.parametrize("arguments, message", [
    ((10, 4, 4), "rank must be in [0, 4) for num_replicas=4, got 4"),
    ((10, 4, -1), "rank must be in [0, 4) for num_replicas=4, got -1"),
    ((10, 0, 0), "num_replicas must be at least 1, got 0"),
    ((10, -2, 0), "num_replicas must be at least 1, got -2"),
    ((-1, 2, 0), "the dataset's length must be >= 0, got -1"),
    ((object(), 2, 0), "dataset must be an int (its length) or have __len__, got object"),
    ((10, 2.0, 0), "num_replicas must be an int, got float 2.0"),
    ((10, 2, True), "rank must be an int, got bool True"),
])
def test_bad_arguments_are_refused(arguments, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        DistributedSampler(*arguments)


@pytest.mark.parametrize("options, message", [
    ({"mode": "even"}, "mode must be one of 'pad', 'drop', 'exact', got 'even'"),
    ({"seed": -3}, "seed must be >= 0, got -3"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        DistributedSampler(10, 2, 0, **options)


def test_a_bad_epoch_is_refused_and_the_old_one_kept():
    sampler = DistributedSampler(10, 2, 0)
    with pytest.raises(InvalidArgumentError, match=re.escape("epoch must be >= 0, got -1")):
        sampler.set_epoch(-1)
    with pytest.raises(InvalidArgumentError, match=re.escape("epoch must be an int, got str")):
        sampler.set_epoch("1")
    assert sampler.epoch == 0


def test_errors_are_value_errors():
    with pytest.raises(ValueError, match="DistributedSampler: "):
        DistributedSampler(10, 2, 5)


def test_without_num_replicas_or_rank_the_job_is_asked():
    with pytest.raises(NotInitializedError):
        DistributedSampler(10)
    with pytest.raises(NotInitializedError):
        DistributedSampler(10, num_replicas=2)


@pytest.mark.parametrize("statement", [
    "import ringtrain.trainer.distributed_sampler",
    # The module by itself, whatever the package's __init__ imports.
    "import importlib.util\n"
    f"spec = importlib.util.spec_from_file_location('distributed_sampler', {str(SAMPLER)!r})\n"
    "spec.loader.exec_module(importlib.util.module_from_spec(spec))",
])
@pytest.mark.processes
def test_importing_the_module_does_not_import_mpi4py_or_torch(tmp_path, statement):
    probe = (f"import sys\n{statement}\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'torch')))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
