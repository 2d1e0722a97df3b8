"""The point-to-point header and what a receive accepts, without MPI."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.collectives._ops import COPY_DTYPES
from ringtrain.collectives._p2p_header import Expectation, Header, encode_header
from ringtrain.collectives.errors import CommunicationError, MessageMismatchError


def parsed(inline, dtype, shape, sequence, name) -> Header:
    return Header(np.frombuffer(encode_header(inline, dtype, shape, sequence, name),
                                np.uint8))


@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 0, 2), (2, 3, 4, 5)])
@pytest.mark.parametrize("name", [None, "", "w", "größe/∂", "x" * 13])
def test_a_header_reads_back_what_was_written(dtype, shape, name):
    data = np.zeros(shape, dtype)
    encoded = encode_header(False, dtype, shape, 12345, name)
    assert len(encoded) % 8 == 0
    header = parsed(False, dtype, shape, 12345, name)
    assert (header.inline, header.dtype, header.shape, header.sequence, header.name) == \
        (False, dtype, shape, 12345, name)
    assert header.nbytes == data.nbytes and header.length == len(encoded)


def test_inline_data_starts_where_the_header_ends():
    data = np.arange(5, dtype=np.int16)
    message = np.concatenate([np.frombuffer(encode_header(True, data.dtype, (5,), 0, "d"),
                                            np.uint8), data.view(np.uint8)])
    header = Header(message)
    assert header.inline
    assert np.array_equal(message[header.length:].view(np.int16), data)


def test_a_message_without_the_header_is_refused():
    with pytest.raises(CommunicationError, match="without ringtrain's header"):
        Header(np.zeros(64, np.uint8))


def test_what_a_receive_accepts():
    header = parsed(True, np.dtype(np.float32), (4, 2), 0, "w")
    assert Expectation(None, None, None).differences(header) == {}
    assert Expectation((4, 2), np.dtype(np.float32), "w").differences(header) == {}
    assert Expectation((4, 3), np.dtype(np.float64), "v").differences(header) == {
        "shape": {"sent": "(4, 2)", "expected": "(4, 3)"},
        "dtype": {"sent": "float32", "expected": "float64"},
        "name": {"sent": "'w'", "expected": "'v'"}}


def test_the_mismatch_message_names_both_ranks_the_tag_and_what_differed():
    error = MessageMismatchError(2, 0, 7, "w", {"shape": {"sent": "(3,)", "expected": "(4,)"}})
    assert str(error) == ("send of tensor 'w' from rank 2 to rank 0 (tag 7) does not match "
                          "the receive posted for it: rank 2 sent shape (3,), rank 0 "
                          "expected shape (4,)")
    assert isinstance(error, RuntimeError) and (error.sender, error.receiver) == (2, 0)
