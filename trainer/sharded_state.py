"""The state dicts of a ShardedOptimizer: one rank's shard, or the whole state consolidated.

Two forms:

- **shard** (``state_dict()``): the wrapped optimizer's own ``state_dict()`` over this
  rank's pieces (``state`` and ``param_groups``, numbered by piece), plus
  ``"ringtrain_shard"``: the rank, the number of ranks, the stage and the pieces. It loads
  only into the same rank of the same partition.
- **consolidated** (``state_dict(consolidate=True, to_rank=r)`` on every rank): a plain
  PyTorch optimizer ``state_dict()`` of the user's parameters, as the wrapped optimizer
  would give unsharded: ``state`` numbered by the position of each parameter in the
  user's ``param_groups`` (frozen parameters counted), every per-element tensor (momentum,
  Adam's moments) in its parameter's shape, per-parameter scalars (Adam's ``step``) as
  they are. It loads into an unsharded torch optimizer of the same parameters, and into a
  ShardedOptimizer over any number of ranks, each taking its own pieces.

With ``master_weights=True`` both forms also hold the float32 copies under
``"master_weights"``: the shard form by piece, the consolidated form as the
DistributedOptimizer saves them (``{position in param_groups: tensor}``), so each loads
where the other optimizer's state loads. A state without them leaves the copies to be
taken from the model at the next step.

Consolidation gathers the state bucket by bucket with ``allgather`` (one message per
bucket and state key), so no rank holds more than one bucket's worth of others' state
at a time, except ``to_rank``, which keeps the result.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch

from ..collectives import ProcessSet, allgather, allgather_object
from ..collectives.errors import InvalidArgumentError
from .master_weights import LOW_PRECISION, STATE_KEY
from .sharded_partition import Partition, Piece

SHARD_KEY = "ringtrain_shard"


class Sharded(Protocol):
    """What these functions read of a
    :class:`~ringtrain.trainer.sharded_optimizer.TorchShardedOptimizer`."""

    optimizer: torch.optim.Optimizer
    process_set: ProcessSet | None
    shard_rank: int
    shard_size: int
    stage: int
    partition: Partition
    parameters: list[torch.Tensor]
    parameter_names: list[str]
    group_parameters: list[list[torch.Tensor]]
    pieces: list[Piece]
    shards: list[torch.Tensor]
    views: list[torch.Tensor]
    group_pieces: list[list[int]]
    master_weights: bool
    masters_taken: bool

    def take_masters_from_model(self) -> None: ...


def _master_positions(sharded: Sharded) -> list[int]:
    """The positions of the pieces stepped through a float32 copy."""
    return [position for position, (shard, view) in
            enumerate(zip(sharded.shards, sharded.views)) if shard is not view]


def _elementwise(value: Any, shard: torch.Tensor) -> bool:
    """Whether a state entry holds one value per element of ``shard`` (a 1-D piece)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and \
        value.shape == shard.shape


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def shard_state_dict(sharded: Sharded) -> dict[str, Any]:
    """This rank's shard of the state (see the module's docstring)."""
    state = sharded.optimizer.state_dict()
    state[SHARD_KEY] = _shard_signature(sharded)
    if sharded.master_weights:
        sharded.take_masters_from_model()
        state[STATE_KEY] = {position: sharded.shards[position].detach()
                            for position in _master_positions(sharded)}
    return state


def _shard_signature(sharded: Sharded) -> dict[str, Any]:
    return {"rank": sharded.shard_rank, "size": sharded.shard_size, "stage": sharded.stage,
            "pieces": [(sharded.parameter_names[p.parameter], p.start, p.stop)
                       for p in sharded.pieces]}


