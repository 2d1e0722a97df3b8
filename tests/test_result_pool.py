"""Large results come from pooled blocks, which return only when no array uses them."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from ringtrain.collectives.base._result_pool import MIN_BYTES, ResultPool
from ringtrain.kernels import BFLOAT16

BYTE = np.dtype(np.uint8)


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, BFLOAT16])
def test_a_large_result_is_a_writable_contiguous_array_of_its_shape(dtype):
    result = ResultPool(2 * MIN_BYTES).empty((3, MIN_BYTES // 3 + 5), np.dtype(dtype))
    assert result.shape == (3, MIN_BYTES // 3 + 5) and result.dtype == np.dtype(dtype)
    assert result.flags.c_contiguous and result.flags.writeable
    result[...] = 7
    assert (result.astype(np.float64) == 7).all()


def test_the_block_comes_back_only_when_every_view_is_gone():
    pool = ResultPool(2 * MIN_BYTES)
    result = pool.empty((MIN_BYTES // 4,), np.dtype(np.float32))
    start = address(result)
    part, shared = result[10:20], torch.from_numpy(result)
    del result
    gc.collect()
    assert pool.idle_bytes == 0
    other = pool.empty((MIN_BYTES // 4,), np.dtype(np.float32))
    assert address(other) != start  # still used by the views: a new block
    del part
    assert pool.idle_bytes == 0
    del shared
    assert pool.idle_bytes == MIN_BYTES
    again = pool.empty((MIN_BYTES // 8,), np.dtype(np.float64))
    assert address(again) == start and pool.idle_bytes == 0


def test_a_block_is_reused_only_for_results_it_holds_without_wasting_half():
    pool = ResultPool(8 * MIN_BYTES)
    block_start = address(pool.empty((4 * MIN_BYTES,), BYTE))  # dropped at once
    assert pool.idle_bytes == 4 * MIN_BYTES
    assert address(pool.empty((MIN_BYTES,), BYTE)) != block_start  # would waste 3/4
    assert address(pool.empty((3 * MIN_BYTES,), BYTE)) == block_start


def test_a_new_block_drops_the_free_blocks_beyond_the_limit_handed_out_longest_ago():
    pool = ResultPool(3 * MIN_BYTES)
    results = [pool.empty((MIN_BYTES,), BYTE) for _ in range(5)]
    starts = [address(r) for r in results]
    results.clear()
    assert pool.idle_bytes == 5 * MIN_BYTES  # nothing runs when results are dropped
    larger = pool.empty((2 * MIN_BYTES,), BYTE)  # no free block holds it: a new one
    assert pool.idle_bytes == 3 * MIN_BYTES
    reused = [pool.empty((MIN_BYTES,), BYTE) for _ in range(3)]
    assert sorted(address(r) for r in reused) == sorted(starts[2:])
    assert address(larger) not in starts


def test_a_block_in_use_is_passed_over_and_a_free_one_found_behind_it():
    pool = ResultPool(8 * MIN_BYTES)
    held = pool.empty((MIN_BYTES,), BYTE)
    dropped = address(pool.empty((MIN_BYTES,), BYTE))
    again = pool.empty((MIN_BYTES,), BYTE)
    assert address(again) == dropped and address(held) != dropped
    memory = again.base
    del again
    passed_over = pool.empty((MIN_BYTES,), BYTE)
    assert address(passed_over) != dropped  # its base is held
    del memory
    assert address(pool.empty((MIN_BYTES,), BYTE)) == dropped


def test_results_larger_than_the_limit_come_from_numpy():
    assert ResultPool(2 * MIN_BYTES).empty((3 * MIN_BYTES,), BYTE).flags.owndata


def test_small_results_and_a_zero_limit_come_from_numpy():
    pool = ResultPool(2 * MIN_BYTES)
    assert pool.empty((MIN_BYTES // 4 - 1,), np.dtype(np.float32)).flags.owndata
    assert ResultPool(0).empty((MIN_BYTES,), np.dtype(np.float32)).flags.owndata


def test_a_result_of_the_size_asked_last_finds_its_block_again_only_when_free():
    pool = ResultPool(8 * MIN_BYTES)
    first = address(pool.empty((MIN_BYTES,), BYTE))  # dropped at once
    held = pool.empty((MIN_BYTES,), BYTE)
    assert address(held) == first
    assert address(pool.empty((MIN_BYTES,), BYTE)) != first  # still held


def test_a_block_dropped_beyond_the_limit_is_not_handed_out_again():
    pool = ResultPool(3 * MIN_BYTES)
    pool.empty((MIN_BYTES,), BYTE)  # the block last given for this size, dropped at once
    held = [pool.empty((MIN_BYTES + 8,), BYTE) for _ in range(3)]  # too large for it
    held.clear()
    pool.empty((2 * MIN_BYTES,), BYTE)  # a new block: the free ones handed out first go
    idle = pool.idle_bytes
    result = pool.empty((MIN_BYTES,), BYTE)
    assert pool.idle_bytes < idle  # taken from a block the pool still keeps
    del result
    assert pool.idle_bytes == idle
