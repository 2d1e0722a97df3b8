"""Broadcast schedules: a binomial tree for short messages, a pipelined chain for long ones.

Binomial tree: ranks numbered relative to the root; in round k every rank that has the
data sends it to the rank 2^k further on. Cost: ceil(lg p)*(alpha + n*beta).

Pipelined chain: ranks in relative order root -> root+1 -> ... -> root+p-1; the message
moves in m segments of at most ``segment_bytes``, each rank forwarding segment k while
segment k+1 is arriving. Cost: (p-2+m)*(alpha + n/m*beta), which tends to n*beta (the
time of one copy) for large n: every link carries the message once, at the same time.
Data is received straight into the destination; no temporary memory.
"""

from __future__ import annotations

import numpy as np

from ..base._group import Group

BINOMIAL_TAG = 31
PIPELINE_TAG = 32


def binomial(group: Group, buffer: np.ndarray, root: int) -> None:
    """Broadcast ``buffer`` from ``root`` along a binomial tree."""
    comm, rank, size = group.comm, group.rank, group.size
    relative = (rank - root) % size
    mask = 1
    while mask < size:
        if relative & mask:
            comm.Recv(buffer, (rank - mask) % size, BINOMIAL_TAG)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if relative + mask < size:
            comm.Send(buffer, (rank + mask) % size, BINOMIAL_TAG)
        mask >>= 1


def pipeline(group: Group, buffer: np.ndarray, root: int, segment_bytes: int) -> None:
    """Broadcast 1-D uint8 ``buffer`` from ``root`` down a chain, segment by segment."""
    comm, rank, size = group.comm, group.rank, group.size
    relative = (rank - root) % size
    previous = (rank - 1) % size if relative > 0 else None
    following = (rank + 1) % size if relative < size - 1 else None
    starts = range(0, buffer.nbytes, segment_bytes)
    pending = None
    if previous is not None and len(starts):
        pending = comm.Irecv(buffer[:segment_bytes], previous, PIPELINE_TAG)
    for index, start in enumerate(starts):
        piece = buffer[start:start + segment_bytes]
        if pending is not None:
            pending.Wait()
            pending = None
            if index + 1 < len(starts):
                after = starts[index + 1]
                pending = comm.Irecv(buffer[after:after + segment_bytes], previous, PIPELINE_TAG)
        if following is not None:
            comm.Send(piece, following, PIPELINE_TAG)