def consolidated_state_dict(sharded: Sharded, to_rank: int) -> dict[str, Any] | None:
    """The whole state on ``to_rank`` (None elsewhere); collective over the process set."""
    if sharded.master_weights:
        sharded.take_masters_from_model()
    pieces, shards = sharded.pieces, sharded.shards
    state = sharded.optimizer.state
    keys: dict[int, dict[str, str]] = {}
    present: dict[int, dict[str, int]] = {}
    scalars: dict[int, list[tuple[str, Any]]] = {}
    for piece, shard in zip(pieces, shards):
        entries = state.get(shard, {})
        bucket_keys = keys.setdefault(piece.bucket, {})
        counts = present.setdefault(piece.parameter, {})
        for key, value in entries.items():
            if _elementwise(value, shard):
                bucket_keys.setdefault(key, str(value.dtype))
                counts[key] = counts.get(key, 0) + piece.size
        if piece.start == 0:
            scalars[piece.parameter] = [
                (key, None if _elementwise(value, shard) else _to_cpu(value))
                for key, value in entries.items()]
    descriptions = allgather_object((keys, present, scalars),
                                    name="sharded optimizer state description",
                                    process_set=sharded.process_set)
    bucket_keys: dict[int, dict[str, str]] = {}
    totals: dict[int, dict[str, int]] = {}
    first_scalars: dict[int, list[tuple[str, Any]]] = {}
    for rank_keys, rank_present, rank_scalars in descriptions:
        for bucket, entries in rank_keys.items():
            for key, dtype in entries.items():
                bucket_keys.setdefault(bucket, {}).setdefault(key, dtype)
        for parameter, counts in rank_present.items():
            for key, count in counts.items():
                totals.setdefault(parameter, {})[key] = \
                    totals.get(parameter, {}).get(key, 0) + count
        first_scalars.update(rank_scalars)
    me = sharded.shard_rank
    parameters = sharded.parameters
    full: dict[int, dict[str, torch.Tensor]] = {}
    by_bucket: dict[int, list[int]] = {}
    for position, piece in enumerate(pieces):
        by_bucket.setdefault(piece.bucket, []).append(position)
    for bucket in sharded.partition.buckets:
        for key, dtype_name in sorted(bucket_keys.get(bucket.index, {}).items()):
            dtype = _dtype(dtype_name)
            parts = []
            for position in by_bucket.get(bucket.index, []):
                value = state.get(shards[position], {}).get(key)
                if value is None or not _elementwise(value, shards[position]):
                    value = torch.zeros(pieces[position].size, dtype=dtype,
                                        device=shards[position].device)
                parts.append(value.detach().to(dtype))
            device = parameters[bucket.members[0]].device
            chunk = torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)
            gathered = allgather(chunk, name=f"{bucket.name} state {key!r}",
                                 process_set=sharded.process_set)
            if me != to_rank:
                continue
            for member, offset in zip(bucket.members, bucket.offsets):
                parameter = parameters[member]
                if totals.get(member, {}).get(key, 0) != parameter.numel():
                    continue
                full.setdefault(member, {})[key] = \
                    gathered[offset:offset + parameter.numel()].reshape(parameter.shape).clone()
    masters = _gathered_masters(sharded, by_bucket, to_rank)
    if me != to_rank:
        return None
    return _torch_state_dict(sharded, full, first_scalars, masters)


def _gathered_masters(sharded: Sharded, by_bucket: dict[int, list[int]],
                      to_rank: int) -> dict[int, torch.Tensor] | None:
    """Every float16/bfloat16 parameter's whole float32 copy on ``to_rank`` (by parameter
    index), gathered bucket by bucket; None without master weights."""
    if not sharded.master_weights:
        return None
    parameters, masters = sharded.parameters, {}
    for bucket in sharded.partition.buckets:
        first = parameters[bucket.members[0]]
        if first.dtype not in LOW_PRECISION:
            continue
        parts = [sharded.shards[position].detach() for position in by_bucket.get(bucket.index, [])]
        chunk = torch.cat(parts) if parts else \
            torch.empty(0, dtype=torch.float32, device=first.device)
        gathered = allgather(chunk, name=f"{bucket.name} master weights",
                             process_set=sharded.process_set)
        if sharded.shard_rank == to_rank:
            for member, offset in zip(bucket.members, bucket.offsets):
                parameter = parameters[member]
                masters[member] = gathered[offset:offset + parameter.numel()].reshape(
                    parameter.shape).clone()
    return masters


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else \
        copy.deepcopy(value)


