"""The point-to-point header and what a receive accepts (in Python and in the compiled
steps), without MPI."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.collectives.base._ops import COPY_DTYPES
from ringtrain.collectives.transport._p2p_channels import Channels
from ringtrain.collectives.p2p._p2p_compiled import AREA_BYTES, _header_matches, \
    compiled_messages, fits
from ringtrain.collectives.p2p._p2p_header import Expectation, Header, encode_header, \
    expected_header, header_template
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


def _compiled_check(header: bytes, data_bytes: int, shape, dtype, name,
                    expected_bytes: int | None = None) -> int:
    """Where the compiled receive finds the data of a message ``header`` + ``data_bytes``,
    expecting ``shape``, ``dtype``, ``name`` (None: any) and ``expected_bytes`` of data
    (default ``data_bytes``), or -1 when it leaves the message to Python."""
    message = np.concatenate([np.frombuffer(header, np.uint8), np.ones(data_bytes, np.uint8)])
    expected = expected_header(True, np.dtype(dtype), shape, name)
    return _header_matches(message, expected,
                           data_bytes if expected_bytes is None else expected_bytes)


@pytest.mark.parametrize("name", [None, "", "w", "größe/∂", "x" * 13])
def test_the_compiled_receive_accepts_exactly_what_the_python_one_accepts(name):
    shape, dtype = (3, 5), np.dtype(np.float32)
    header = encode_header(True, dtype, shape, 77, name)
    offset = Header(np.frombuffer(header, np.uint8)).length
    assert _compiled_check(header, 60, shape, dtype, name) == offset
    assert _compiled_check(header, 60, shape, dtype, None) == offset
    assert header_template(True, dtype, shape, name).tobytes() == \
        encode_header(True, dtype, shape, 0, name)
    others = [("shape", (5, 3), dtype, name), ("ndim", (15,), dtype, name),
              ("dtype", shape, np.dtype(np.int32), name),
              ("name", shape, dtype, "v" if name is None else name + "v")]
    for what, other_shape, other_dtype, other_name in others:
        assert _compiled_check(header, 60, other_shape, other_dtype, other_name) == -1, what
        assert Expectation(other_shape, other_dtype, other_name).differences(
            Header(np.frombuffer(header, np.uint8))), what
    assert _compiled_check(header, 60, shape, dtype, name, 59) == -1  # data of another length
    assert _compiled_check(encode_header(False, dtype, shape, 77, name), 60, shape, dtype,
                           name) == -1  # the data does not follow in this message
    assert _compiled_check(b"\0" * 48, 60, shape, dtype, name) == -1  # not our header
    assert _compiled_check(header[:40], 0, shape, dtype, name) == -1  # too short


def test_turned_off_blocking_messages_take_the_python_steps(monkeypatch):
    channels = SimpleNamespace(compiled=None, messages=MPI.COMM_WORLD,
                               transfers=MPI.COMM_SELF)
    monkeypatch.setenv("RINGTRAIN_COMPILED_EXCHANGE", "0")
    assert compiled_messages(channels) is None and channels.compiled is None
    monkeypatch.setenv("RINGTRAIN_COMPILED_EXCHANGE", "1")
    assert compiled_messages(channels) is channels.compiled is not None
    assert fits(AREA_BYTES, 2 ** 31 - 2) and not fits(AREA_BYTES + 1, 0)
    assert not fits(0, 2 ** 31)


class _OneRankComm:
    """What :class:`Channels` asks of a communicator, for one rank and without MPI."""

    def Dup(self) -> _OneRankComm:
        return self

    def Set_name(self, name: str) -> None:
        pass

    def Get_attr(self, key: int) -> int:
        return 2 ** 31 - 1

    def Get_size(self) -> int:
        return 1


def test_threads_sending_to_one_rank_never_share_a_sequence_number():
    channels = Channels(_OneRankComm(), (0,))
    drawn: list[list[int]] = [[] for _ in range(8)]

    def draw(into: list[int]) -> None:
        for _ in range(20000):
            into.append(channels.next_sequence(0))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two steps
    try:
        threads = [threading.Thread(target=draw, args=(into,)) for into in drawn]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    numbers = [number for into in drawn for number in into]
    assert sorted(numbers) == list(range(len(numbers)))
