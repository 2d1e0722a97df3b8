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

import functools
import hashlib
from typing import Any

import numpy as np

from . import _recursive_doubling
from ._group import Group
from .errors import MismatchError

HEADER_BYTES = 16
PAYLOAD_CAPACITY = 64 * 1024
"""Largest allreduce payload that travels with the header (fixed: part of the protocol)."""

_SIGNATURE_MASK = (1 << 62) - 1


@functools.lru_cache(maxsize=4096)
def signature(call: tuple) -> int:
    """A 62-bit digest of a call's description, the same on every rank and every run."""
    digest = hashlib.blake2b(repr(call).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SIGNATURE_MASK


def agree(group: Group, call: dict[str, Any], payload: np.ndarray | None = None,
          ufunc: np.ufunc | None = None, result: np.ndarray | None = None) -> None:
    """Check that every rank of ``group`` made the same call; optionally allreduce a payload.

    Args:
        group: the ranks.
        call: the call's fields by name, hashable values, starting with ``collective``
            and ``name``; hashed for the check and shown in the error message.
        payload: a 1-D contiguous array of at most ``PAYLOAD_CAPACITY`` bytes to reduce
            with ``ufunc`` over all ranks, or None.
        ufunc: the reduction for ``payload``.
        result: where the reduced payload goes (may be ``payload``).

    Raises:
        MismatchError: on every rank, when any rank's ``call`` differs.
    """
    if group.size == 1:
        if payload is not None and result is not payload:
            result[:] = payload
        return
    nbytes = 0 if payload is None else payload.nbytes
    message = group.scratch.get("agree.send", HEADER_BYTES + PAYLOAD_CAPACITY)
    message = message[:HEADER_BYTES + nbytes]
    header = message[:HEADER_BYTES].view(np.int64)
    own = signature(tuple(call.items()))
    header[0], header[1] = own, -own
    receive = group.scratch.get("agree.recv", HEADER_BYTES + PAYLOAD_CAPACITY)
    if payload is None:
        combine = functools.partial(_combine_headers, header)
    else:
        data = message[HEADER_BYTES:].view(payload.dtype)
        data[:] = payload
        combine = functools.partial(_combine_with_payload, header, data, ufunc)
    _recursive_doubling.exchange(group, message, receive, combine)
    if header[0] != -header[1]:
        _raise_mismatch(group, call)
    if payload is not None:
        result[:] = data


def _combine_headers(header: np.ndarray, received: np.ndarray) -> None:
    np.maximum(header, received[:HEADER_BYTES].view(np.int64), out=header)


def _combine_with_payload(header: np.ndarray, data: np.ndarray, ufunc: np.ufunc,
                          received: np.ndarray) -> None:
    theirs = received[:HEADER_BYTES].view(np.int64)
    # Unequal headers mean unequal calls: the payloads may not even have the same size.
    if theirs[0] == header[0] and theirs[1] == header[1]:
        ufunc(data, received[HEADER_BYTES:].view(data.dtype), out=data)
    else:
        np.maximum(header, theirs, out=header)


def _raise_mismatch(group: Group, call: dict[str, Any]) -> None:
    everyone = group.comm.allgather(call)
    names = list(dict.fromkeys(name for description in everyone for name in description))
    differences = {}
    for name in names:
        values = {group.world_ranks[r]: description.get(name, "(absent)")
                  for r, description in enumerate(everyone)}
        if len({repr(v) for v in values.values()}) > 1:
            differences[name] = values
    raise MismatchError(call["collective"], call["name"], differences)