def _torch_state_dict(sharded: Sharded, full: dict[int, dict[str, torch.Tensor]],
                      scalars: dict[int, list[tuple[str, Any]]],
                      masters: dict[int, torch.Tensor] | None) -> dict[str, Any]:
    """A plain torch ``state_dict()`` over the user's parameter groups, with the float32
    copies (by position) when ``masters`` is not None."""
    index_of = {id(p): i for i, p in enumerate(sharded.parameters)}
    state: dict[int, dict[str, Any]] = {}
    saved_masters: dict[int, torch.Tensor] = {}
    groups = []
    position = 0
    for group, originals in zip(sharded.optimizer.param_groups, sharded.group_parameters):
        indices = []
        for parameter in originals:
            member = index_of.get(id(parameter))
            if masters is not None and member in masters:
                saved_masters[position] = masters[member]
            if member is not None and (member in full or member in scalars):
                entries: dict[str, Any] = {}
                for key, value in scalars.get(member, []):
                    if value is not None:
                        entries[key] = value
                    elif key in full.get(member, {}):
                        entries[key] = full[member][key]
                for key, value in full.get(member, {}).items():
                    entries.setdefault(key, value)
                if entries:
                    state[position] = entries
            indices.append(position)
            position += 1
        saved = {key: copy.deepcopy(value) for key, value in group.items() if key != "params"}
        saved["params"] = indices
        groups.append(saved)
    result: dict[str, Any] = {"state": state, "param_groups": groups}
    if masters is not None:
        result[STATE_KEY] = saved_masters
    return result


def load_state_dict(sharded: Sharded, state_dict: dict[str, Any]) -> None:
    """Load either form into ``sharded`` (no communication).

    Raises:
        InvalidArgumentError: a shard of another rank or partition, or a consolidated
            state whose groups or tensors do not fit the parameters; nothing is loaded.
    """
    if not isinstance(state_dict, dict) or "param_groups" not in state_dict or \
            "state" not in state_dict:
        raise InvalidArgumentError(
            f"rank {sharded.shard_rank}: ShardedOptimizer.load_state_dict() takes an "
            f"optimizer state_dict (with 'state' and 'param_groups'), got "
            f"{type(state_dict).__name__}")
    signature = state_dict.get(SHARD_KEY)
    if signature is not None:
        mine = _shard_signature(sharded)
        if not isinstance(signature, dict) or any(
                signature.get(key) != mine[key] for key in ("rank", "size", "pieces")):
            same_place = signature.get("rank") == mine["rank"] and \
                signature.get("size") == mine["size"]
            other = " (the same rank of another partition: other parameters or bucket " \
                "settings)" if same_place else ""
            raise InvalidArgumentError(
                f"rank {sharded.shard_rank}: this state_dict is the shard of rank "
                f"{signature.get('rank')} of {signature.get('size')}; this optimizer is rank "
                f"{mine['rank']} of {mine['size']}{other}: save state_dict(consolidate=True) "
                f"to load it on other ranks; broadcast_optimizer_state() does not apply to "
                f"a ShardedOptimizer (ringtrain.elastic.State saves the shard of "
                f"rank 0 only unless optimizer.consolidate_state_dict() ran on every rank "
                f"before commit())")
        masters = _masters_of_shard(sharded, state_dict.get(STATE_KEY))
        local = {key: value for key, value in state_dict.items()
                 if key not in (SHARD_KEY, STATE_KEY)}
        sharded.optimizer.load_state_dict(local)
    else:
        masters = _masters_of_consolidated(sharded, state_dict)
        sharded.optimizer.load_state_dict(_local_from_consolidated(sharded, state_dict))
    _set_masters(sharded, masters)


def _masters_of_shard(sharded: Sharded, saved: Any) -> dict[int, torch.Tensor] | None:
    """The float32 copies of a shard's state by piece position (None: take them from the
    model)."""
    if not sharded.master_weights or saved is None:
        return None
    expected = _master_positions(sharded)
    if not isinstance(saved, dict) or sorted(saved) != expected:
        raise InvalidArgumentError(
            f"rank {sharded.shard_rank}: the shard's float32 master weights are for the "
            f"pieces {sorted(saved) if isinstance(saved, dict) else saved!r}; this optimizer "
            f"steps float32 copies of the pieces {expected}")
    return dict(saved)


