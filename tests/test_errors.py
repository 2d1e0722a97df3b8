"""ringtrain.collectives.errors: the exception hierarchy and MismatchError's message."""

from __future__ import annotations

import numpy as np
import pytest

import ringtrain as rt
from ringtrain.collectives import errors
from ringtrain.collectives.errors import MismatchError, format_ranks, tensor_label

PREFIX = "was called with different arguments across ranks: "


def test_hierarchy():
    assert issubclass(errors.RingtrainError, Exception)
    for cls, builtin in [(errors.NotInitializedError, RuntimeError),
                         (errors.InvalidArgumentError, ValueError),
                         (errors.UnsupportedDtypeError, TypeError),
                         (errors.CommunicationError, RuntimeError),
                         (errors.MismatchError, RuntimeError)]:
        assert issubclass(cls, errors.RingtrainError) and issubclass(cls, builtin), cls
        assert getattr(rt, cls.__name__) is cls


@pytest.mark.parametrize("ranks, text", [([2], "rank 2"), ([0, 1], "ranks 0,1"),
                                         ([0, 1, 3], "ranks 0,1,3"), ([10], "rank 10")])
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def test_tensor_label():
    assert tensor_label("w") == "'w'"
    assert tensor_label(None) == "(unnamed)"


def test_shape_message_from_the_documentation():
    error = MismatchError("allreduce", "w", {"shape": {0: (10,), 1: (10,), 2: (11,)}})
    assert str(error) == ("allreduce of tensor 'w' " + PREFIX +
                          "rank 2 sent shape (11,), ranks 0,1 sent shape (10,)")
    assert error.collective == "allreduce"
    assert error.tensor_name == "w"
    assert error.differences == {"shape": {0: (10,), 1: (10,), 2: (11,)}}
    assert isinstance(error, RuntimeError) and isinstance(error, rt.RingtrainError)


def test_the_smallest_group_comes_first_wherever_its_ranks_are():
    error = MismatchError("allreduce", "w", {"shape": {0: (11,), 1: (10,), 2: (10,), 3: (10,)}})
    assert str(error).endswith("rank 0 sent shape (11,), ranks 1,2,3 sent shape (10,)")
    error = MismatchError("broadcast", "b", {"root_rank": {0: 0, 1: 1, 2: 1, 3: 0, 4: 0}})
    assert str(error).endswith("ranks 1,2 sent root_rank 1, ranks 0,3,4 sent root_rank 0")


def test_groups_of_equal_size_are_in_rank_order():
    error = MismatchError("allreduce", None, {"shape": {0: (4,), 1: (5,)}})
    assert str(error) == ("allreduce of tensor (unnamed) " + PREFIX +
                          "rank 0 sent shape (4,), rank 1 sent shape (5,)")
    error = MismatchError("allreduce", None, {"shape": {0: (3,), 1: (2,), 2: (1,)}})
    assert str(error).endswith(
        "rank 0 sent shape (3,), rank 1 sent shape (2,), rank 2 sent shape (1,)")


def test_several_fields_are_joined_by_semicolons():
    error = MismatchError("allreduce", "g", {
        "op": {0: "Sum", 1: "Sum", 2: "Max"},
        "dtype": {0: np.dtype(np.float32), 1: np.dtype(np.float32), 2: np.dtype(np.float64)},
    })
    assert str(error) == ("allreduce of tensor 'g' " + PREFIX +
                          "rank 2 sent op 'Max', ranks 0,1 sent op 'Sum'; "
                          "rank 2 sent dtype float64, ranks 0,1 sent dtype float32")


@pytest.mark.parametrize("field, values, shown", [
    ("op", {0: "Sum", 1: "Max"}, ["rank 0 sent op 'Sum'", "rank 1 sent op 'Max'"]),
    ("dtype", {0: np.dtype(np.int32), 1: np.dtype(np.bool_)},
     ["rank 0 sent dtype int32", "rank 1 sent dtype bool"]),
    ("name", {0: "a", 1: None}, ["rank 0 sent name 'a'", "rank 1 sent name None"]),
    ("algorithm", {0: "ring", 1: "native"},
     ["rank 0 sent algorithm 'ring'", "rank 1 sent algorithm 'native'"]),
    ("segment_bytes", {0: 262144, 1: None},
     ["rank 0 sent segment_bytes 262144", "rank 1 sent segment_bytes None"]),
    ("shape[1:]", {0: (3,), 1: (4,)},
     ["rank 0 sent shape[1:] (3,)", "rank 1 sent shape[1:] (4,)"]),
    ("collective", {0: "allreduce", 1: "broadcast"},
     ["rank 0 sent collective 'allreduce'", "rank 1 sent collective 'broadcast'"]),
    ("root_rank", {0: 0, 1: "(absent)"},
     ["rank 0 sent root_rank 0", "rank 1 sent root_rank '(absent)'"]),
])
def test_how_values_are_shown(field, values, shown):
    text = str(MismatchError("x", "t", {field: values}))
    for part in shown:
        assert part in text, text


def test_differences_are_copied():
    values = {0: (1,), 1: (2,)}
    differences = {"shape": values}
    error = MismatchError("allreduce", "w", differences)
    values[2] = (3,)
    differences["dtype"] = {}
    assert error.differences == {"shape": {0: (1,), 1: (2,)}}


def test_mismatch_error_can_be_raised_and_caught_as_runtime_error():
    with pytest.raises(RuntimeError, match="rank 1 sent shape"):
        raise MismatchError("allreduce", "w", {"shape": {0: (1,), 1: (2,)}})
