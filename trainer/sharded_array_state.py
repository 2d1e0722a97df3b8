"""The consolidated state of a numpy ShardedOptimizer: the optimizer's state as the same
optimizer over the whole parameters would hold it.

An optimizer over arrays keeps its state in its own layout, which ringtrain cannot know
in general. It can consolidate the common one: per-element state kept in dicts keyed by
parameter name (``{"velocity": {name: array}}``, or the ``state_dict()`` itself being
such a dict), one array per parameter. In the sharded optimizer those dicts hold this
rank's 1-D pieces; consolidated, they hold every parameter's array in its parameter's
shape, and everything else in the state (step counts, hyper-parameters) is to_rank's. A
dict is per-element state when its keys are parameter names and its values numpy arrays
of the pieces' sizes (consolidating), or of the parameters' sizes (loading); such dicts
are looked for in the ``state_dict()`` and in its dict values, one level down.

Consolidation gathers each such dict bucket by bucket (one ``allgather`` per bucket and
dict), as the PyTorch ShardedOptimizer gathers its state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ..collectives import ProcessSet, allgather, allgather_object
from ..collectives.errors import InvalidArgumentError
from .sharded_partition import Partition, Piece

_Path = tuple[str, ...]


class ArraySharded(Protocol):
    """What these functions read of an
    :class:`~ringtrain.trainer.sharded_arrays.ArrayShardedOptimizer`."""

    optimizer: Any
    process_set: ProcessSet | None
    shard_rank: int
    partition: Partition
    parameters: list[np.ndarray]
    parameter_names: list[str]
    pieces: list[Piece]


def _dicts_by_name(state: Any, names: set[str]) -> dict[_Path, Mapping[str, Any]]:
    """The dicts keyed by parameter names holding arrays: the state itself (path ``()``) or
    its values one level down (path ``(key,)``)."""
    found: dict[_Path, Mapping[str, Any]] = {}
    candidates = [((), state)]
    if isinstance(state, Mapping):
        candidates += [((key,), value) for key, value in state.items() if isinstance(key, str)]
    for path, value in candidates:
        if isinstance(value, Mapping) and value and set(value) <= names and \
                all(isinstance(v, np.ndarray) for v in value.values()):
            found[path] = value
    return found


def consolidated_state_dict(sharded: ArraySharded, to_rank: int) -> Any:
    """The optimizer's whole state on ``to_rank`` (None elsewhere); collective over the
    process set."""
    state = sharded.optimizer.state_dict()
    names = sharded.parameter_names
    piece_of = {names[p.parameter]: p for p in sharded.pieces}
    local = {path: found for path, found in _dicts_by_name(state, set(piece_of)).items()
             if all(array.size == piece_of[name].size for name, array in found.items())}
    mine = {path: {name: str(array.dtype) for name, array in found.items()}
            for path, found in local.items()}
    everyone = allgather_object(mine, name="sharded optimizer state description",
                                process_set=sharded.process_set)
    paths: dict[_Path, dict[str, str]] = {}
    for described in everyone:
        for path, dtypes in described.items():
            paths.setdefault(path, {}).update(dtypes)
    full: dict[_Path, dict[str, np.ndarray]] = {}
    for path in sorted(paths):
        dtype = np.result_type(*paths[path].values())
        for bucket in sharded.partition.buckets:
            parts = []
            for piece in sharded.pieces:
                if piece.bucket != bucket.index:
                    continue
                value = local.get(path, {}).get(names[piece.parameter])
                parts.append(np.zeros(piece.size, dtype) if value is None else
                             np.asarray(value, dtype).reshape(-1))
            chunk = np.concatenate(parts) if parts else np.empty(0, dtype)
            gathered = allgather(chunk, name=f"{bucket.name} state {'/'.join(path) or 'state'}",
                                 process_set=sharded.process_set)
            if sharded.shard_rank != to_rank:
                continue
            for member, offset in zip(bucket.members, bucket.offsets):
                if names[member] in paths[path]:
                    parameter = sharded.parameters[member]
                    full.setdefault(path, {})[names[member]] = \
                        gathered[offset:offset + parameter.size].reshape(parameter.shape).copy()
    if sharded.shard_rank != to_rank:
        return None
    return _replaced(state, full)


def local_from_consolidated(sharded: ArraySharded, state: Any) -> Any:
    """This rank's pieces of a consolidated state: each per-element dict cut to the names
    this rank owns part of, as 1-D pieces.

    Raises:
        InvalidArgumentError: a per-element array whose size is not its parameter's.
    """
    names = sharded.parameter_names
    index = {name: i for i, name in enumerate(names)}
    owned = {names[p.parameter]: p for p in sharded.pieces}
    cut: dict[_Path, dict[str, np.ndarray]] = {}
    for path, found in _dicts_by_name(state, set(names)).items():
        for name, value in found.items():
            parameter = sharded.parameters[index[name]]
            if value.size != parameter.size:
                raise InvalidArgumentError(
                    f"rank {sharded.shard_rank}: state {'/'.join(path) or 'state'!r} of "
                    f"parameter {name!r} has shape {value.shape}; the parameter has shape "
                    f"{parameter.shape}")
        cut[path] = {name: np.array(found[name].reshape(-1)[piece.start:piece.stop])
                     for name, piece in owned.items() if name in found}
    return _replaced(state, cut)


def _replaced(state: Any, dicts: dict[_Path, dict[str, np.ndarray]]) -> Any:
    """``state`` with the dicts at ``dicts``' paths replaced."""
    if () in dicts:
        return dicts[()]
    if not isinstance(state, Mapping):
        return state
    return {key: dicts.get((key,), value) for key, value in state.items()}
