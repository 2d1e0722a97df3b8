"""The kept elements of a ShardedOptimizer's bucket under gradient masks: which of the
bucket's elements travel, how many fall in each rank's chunk, and the copies between the
dense bucket and the packed elements.

The partition stays as it is (rank r owns chunk r of the dense bucket, and the optimizer
state lives with the owned pieces, so masks that change move no state between ranks);
only the messages shrink. The gradients' kept elements, packed in bucket order, are
reduce-scattered with uneven splits (each rank receives the kept elements of its own
chunk, the pruned ones of its chunk get zero gradients), and after the step each rank
allgathers the kept elements of its chunk, which every rank writes into the parameters
at their places, zeros at the pruned ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._gradient_masks import kept_name
from .sharded_partition import ShardBucket


class KeptBucket:
    """One bucket's kept elements, for the rank ``rank``.

    Args:
        bucket: the bucket (its members, their offsets, the ranks' chunk bounds).
        kept: for each member, in bucket order, the flat indices of its kept elements
            (ascending), or None when all of them travel.
        sizes: the members' element counts.
        rank: this rank's position among the ranks sharing the model.

    Attributes:
        splits: how many kept elements fall in each rank's chunk (the reduce-scatter's
            splits, and the allgather's row counts).
        count: how many elements travel.
        name: the bucket's name with a digest of its kept elements (see
            :func:`~ringtrain.trainer._gradient_masks.kept_name`).
    """

    def __init__(self, bucket: ShardBucket, kept: Sequence[np.ndarray | None],
                 sizes: Sequence[int], rank: int):
        parts = [offset + (np.arange(size, dtype=np.int64) if indices is None else indices)
                 for offset, indices, size in zip(bucket.offsets, kept, sizes)]
        positions = np.concatenate(parts) if parts else np.empty(0, np.int64)
        cuts = np.searchsorted(positions, bucket.bounds)
        self.splits = np.diff(cuts).tolist()
        self.count = int(positions.size)
        self.name = kept_name(bucket.name, kept)
        self._positions = torch.from_numpy(positions)
        self._own = torch.from_numpy(positions[cuts[rank]:cuts[rank + 1]] - bucket.bounds[rank])
        self._chunk_size = bucket.bounds[rank + 1] - bucket.bounds[rank]
        member_cuts = np.cumsum([0] + [part.size for part in parts]).tolist()
        self._members = [(member_cuts[i], member_cuts[i + 1],
                          None if indices is None else torch.from_numpy(indices))
                         for i, indices in enumerate(kept)]

    def pack(self, flat: torch.Tensor) -> torch.Tensor:
        """The kept elements of the dense bucket ``flat``, in bucket order (a new tensor)."""
        return flat[self._positions]

    def expand(self, received: torch.Tensor) -> torch.Tensor:
        """This rank's dense chunk from the kept elements of it (zeros elsewhere)."""
        chunk = torch.zeros(self._chunk_size, dtype=received.dtype, device=received.device)
        chunk[self._own] = received
        return chunk

    def own(self, chunk: torch.Tensor) -> torch.Tensor:
        """The kept elements of this rank's dense chunk ``chunk``."""
        return chunk[self._own]

    def write(self, gathered: torch.Tensor, parameters: Sequence[torch.Tensor]) -> None:
        """Write every rank's kept elements (``gathered``, in bucket order) into the
        members' ``parameters``, zeros into their pruned elements."""
        for (start, stop, indices), parameter in zip(self._members, parameters):
            flat = parameter.detach().view(-1)
            if indices is None:
                flat.copy_(gathered[start:stop])
            else:
                flat.zero_()
                flat[indices] = gathered[start:stop]
