"""The header every point-to-point message starts with, and what a receive accepts.

A header is int64 fields (magic, whether the data follows in the same message, the
dtype's index in :data:`COPY_DTYPES`, the number of dimensions, the sender's sequence
number, the name's length or -1 for no name), the shape, then the name in UTF-8 padded
to 8 bytes.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np

from ..base._ops import COPY_DTYPES
from ..errors import CommunicationError

_MAGIC = 0x52545032  # "RTP2"
_FIXED = 6  # magic, inline, dtype index, ndim, sequence, name length
_NO_NAME = -1
NO_NAME_CHECK = -2
"""In :func:`expected_header`: any name (or none) is accepted."""
_FIXED_FIELDS = struct.Struct(f"<{_FIXED}q")
FIXED_BYTES = _FIXED_FIELDS.size
"""Bytes of the fixed fields (the shape follows them)."""
SEQUENCE_WORD = 4
"""The sequence number's index among the fixed fields."""
_NOT_OURS = ("a point-to-point message without ringtrain's header arrived on ringtrain's "
             "point-to-point communicator")


def dtype_index(dtype: np.dtype) -> int:
    """The header's code of ``dtype`` (one of :data:`COPY_DTYPES`)."""
    return COPY_DTYPES.index(dtype)


def encode_header(inline: bool, dtype: np.dtype, shape: tuple[int, ...], sequence: int,
                  name: str | None) -> bytes:
    """The header of a message: int64 fields, then the name in UTF-8 padded to 8 bytes."""
    encoded = b"" if name is None else name.encode()
    fields = struct.pack(f"<{_FIXED + len(shape)}q", _MAGIC, inline, dtype_index(dtype),
                         len(shape), sequence, _NO_NAME if name is None else len(encoded),
                         *shape)
    return fields + encoded + b"\x00" * (-len(encoded) % 8)


@functools.lru_cache(maxsize=256)
def header_template(inline: bool, dtype: np.dtype, shape: tuple[int, ...],
                    name: str | None) -> np.ndarray:
    """The header of a message with sequence number 0 (read-only bytes), for compiled
    code that writes the sequence number into its word (:data:`SEQUENCE_WORD`)."""
    return np.frombuffer(encode_header(inline, dtype, shape, 0, name), np.uint8)


@functools.lru_cache(maxsize=256)
def expected_header(inline: bool, dtype: np.dtype, shape: tuple[int, ...],
                    name: str | None) -> np.ndarray:
    """What a receive expects of a header, as bytes for compiled code to compare: int64
    words (magic, inline, dtype, number of dimensions, the shape, then the name's length
    or :data:`NO_NAME_CHECK`), then the name in UTF-8."""
    encoded = b"" if name is None else name.encode()
    words = struct.pack(f"<{5 + len(shape)}q", _MAGIC, inline, dtype_index(dtype),
                        len(shape), *shape, NO_NAME_CHECK if name is None else len(encoded))
    return np.frombuffer(words + encoded, np.uint8)


class Header:
    """A received header.

    Attributes:
        inline: whether the data followed in the same message.
        dtype, shape, sequence, name: what the sender sent.
        length: the header's bytes (the data starts there in an inline message).
    """

    def __init__(self, message: np.ndarray):
        if message.nbytes < FIXED_BYTES:
            raise CommunicationError(_NOT_OURS)
        magic, inline, dtype, ndim, self.sequence, name_length = \
            _FIXED_FIELDS.unpack_from(message)
        if magic != _MAGIC:
            raise CommunicationError(_NOT_OURS)
        self.inline = bool(inline)
        self.dtype = COPY_DTYPES[dtype]
        end = FIXED_BYTES + 8 * ndim
        self.shape = struct.unpack_from(f"<{ndim}q", message, FIXED_BYTES)
        self.name = None if name_length == _NO_NAME else \
            bytes(message[end:end + name_length]).decode()
        self.length = end + (0 if name_length == _NO_NAME else
                             name_length + (-name_length % 8))

    @property
    def nbytes(self) -> int:
        """Bytes of the data."""
        return math.prod(self.shape) * self.dtype.itemsize


class Expectation:
    """What a receive accepts: a shape and dtype (None: any) and a name (None: any).

    Attributes:
        shape, dtype, name: as given.
    """

    def __init__(self, shape: tuple[int, ...] | None, dtype: np.dtype | None,
                 name: str | None):
        self.shape, self.dtype, self.name = shape, dtype, name

    def differences(self, header: Header) -> dict[str, dict[str, str]]:
        """``{field: {"sent": value, "expected": value}}`` for each field that differs,
        as the error message shows them."""
        found = {}
        for field, expected, sent in (("shape", self.shape, header.shape),
                                      ("dtype", self.dtype, header.dtype),
                                      ("name", self.name, header.name)):
            if expected is not None and expected != sent:
                show = str if field == "dtype" else repr
                found[field] = {"sent": show(sent), "expected": show(expected)}
        return found
