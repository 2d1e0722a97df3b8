"""ringtrain's settings: one frozen object, every field overridable by a ``RINGTRAIN_*`` variable.

Precedence: an explicit argument (:func:`configure`, or ``algorithm=`` on a call), then
the environment variable, then the default. The variables, their parsers and defaults
are declared in :mod:`ringtrain.common.environment`; a malformed variable is ignored with a
warning that names it. Settings that change which messages are sent (the algorithms
they choose, the segment size, the node layout) are part of every call's signature, so
ranks configured differently get a :class:`~ringtrain.MismatchError`, never a hang; the
trainer's fusion threshold and the stall inspector's seconds are each rank's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..common.environment import ALGORITHMS, environment_variable, parse_size, setting_variable
from .errors import InvalidArgumentError

__all__ = ["ALGORITHMS", "Settings", "configure", "current_settings", "reset_settings",
           "settings_from_environment", "environment_variable", "parse_size"]

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def _default(field: str) -> Any:
    return setting_variable(field).default


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tunables of the collectives and the trainer. Sizes are in bytes.

    The defaults are those of :mod:`ringtrain.common.environment`.

    Attributes:
        allreduce_algorithm: ``auto`` or one of ``ALGORITHMS["allreduce"]``.
        broadcast_algorithm: ``auto`` or one of ``ALGORITHMS["broadcast"]``.
        allgather_algorithm: ``auto`` or one of ``ALGORITHMS["allgather"]``.
        reducescatter_algorithm: ``auto`` or one of ``ALGORITHMS["reducescatter"]``.
        alltoall_algorithm: ``auto`` or one of ``ALGORITHMS["alltoall"]``.
        recursive_doubling_max_bytes: without a tuned table, ``auto`` allreduce uses
            recursive doubling up to this size (see :mod:`ringtrain.collectives.tuning`).
        segment_bytes: the ring and the pipelined broadcast move data in pieces of at
            most this size, so a received piece is reduced while it is still in cache
            and temporary memory stays at two pieces.
        broadcast_pipeline_min_bytes: without a tuned table, ``auto`` broadcast of up to
            4 KiB uses a binomial tree below this size and the pipelined chain from it on
            (MPI's own above 4 KiB).
        hierarchical_min_bytes: when the ranks span several nodes (and some node holds
            more than one of them), ``auto`` allreduce and broadcast use the
            hierarchical algorithms from this size on.
        ipc_min_bytes: when every rank is on one node, ``auto`` allreduce of device
            tensors runs on the GPUs through CUDA IPC from this size on, and through
            host memory below it.
        node_size: 0 takes the nodes from MPI's shared-memory split; k > 0 pretends
            that every k consecutive world ranks form a node (the last one may be
            smaller), so that the hierarchical algorithms can be tried on one machine.
        fusion_threshold: the trainer's fusion bucket size limit (0: one gradient per
            bucket); read when a gradient reducer or optimizer is built.
        stall_check_seconds: the stall inspector reports a collective that has waited
            this long (0: off); read by ``init``.
        stall_shutdown_seconds: a collective that has waited this long aborts the job
            (0: never); read by ``init``.
        name_match_seconds: when threads made named calls in different orders on
            different ranks, how long the ranks look for a name they all made before
            they raise a MismatchError (the lowest rank's value decides).
    """

    allreduce_algorithm: str = _default("allreduce_algorithm")
    broadcast_algorithm: str = _default("broadcast_algorithm")
    allgather_algorithm: str = _default("allgather_algorithm")
    reducescatter_algorithm: str = _default("reducescatter_algorithm")
    alltoall_algorithm: str = _default("alltoall_algorithm")
    recursive_doubling_max_bytes: int = _default("recursive_doubling_max_bytes")
    segment_bytes: int = _default("segment_bytes")
    broadcast_pipeline_min_bytes: int = _default("broadcast_pipeline_min_bytes")
    hierarchical_min_bytes: int = _default("hierarchical_min_bytes")
    ipc_min_bytes: int = _default("ipc_min_bytes")
    node_size: int = _default("node_size")
    fusion_threshold: int = _default("fusion_threshold")
    stall_check_seconds: float = _default("stall_check_seconds")
    stall_shutdown_seconds: float = _default("stall_shutdown_seconds")
    name_match_seconds: float = _default("name_match_seconds")

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = _TYPES[field.type]
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                object.__setattr__(self, field.name, value)
            if not isinstance(value, expected) or isinstance(value, bool):
                raise InvalidArgumentError(
                    f"{field.name} must be {expected.__name__}, got {value!r}")
        for field in dataclasses.fields(self):
            try:
                setting_variable(field.name).validate(getattr(self, field.name))
            except ValueError as error:
                raise InvalidArgumentError(str(error)) from None


def settings_from_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """Build :class:`Settings` from the defaults and the ``RINGTRAIN_*`` variables
    (``environ``, default ``os.environ``); a malformed one is ignored with a warning."""
    return Settings(**{field.name: setting_variable(field.name).read(environ)
                       for field in dataclasses.fields(Settings)})


_current: Settings | None = None


def current_settings() -> Settings:
    """The settings in force (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = settings_from_environment()
    return _current


def configure(**overrides: object) -> Settings:
    """Override settings for this process; unknown names are refused.

    Call it with the same values on every rank, before the collectives that should use
    them (a rank configured differently gets a MismatchError, not a hang).

    Args:
        **overrides: fields of :class:`Settings`, e.g. ``segment_bytes=1 << 20``.

    Returns:
        The settings now in force.

    Raises:
        InvalidArgumentError: an unknown name or a bad value.
    """
    global _current
    known = {field.name for field in dataclasses.fields(Settings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InvalidArgumentError(
            f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    _current = dataclasses.replace(current_settings(), **overrides)
    return _current


def reset_settings() -> None:
    """Forget :func:`configure` overrides; the environment is read again on next use."""
    global _current
    _current = None
