"""Pairwise-exchange alltoall.

Step s = 1 .. p-1: rank r sends its block for rank (r+s) and receives the block from
rank (r-s), so every rank sends and receives exactly once per step and no link is
shared within a step. Cost: (p-1)*alpha + (p-1)/p*n*beta for n bytes sent per rank.
Blocks go straight from the input to the output; no temporary memory.
"""

from __future__ import annotations

import numpy as np

from ._group import Group

TAG = 41


def alltoall(group: Group, send: np.ndarray, send_offsets: list[int], receive: np.ndarray,
             receive_offsets: list[int]) -> None:
    """Send ``send[send_offsets[j]:send_offsets[j+1]]`` to rank j, for every j.

    Args:
        group: the ranks.
        send, receive: 1-D uint8 buffers.
        send_offsets, receive_offsets: p+1 byte offsets of the blocks per rank.
    """
    comm, rank, size = group.comm, group.rank, group.size
    receive[receive_offsets[rank]:receive_offsets[rank + 1]] = \
        send[send_offsets[rank]:send_offsets[rank + 1]]
    for step in range(1, size):
        to, source = (rank + step) % size, (rank - step) % size
        comm.Sendrecv(send[send_offsets[to]:send_offsets[to + 1]], to, TAG,
                      receive[receive_offsets[source]:receive_offsets[source + 1]], source, TAG)
