"""The agreement's shared-memory mailboxes, in one process: ranks are counters over one
array of boxes, and threads stand in for the ranks where one must wait for another.
(tests/mpi/ runs every agreement over them between processes.)"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from ringtrain.collectives.agreement._call import HEADER_BYTES, PAYLOAD_CAPACITY
from ringtrain.collectives.transport._mailboxes import (MESSAGE_BYTES, box_words, mailbox_receive,
                                                        mailbox_send, new_counters)

YIELD = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value


class Ranks:
    """A group of ``size`` ranks in this process."""

    def __init__(self, size: int):
        self.boxes = np.zeros(box_words(size), np.int64)
        self.counters = [new_counters(rank, size) for rank in range(size)]

    def send(self, source: int, destination: int, message: np.ndarray) -> None:
        mailbox_send(self.boxes, self.counters[source], destination, message,
                     message.nbytes, YIELD)

    def receive(self, destination: int, source: int, room: int = MESSAGE_BYTES
                ) -> tuple[int, np.ndarray]:
        receive = np.zeros(room, np.uint8)
        length = mailbox_receive(self.boxes, self.counters[destination], source, receive,
                                 YIELD)
        return length, receive


def _message(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_the_agreements_largest_message_fits():
    assert HEADER_BYTES + PAYLOAD_CAPACITY <= MESSAGE_BYTES
    ranks = Ranks(2)
    largest = _message(1, MESSAGE_BYTES)
    ranks.send(0, 1, largest)
    length, received = ranks.receive(1, 0)
    assert length == MESSAGE_BYTES and np.array_equal(received, largest)


def test_messages_arrive_in_order_with_their_lengths():
    ranks = Ranks(2)
    messages = [_message(i, n) for i, n in enumerate([0, 1, 7, 40, 4096])]
    for i, message in enumerate(messages):
        ranks.send(0, 1, message)
        ranks.send(1, 0, message[::-1].copy())
        length, received = ranks.receive(1, 0)
        assert length == message.nbytes and np.array_equal(received[:length], message), i
        length, received = ranks.receive(0, 1)
        assert np.array_equal(received[:length], message[::-1]), i


def test_a_receive_takes_what_fits_and_says_the_whole_length():
    ranks = Ranks(2)
    message = _message(3, 100)
    ranks.send(1, 0, message)
    length, received = ranks.receive(0, 1, room=64)
    assert length == 100 and np.array_equal(received, message[:64])


def test_a_message_for_another_rank_is_left_for_it():
    ranks = Ranks(3)
    first, second = _message(4, 24), _message(5, 24)
    ranks.send(0, 2, first)
    ranks.send(0, 1, second)
    assert np.array_equal(ranks.receive(1, 0)[1][:24], second)
    assert np.array_equal(ranks.receive(2, 0)[1][:24], first)


def test_a_third_send_waits_until_the_first_is_taken():
    ranks = Ranks(2)
    messages = [_message(10 + i, 16) for i in range(3)]
    ranks.send(0, 1, messages[0])
    ranks.send(0, 1, messages[1])
    third = threading.Thread(target=ranks.send, args=(0, 1, messages[2]))
    third.start()
    time.sleep(0.2)
    assert third.is_alive(), "the third send overwrote a message not yet taken"
    assert np.array_equal(ranks.receive(1, 0)[1][:16], messages[0])
    third.join(timeout=10)
    assert not third.is_alive()
    for expected in messages[1:]:
        assert np.array_equal(ranks.receive(1, 0)[1][:16], expected)


def test_a_receive_waits_for_its_message():
    ranks = Ranks(2)
    got = []
    receiver = threading.Thread(target=lambda: got.append(ranks.receive(1, 0)))
    receiver.start()
    time.sleep(0.2)
    assert receiver.is_alive() and not got
    message = _message(20, 33)
    ranks.send(0, 1, message)
    receiver.join(timeout=10)
    assert got and got[0][0] == 33 and np.array_equal(got[0][1][:33], message)


def test_a_message_larger_than_the_mailboxes_is_refused():
    ranks = Ranks(2)
    with pytest.raises(ValueError, match="larger than the mailboxes"):
        ranks.send(0, 1, np.zeros(MESSAGE_BYTES + 1, np.uint8))
