"""Agreement: before any data moves, all ranks check they called the same collective alike.

Every collective starts with one recursive-doubling exchange of a 16-byte header,
``[signature, -signature]`` combined by elementwise max, so that every rank ends with
the largest and (minus) the smallest signature of the group. They differ exactly when
some rank's call differs, and then every rank knows it at the same moment: all of them
gather the ranks' descriptions of their calls (pickled, on this error path only) and
raise the same :class:`~ringtrain.MismatchError`. No data message has been sent, so the
library keeps working afterwards.

The signature hashes everything that decides which messages follow (collective, tensor
name, dtype, shape, op, root, algorithm, segment size), so a mismatch can never turn
into a hang or a truncated message.

A small allreduce rides in the same messages: header and payload travel together and
are combined at each step, so the check costs no extra round trip. Receive buffers hold
``PAYLOAD_CAPACITY`` bytes on every rank whatever the local settings, so a rank sending
a different size still cannot overflow its partner.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..kernels import scale_into
from . import _recursive_doubling
from ._group import Group
from .errors import MismatchError

HEADER_BYTES = 16
PAYLOAD_CAPACITY = 128 * 1024
"""Largest allreduce payload that travels with the header (fixed: part of the protocol)."""

_SIGNATURE_MASK = (1 << 62) - 1


class Call:
    """A collective call as the ranks compare it.

    Attributes:
        fields: the call's fields by name, starting with ``collective`` and ``name``;
            shown, rank by rank, in the error message.
        signature: a 62-bit digest of the fields, the same on every rank and every run.
        header: this call's 16-byte header, ``[signature, -signature]`` as int64.
    """

    __slots__ = ("fields", "signature", "header", "header_bytes")

    def __init__(self, **fields: Any):
        self.fields = fields
        digest = hashlib.blake2b(repr(tuple(fields.items())).encode(), digest_size=8).digest()
        self.signature = int.from_bytes(digest, "little") & _SIGNATURE_MASK
        self.header = np.array([self.signature, -self.signature], np.int64)
        self.header_bytes = self.header.tobytes()


class _Buffers:
    """The agreement's message buffers of one group, allocated once."""

    def __init__(self) -> None:
        self.message = np.empty(HEADER_BYTES + PAYLOAD_CAPACITY, np.uint8)
        self.receive = np.empty(HEADER_BYTES + PAYLOAD_CAPACITY, np.uint8)
        self.header = self.message[:HEADER_BYTES].view(np.int64)
        self.received_header = self.receive[:HEADER_BYTES].view(np.int64)

    def combine_headers(self, _: np.ndarray | None = None) -> None:
        """Fold the received header into ours: elementwise max of ``[sig, -sig]``."""
        np.maximum(self.header, self.received_header, out=self.header)


def agree(group: Group, call: Call, payload: np.ndarray | None = None,
          ufunc: np.ufunc | None = None, result: np.ndarray | None = None,
          prescale_factor: float = 1.0) -> None:
    """Check that every rank of ``group`` made the same call; optionally allreduce a payload.

    Args:
        group: the ranks.
        call: what this rank was asked to do.
        payload: a 1-D contiguous array of at most ``PAYLOAD_CAPACITY`` bytes to reduce
            with ``ufunc`` over all ranks, or None.
        ufunc: the reduction for ``payload``.
        result: where the reduced payload goes (may be ``payload``); written only
            when the check passes.
        prescale_factor: multiplies the payload before the reduction (``payload``
            itself is left as it is).

    Raises:
        MismatchError: on every rank, when any rank's ``call`` differs.
    """
    if group.size == 1:
        if payload is not None:
            scale_into(payload, prescale_factor, result)
        return
    buffers = group.state.get("agreement")
    if buffers is None:
        buffers = group.state["agreement"] = _Buffers()
    header = buffers.header
    header[:] = call.header
    if payload is None:
        _recursive_doubling.exchange(group, buffers.message[:HEADER_BYTES], buffers.receive,
                                     buffers.combine_headers)
    else:
        end = HEADER_BYTES + payload.nbytes
        data = buffers.message[HEADER_BYTES:end].view(payload.dtype)
        scale_into(payload, prescale_factor, data)
        received = buffers.receive[HEADER_BYTES:end].view(payload.dtype)

        def combine(_: np.ndarray) -> None:
            # Unequal headers mean unequal calls: the payloads may differ even in size.
            if buffers.received_header.tobytes() == header.tobytes():
                ufunc(data, received, out=data)
            else:
                buffers.combine_headers()

        _recursive_doubling.exchange(group, buffers.message[:end], buffers.receive, combine)
    # The combined header is [max, -min] of all signatures: ours again exactly when all agree.
    if header.tobytes() != call.header_bytes:
        _raise_mismatch(group, call)
    if payload is not None:
        result[:] = data


def _raise_mismatch(group: Group, call: Call) -> None:
    everyone = group.comm.allgather(call.fields)
    names = list(dict.fromkeys(name for description in everyone for name in description))
    differences = {}
    for name in names:
        values = {group.world_ranks[r]: description.get(name, "(absent)")
                  for r, description in enumerate(everyone)}
        if len({repr(v) for v in values.values()}) > 1:
            differences[name] = values
    # Every rank names the call as the group's first rank made it: one message everywhere.
    raise MismatchError(everyone[0].get("collective"), everyone[0].get("name"), differences)
