"""The call the ranks compare (:class:`Call`): its fields, the 62-bit signature they hash
to, and the 40-byte header every collective's agreement starts with.

The signature hashes everything that decides which messages follow (collective, tensor
name, dtype, shape, op, root, algorithm, segment size), so a mismatch can never turn
into a hang or a truncated message. The header's first two fields are ``[signature,
-signature]``; the other three carry what a compressed allreduce must know of all ranks
before it casts (:class:`ValueRange`): the largest finite magnitude (a non-negative
float64 orders like its int64 bits) and the highest and lowest rank whose values hold
inf or NaN.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base._executor import MAIN_THREAD

HEADER_BYTES = 40
SIGNATURE_BYTES = 16
PAYLOAD_CAPACITY = 128 * 1024
"""Largest payload that travels with the header (fixed: part of the protocol)."""
BYTES = np.dtype(np.uint8)
"""The dtype of payloads that are bytes (combined by bitwise or)."""

_SIGNATURE_MASK = (1 << 62) - 1
_CALLS_KEPT = 4096
_calls_made: dict[tuple, Call] = {}


class Call:
    """A collective call as the ranks compare it.

    Calls are kept by their fields (``Call(**fields)`` returns the one made before with
    equal fields): the signature of a call repeated every step is computed once.

    Attributes:
        fields: the call's fields by name, starting with ``collective`` and ``name``;
            shown, rank by rank, in the error message.
        signature: a 62-bit digest of the fields, the same on every rank and every run.
        header_bytes: this call's signature fields, ``[signature, -signature]`` as int64.
        fresh_header: the whole header this call starts its exchange with.
        fresh_array: ``fresh_header`` as a (read-only) uint8 array.
    """

    __slots__ = ("fields", "signature", "header_bytes", "fresh_header", "fresh_array",
                 "threaded", "_by_thread")

    def __new__(cls, **fields: Any) -> Call:
        try:
            # Equal but differently printed values (1 and 1.0, a dtype and its name)
            # would share a signature: the caller's tensor name is the only field not
            # of ringtrain's making.
            key: tuple | None = (type(fields.get("name")), *fields.items())
            made = _calls_made.get(key)
        except TypeError:  # an unhashable field: not kept
            key, made = None, None
        if made is None:
            made = super().__new__(cls)
            made._describe(fields)
            if key is not None:
                if len(_calls_made) >= _CALLS_KEPT:
                    _calls_made.clear()
                _calls_made[key] = made
        return made

    def _describe(self, fields: dict[str, Any]) -> None:
        self.fields = fields
        digest = hashlib.blake2b(repr(tuple(fields.items())).encode(), digest_size=8).digest()
        self.signature = int.from_bytes(digest, "little") & _SIGNATURE_MASK
        self.header_bytes = struct.pack("<2q", self.signature, -self.signature)
        self.fresh_header = self.header_bytes + NO_RANGE.tobytes()
        self.fresh_array = np.frombuffer(self.fresh_header, np.uint8)
        self.threaded = fields.get("name") is None and "thread" not in fields and \
            _carries_data(fields.get("collective", ""))
        self._by_thread: dict[str, Call] = {}

    def made_by(self, thread: threading.Thread) -> Call:
        """This call as ``thread`` made it: an unnamed call made by a thread other than
        the main thread carries the thread's name, so that the unnamed calls of two
        threads never meet (named calls are matched by name instead)."""
        if not self.threaded or thread is MAIN_THREAD:
            return self
        tagged = self._by_thread.get(thread.name)
        if tagged is None:
            tagged = self._by_thread[thread.name] = Call(**self.fields, thread=thread.name)
        return tagged


def _carries_data(collective: str) -> bool:
    """Barriers, joins and the ends of sequences move no data: any thread may meet them."""
    return collective not in ("barrier", "join") and not collective.startswith("end of")


@dataclass(frozen=True)
class ValueRange:
    """What every rank learns of all ranks' values in a compressed allreduce.

    Attributes:
        abs_max: the largest finite magnitude on any rank.
        nonfinite_ranks: ``(lowest, highest)`` rank of the group holding inf or NaN,
            or None when no rank does.
    """

    abs_max: float
    nonfinite_ranks: tuple[int, int] | None


NO_RANK = -(1 << 62)
NO_RANGE = np.array([0, NO_RANK, NO_RANK], np.int64)