def _masters_of_consolidated(sharded: Sharded,
                             state_dict: dict[str, Any]) -> dict[int, torch.Tensor] | None:
    """This rank's pieces of the float32 copies of a consolidated state (or of a
    DistributedOptimizer's with master weights), by piece position."""
    saved = state_dict.get(STATE_KEY)
    if not sharded.master_weights or saved is None:
        return None
    position_of = {id(p): position for position, p in
                   enumerate(p for params in sharded.group_parameters for p in params)}
    pieces = {}
    for position in _master_positions(sharded):
        piece = sharded.pieces[position]
        parameter = sharded.parameters[piece.parameter]
        value = saved.get(position_of[id(parameter)])
        pieces[position] = _cut(value, parameter, piece, sharded.parameter_names[piece.parameter],
                                STATE_KEY, sharded.shard_rank) if value is not None else None
    missing = [sharded.parameter_names[sharded.pieces[p].parameter]
               for p, value in pieces.items() if value is None]
    if missing:
        raise InvalidArgumentError(
            f"rank {sharded.shard_rank}: the state's float32 master weights lack the "
            f"parameter(s) {missing}; load a state saved over the same model with "
            f"master_weights=True")
    return pieces


def _set_masters(sharded: Sharded, masters: dict[int, torch.Tensor] | None) -> None:
    """Set the float32 copies and round them into the model's memory (None: take them
    from the model at the next step)."""
    if not sharded.master_weights:
        return
    if masters is None:
        sharded.masters_taken = False
        return
    with torch.no_grad():
        for position, value in masters.items():
            sharded.shards[position].copy_(value.reshape(-1))
            sharded.views[position].copy_(sharded.shards[position])
    sharded.masters_taken = True


def _local_from_consolidated(sharded: Sharded,
                             state_dict: dict[str, Any]) -> dict[str, Any]:
    """The wrapped optimizer's state_dict over this rank's pieces, cut from a full one."""
    saved_groups = state_dict["param_groups"]
    originals = sharded.group_parameters
    rank = sharded.shard_rank
    if len(saved_groups) != len(originals) or any(
            len(saved["params"]) != len(params) for saved, params in zip(saved_groups, originals)):
        raise InvalidArgumentError(
            f"rank {rank}: the state_dict has parameter groups of "
            f"{[len(g['params']) for g in saved_groups]} parameters; this optimizer has "
            f"{[len(params) for params in originals]}")
    saved_index = {id(p): saved["params"][i]
                   for saved, params in zip(saved_groups, originals)
                   for i, p in enumerate(params)}
    saved_state = state_dict["state"]
    names = sharded.parameter_names
    local_state: dict[int, dict[str, Any]] = {}
    local_groups = []
    position = 0
    for saved, positions in zip(saved_groups, sharded.group_pieces):
        indices = []
        for piece_position in positions:
            piece = sharded.pieces[piece_position]
            parameter = sharded.parameters[piece.parameter]
            entries = saved_state.get(saved_index[id(parameter)])
            if entries is None:
                entries = saved_state.get(str(saved_index[id(parameter)]))
            if entries:
                local_state[position] = {
                    key: _cut(value, parameter, piece, names[piece.parameter], key, rank)
                    for key, value in entries.items()}
            indices.append(position)
            position += 1
        group = {key: value for key, value in saved.items() if key != "params"}
        group["params"] = indices
        local_groups.append(group)
    return {"state": local_state, "param_groups": local_groups}


def _cut(value: Any, parameter: torch.Tensor, piece: Piece, name: str, key: str,
         rank: int) -> Any:
    """A piece's part of a saved state entry: per-element tensors sliced, the rest copied."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    if value.dim() == 0:
        return value.clone()
    if value.numel() != parameter.numel():
        raise InvalidArgumentError(
            f"rank {rank}: state {key!r} of parameter {name!r} has shape "
            f"{tuple(value.shape)}; the parameter has shape {tuple(parameter.shape)}")
    return value.reshape(-1)[piece.start:piece.stop].clone()
