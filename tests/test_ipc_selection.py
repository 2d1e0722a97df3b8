"""When allreduce takes the GPUs' own path (CUDA IPC), and the schedule it runs: no MPI,
no GPU (the one check of this process's ability to share device memory is replaced)."""

from __future__ import annotations

import pytest

from ringtrain.collectives import InvalidArgumentError
from ringtrain.collectives.algorithms import _ipc, _ring
from ringtrain.collectives.algorithms._selection import (allreduce_algorithm,
                                                         device_allreduce_algorithm,
                                                         reduces_inside_nodes_on_gpus)
from ringtrain.collectives.world._topology import NodeLayout
from ringtrain.collectives.config import Settings
from ringtrain.collectives.tuning import default_choice
from ringtrain.kernels import ipc

ONE_NODE = NodeLayout(((0, 1, 2),), "shared memory")
TWO_NODES = NodeLayout(((0, 1), (2, 3)), "shared memory")
SETTINGS = Settings(ipc_min_bytes=1 << 20)


@pytest.fixture(autouse=True)
def shareable(monkeypatch):
    monkeypatch.setattr(ipc, "unavailable_reason", lambda: None)


def choose(algorithm, nbytes, layout=ONE_NODE, settings=SETTINGS):
    size = len(layout.node_of)
    return device_allreduce_algorithm(algorithm, nbytes, size, settings, "w", layout)


def test_auto_takes_ipc_on_one_node_from_the_threshold_on():
    assert choose(None, 1 << 20) == "ipc"
    assert choose("auto", 4 << 20) == "ipc"
    assert choose(None, (1 << 20) - 1) == default_choice("allreduce", (1 << 20) - 1, 3, SETTINGS)
    assert choose(None, 1024) == "recursive_doubling"
    assert choose(None, 1024, settings=Settings(ipc_min_bytes=0)) == "ipc"


def test_several_nodes_keep_the_staged_algorithms():
    assert choose(None, 64 << 20, TWO_NODES) == "hierarchical"
    with pytest.raises(InvalidArgumentError, match="'w'.*'ipc' cannot run here: the ranks "
                                                   "span 2 nodes"):
        choose("ipc", 64 << 20, TWO_NODES)


def test_hierarchical_sums_inside_nodes_on_the_gpus_where_the_nodes_are_equal():
    assert reduces_inside_nodes_on_gpus("ipc", ONE_NODE)
    assert reduces_inside_nodes_on_gpus("hierarchical", TWO_NODES)
    unequal = NodeLayout(((0, 1), (2,)), "shared memory")
    alone = NodeLayout(((0,), (1,)), "node_size=1")
    assert not reduces_inside_nodes_on_gpus("hierarchical", unequal)
    assert not reduces_inside_nodes_on_gpus("hierarchical", alone)
    assert not reduces_inside_nodes_on_gpus("node_leader", TWO_NODES)
    assert not reduces_inside_nodes_on_gpus("ring", TWO_NODES)


def test_a_process_that_cannot_share_device_memory_stays_staged(monkeypatch):
    monkeypatch.setattr(ipc, "unavailable_reason", lambda: "CUDA IPC is not supported")
    assert choose(None, 64 << 20) == default_choice("allreduce", 64 << 20, 3, SETTINGS)
    with pytest.raises(InvalidArgumentError, match="CUDA IPC is not supported"):
        choose("ipc", 64 << 20)
    assert not reduces_inside_nodes_on_gpus("hierarchical", TWO_NODES)


def test_one_rank_and_asked_for_algorithms():
    assert device_allreduce_algorithm("ipc", 64 << 20, 1, SETTINGS, "w",
                                      NodeLayout(((0,),), "shared memory")) != "ipc"
    assert choose("ring", 64 << 20) == "ring"
    assert choose("recursive_doubling", 64 << 20) == "recursive_doubling"


def test_host_arrays_refuse_ipc_asked_for_and_read_the_setting_as_auto():
    with pytest.raises(InvalidArgumentError, match="'w'.*GPU memory"):
        allreduce_algorithm("ipc", 1024, 2, SETTINGS, "w", ONE_NODE)
    setting = Settings(allreduce_algorithm="ipc")
    assert allreduce_algorithm(None, 1024, 2, setting, "w", ONE_NODE) == "recursive_doubling"


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_each_chunk_is_reduced_in_the_ring_order(size):
    """Chunk c starts on rank c+1 and ends on its owner c, each rank combining its own
    values with the partial result, as the ring's reduce-scatter does."""
    for chunk in range(size):
        order = _ipc.chain_order(chunk, size)
        assert order[0] == (chunk + 1) % size and order[-1] == chunk
        assert sorted(order) == list(range(size))
        # In the ring, at step s rank r receives chunk (r - s - 2): the ranks that add
        # their values to chunk c, one after another, are c+2, c+3, ..., c (mod size).
        adders = [r for s in range(size - 1) for r in range(size)
                  if (r - s - 2) % size == chunk]
        assert order[1:] == adders


def test_buffer_holds_the_input_and_the_largest_chunk_aligned():
    bounds = _ring.chunk_bounds(1001, 3)
    assert _ipc.buffer_bytes(1001, 4, 3) == 4096 + bounds[1] * 4
    assert _ipc.buffer_bytes(64, 2, 2) == 256 + 32 * 2
