"""FusionLayout offsets, padding and task table; pack and unpack on host buffers."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain import kernels
from ringtrain.kernels import FusionLayout
from ringtrain.kernels.layout import DEFAULT_ALIGNMENT_BYTES, TASK_ELEMENTS


def random_shapes(rng, count):
    shapes = []
    for _ in range(count):
        ndim = int(rng.integers(0, 4))
        shapes.append(tuple(int(d) for d in rng.integers(0, 30, ndim)))
    shapes[::37] = [(int(rng.integers(TASK_ELEMENTS, 3 * TASK_ELEMENTS)),)
                    for _ in shapes[::37]]
    return shapes


def assert_consistent(layout):
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in layout.shapes]
    assert layout.sizes.tolist() == sizes
    assert layout.sizes.dtype == np.int64 and layout.offsets.dtype == np.int64
    assert (layout.offsets % layout.alignment == 0).all()
    assert layout.total_size % layout.alignment == 0
    aligned = [-(-size // layout.alignment) * layout.alignment for size in sizes]
    assert layout.offsets.tolist() == [sum(aligned[:index]) for index in range(len(sizes))]
    assert layout.total_size == sum(aligned)
    assert layout.nbytes == layout.total_size * layout.dtype.itemsize
    gaps = [(int(o + n), int(o + a)) for o, n, a in zip(layout.offsets, sizes, aligned) if a > n]
    assert layout.padding == gaps


def assert_tasks_cover_the_buffer_once(layout):
    tasks = layout.tasks
    assert tasks.dtype == np.int64 and tasks.ndim == 2 and tasks.shape[1] == 3
    covered = np.zeros(layout.total_size, np.int64)
    owner = np.full(layout.total_size, -2, np.int64)
    for tensor, start, count in tasks.tolist():
        assert 0 < count <= TASK_ELEMENTS
        if tensor >= 0:
            assert start % TASK_ELEMENTS == 0 and start + count <= layout.sizes[tensor]
            first = layout.offsets[tensor] + start
        else:
            first = start
        covered[first:first + count] += 1
        owner[first:first + count] = tensor
    assert (covered == 1).all()
    expected_owner = np.full(layout.total_size, -1, np.int64)
    for index, (offset, size) in enumerate(zip(layout.offsets, layout.sizes)):
        expected_owner[offset:offset + size] = index
    np.testing.assert_array_equal(owner, expected_owner)
    padding_rows = [(start, start + count) for tensor, start, count in tasks.tolist()
                    if tensor == -1]
    assert padding_rows == layout.padding
    per_tensor = [-(-int(size) // TASK_ELEMENTS) for size in layout.sizes]
    assert (tasks[:, 0] >= 0).sum() == sum(per_tensor)


# --------------------------------------------------------------------------- offsets

@pytest.mark.parametrize("dtype, alignment", [(np.float32, 16), (np.float64, 8),
                                              (np.float16, 32), (np.int8, 64), (np.int64, 8),
                                              (np.uint16, 32)])
def test_default_alignment_is_64_bytes(dtype, alignment):
    assert DEFAULT_ALIGNMENT_BYTES == 64
    layout = FusionLayout([(3,), (5,)], dtype)
    assert layout.alignment == alignment
    assert layout.offsets.tolist() == [0, alignment]
    assert layout.total_size == 2 * alignment


def test_offsets_padding_and_size_of_a_small_set():
    layout = FusionLayout([(3,), (16,), (17,), (0,), (2, 5), ()], np.float32)
    assert layout.sizes.tolist() == [3, 16, 17, 0, 10, 1]
    assert layout.offsets.tolist() == [0, 16, 32, 64, 64, 80]
    assert layout.total_size == 96
    assert layout.padding == [(3, 16), (49, 64), (74, 80), (81, 96)]
    assert layout.count == 6
    assert layout.nbytes == 384
    assert layout.shapes == [(3,), (16,), (17,), (0,), (2, 5), ()]
    assert_consistent(layout)
    assert_tasks_cover_the_buffer_once(layout)


@pytest.mark.parametrize("alignment_bytes", [4, 8, 12, 32, 128, 256, 4096])
def test_other_alignments(alignment_bytes):
    shapes = random_shapes(np.random.default_rng(alignment_bytes), 60)
    layout = FusionLayout(shapes, np.float32, alignment_bytes)
    assert layout.alignment == alignment_bytes // 4
    assert (layout.offsets * 4 % alignment_bytes == 0).all()
    assert_consistent(layout)
    assert_tasks_cover_the_buffer_once(layout)


def test_alignment_of_one_element_leaves_no_padding():
    layout = FusionLayout([(3,), (0,), (5, 2)], np.float64, 8)
    assert layout.offsets.tolist() == [0, 3, 3]
    assert layout.total_size == 13 and layout.padding == []
    assert_tasks_cover_the_buffer_once(layout)


@pytest.mark.parametrize("dtype, alignment_bytes", [(np.float32, 0), (np.float32, -64),
                                                    (np.float32, 6), (np.float64, 4),
                                                    (np.float64, 12), (np.float16, 63)])
def test_invalid_alignment_raises(dtype, alignment_bytes):
    with pytest.raises(ValueError, match="alignment"):
        FusionLayout([(4,)], dtype, alignment_bytes)


def test_zero_size_tensors_take_no_room():
    layout = FusionLayout([(0,), (3, 0), (0, 0, 7)], np.float32)
    assert layout.sizes.tolist() == [0, 0, 0]
    assert layout.offsets.tolist() == [0, 0, 0]
    assert layout.total_size == 0 and layout.padding == []
    assert layout.tasks.shape == (0, 3)
    assert [view.shape for view in layout.views(layout.empty_buffer())] == [(0,), (3, 0),
                                                                            (0, 0, 7)]


def test_no_tensors():
    layout = FusionLayout([], np.float64)
    assert layout.count == 0 and layout.total_size == 0 and layout.nbytes == 0
    assert layout.offsets.shape == (0,) and layout.offsets.dtype == np.int64
    assert layout.tasks.shape == (0, 3)
    assert layout.views(layout.empty_buffer()) == []
    kernels.pack(layout, [], layout.empty_buffer())


def test_a_single_tensor():
    layout = FusionLayout([(10, 100)], np.float32)
    assert layout.offsets.tolist() == [0]
    assert layout.total_size == 1008
    assert layout.padding == [(1000, 1008)]
    assert layout.tasks.tolist() == [[0, 0, 1000], [-1, 1000, 8]]


def test_a_tensor_spanning_several_tasks():
    size = 2 * TASK_ELEMENTS + 5
    layout = FusionLayout([(7,), (size,)], np.float32)
    assert layout.tasks.tolist() == [
        [0, 0, 7], [1, 0, TASK_ELEMENTS], [1, TASK_ELEMENTS, TASK_ELEMENTS],
        [1, 2 * TASK_ELEMENTS, 5], [-1, 7, 16 - 7],
        [-1, 16 + size, layout.total_size - 16 - size]]
    assert_tasks_cover_the_buffer_once(layout)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int8, np.int64])
def test_hundreds_of_random_tensors(dtype):
    rng = np.random.default_rng(np.dtype(dtype).itemsize)
    shapes = random_shapes(rng, 400)
    layout = FusionLayout(shapes, dtype)
    assert layout.count == 400
    assert_consistent(layout)
    assert_tasks_cover_the_buffer_once(layout)
    ends = layout.offsets + layout.sizes
    assert (ends[:-1] <= layout.offsets[1:]).all()
    assert layout.total_size - int(ends[-1]) < layout.alignment


def test_shapes_are_normalised_to_int_tuples():
    layout = FusionLayout([np.array([2, 3]), [4], (np.int64(5),)], np.float32)
    assert layout.shapes == [(2, 3), (4,), (5,)]
    assert all(type(d) is int for shape in layout.shapes for d in shape)


def test_repr_names_count_dtype_and_size():
    text = repr(FusionLayout([(3,), (4,)], np.float32))
    assert "2 tensors" in text and "float32" in text and "32 elements" in text


# --------------------------------------------------------------------------- views and check

def test_views_are_the_tensors_places_in_the_buffer():
    shapes = [(2, 3), (0,), (5,), (), (4, 1, 2)]
    layout = FusionLayout(shapes, np.int64)
    buffer = np.arange(layout.total_size, dtype=np.int64)
    views = layout.views(buffer)
    assert [view.shape for view in views] == shapes
    for view, offset, size in zip(views, layout.offsets, layout.sizes):
        np.testing.assert_array_equal(view.ravel(), np.arange(offset, offset + size))
        if size:
            assert np.shares_memory(view, buffer)
    views[2][...] = -1
    assert (buffer[layout.offsets[2]:layout.offsets[2] + 5] == -1).all()


def test_empty_buffer_is_zeroed_and_sized():
    layout = FusionLayout([(3,), (9,)], np.float16)
    buffer = layout.empty_buffer()
    assert buffer.shape == (layout.total_size,) and buffer.dtype == np.float16
    assert not buffer.any()


def test_check_rejects_what_does_not_fit():
    layout = FusionLayout([(2, 3), (4,)], np.float32)
    tensors = [np.zeros((2, 3), np.float32), np.zeros(4, np.float32)]
    buffer = layout.empty_buffer()
    layout.check(tensors, buffer)
    bad_calls = [
        (tensors[:1], buffer),
        (tensors + [np.zeros(1, np.float32)], buffer),
        ([np.zeros((3, 2), np.float32), tensors[1]], buffer),
        ([np.zeros(6, np.float32), tensors[1]], buffer),
        ([tensors[0], np.zeros(4, np.float64)], buffer),
        (tensors, np.zeros(layout.total_size + 1, np.float32)),
        (tensors, np.zeros(layout.total_size, np.float64)),
        (tensors, np.zeros((1, layout.total_size), np.float32)),
    ]
    for bad_tensors, bad_buffer in bad_calls:
        with pytest.raises(ValueError):
            layout.check(bad_tensors, bad_buffer)
        with pytest.raises(ValueError):
            kernels.pack(layout, bad_tensors, bad_buffer)
        with pytest.raises(ValueError):
            kernels.unpack(layout, bad_buffer, bad_tensors)


def test_of_takes_shapes_and_dtype_from_arrays():
    arrays = [np.zeros((3, 4), np.float64), np.zeros(0, np.float64), np.zeros(7, np.float64)]
    layout = FusionLayout.of(arrays)
    assert layout.dtype == np.float64 and layout.shapes == [(3, 4), (0,), (7,)]
    assert FusionLayout.of(arrays, alignment_bytes=16).alignment == 2
    empty = FusionLayout.of([])
    assert empty.count == 0 and empty.dtype == np.float32


@pytest.mark.parametrize("dtypes", [(np.float32, np.float64), (np.float32, np.float16),
                                    (np.int32, np.float32), (np.int64, np.int32, np.int64)])
def test_of_rejects_mixed_dtypes(dtypes):
    with pytest.raises(ValueError, match="one dtype"):
        FusionLayout.of([np.zeros(3, dtype) for dtype in dtypes])


# --------------------------------------------------------------------------- pack and unpack

def random_tensors(rng, shapes, dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
                for shape in shapes]
    return [(rng.standard_normal(shape) * 10).astype(dtype) for shape in shapes]


def garbage_buffer(layout, rng):
    raw = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    raw[:layout.nbytes // 2] = 0xFF
    return raw.view(layout.dtype)


def assert_padding_is_zero(layout, buffer):
    for start, stop in layout.padding:
        assert not buffer[start:stop].view(f"u{layout.dtype.itemsize}").any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8,
                                   np.int32, np.int64])
def test_pack_then_unpack_round_trips_and_zeroes_padding(dtype):
    rng = np.random.default_rng(np.dtype(dtype).num)
    shapes = random_shapes(rng, 120)
    tensors = random_tensors(rng, shapes, dtype)
    layout = FusionLayout.of(tensors)
    buffer = garbage_buffer(layout, rng)
    kernels.pack(layout, tensors, buffer)
    for tensor, view in zip(tensors, layout.views(buffer)):
        np.testing.assert_array_equal(view, tensor)
    assert_padding_is_zero(layout, buffer)
    restored = [np.full(t.shape, 7, dtype) for t in tensors]
    kernels.unpack(layout, buffer, restored)
    for tensor, back in zip(tensors, restored):
        assert back.tobytes() == tensor.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("scale", [0.5, 3.0, 0.1, -2.0, 1e-3])
def test_pack_and_unpack_scale_every_element(dtype, scale):
    rng = np.random.default_rng(42)
    tensors = random_tensors(rng, [(5, 7), (0,), (300,), (), (2, 2, 2)], dtype)
    layout = FusionLayout.of(tensors)
    buffer = garbage_buffer(layout, rng)
    kernels.pack(layout, tensors, buffer, scale)
    for tensor, view in zip(tensors, layout.views(buffer)):
        assert view.tobytes() == (tensor * np.dtype(dtype).type(scale)).tobytes()
    assert_padding_is_zero(layout, buffer)
    restored = [np.empty(t.shape, dtype) for t in tensors]
    kernels.unpack(layout, buffer, restored, 1 / scale)
    for view, back in zip(layout.views(buffer), restored):
        assert back.tobytes() == (view * np.dtype(dtype).type(1 / scale)).tobytes()
        assert back.dtype == np.dtype(dtype)


def test_pack_and_unpack_non_contiguous_tensors():
    rng = np.random.default_rng(8)
    bases = [rng.standard_normal((6, 10)).astype(np.float32),
             rng.standard_normal((4, 5, 3)).astype(np.float32),
             rng.standard_normal(40).astype(np.float32)]
    tensors = [bases[0][::2, 1::3], bases[1].transpose(2, 0, 1), bases[2][::-4]]
    assert not any(t.flags.c_contiguous for t in tensors)
    layout = FusionLayout.of(tensors)
    buffer = garbage_buffer(layout, rng)
    kernels.pack(layout, tensors, buffer, 2.0)
    for tensor, view in zip(tensors, layout.views(buffer)):
        np.testing.assert_array_equal(view, tensor * 2)
    assert_padding_is_zero(layout, buffer)
    targets = [np.zeros((6, 10), np.float32)[::2, 1::3],
               np.zeros((3, 4, 5), np.float32)[:, ::-1, :],
               np.zeros((10, 2), np.float32)[:, 0]]
    kernels.unpack(layout, buffer, targets, 0.5)
    for tensor, target in zip(tensors, targets):
        np.testing.assert_array_equal(target, tensor)


def test_pack_with_scale_one_copies_bits_exactly():
    patterns = np.array([0x7F800001, 0x7FC00000, 0x80000000, 0x00000001, 0xFF800000],
                        np.uint32)
    tensor = patterns.view(np.float32)
    layout = FusionLayout.of([tensor])
    buffer = garbage_buffer(layout, np.random.default_rng(0))
    kernels.pack(layout, [tensor], buffer)
    assert buffer[:5].view(np.uint32).tolist() == patterns.tolist()
    back = np.empty_like(tensor)
    kernels.unpack(layout, buffer, [back])
    assert back.view(np.uint32).tolist() == patterns.tolist()


def test_repacking_into_a_reused_buffer_replaces_everything():
    rng = np.random.default_rng(4)
    shapes = [(3,), (20,), (1,)]
    layout = FusionLayout(shapes, np.int32)
    buffer = garbage_buffer(layout, rng)
    for _ in range(3):
        tensors = random_tensors(rng, shapes, np.int32)
        kernels.pack(layout, tensors, buffer)
        expected = np.zeros(layout.total_size, np.int32)
        for tensor, offset in zip(tensors, layout.offsets):
            expected[offset:offset + tensor.size] = tensor.ravel()
        np.testing.assert_array_equal(buffer, expected)


def test_padding_rows_are_split_like_tensor_rows():
    layout = FusionLayout([(3,)], np.float32, alignment_bytes=4 * (2 * TASK_ELEMENTS + 8))
    padding = [row for row in layout.tasks.tolist() if row[0] == -1]
    assert all(0 < count <= TASK_ELEMENTS for _, _, count in padding)
    covered = sorted((start, start + count) for _, start, count in padding)
    assert covered[0][0] == 3 and covered[-1][1] == layout.total_size
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_a_scale_on_an_integer_buffer_is_refused():
    tensors = [np.arange(4, dtype=np.int32)]
    layout = FusionLayout.of(tensors)
    buffer = layout.empty_buffer()
    with pytest.raises(ValueError, match="floating"):
        kernels.pack(layout, tensors, buffer, 2.0)
    with pytest.raises(ValueError, match="floating"):
        kernels.unpack(layout, buffer, tensors, 0.5)
