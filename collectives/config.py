"""ringtrain's settings: one frozen object, every field overridable by a ``RINGTRAIN_*`` variable.

Precedence: an explicit argument (:func:`configure`, or ``algorithm=`` on a call), then
the environment variable, then the default. A malformed variable is ignored with a
warning that names it. Settings that change which messages are sent (algorithms,
segment size) are part of every call's signature, so ranks configured differently get
a :class:`~ringtrain.MismatchError`, never a hang.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Mapping

from .errors import InvalidArgumentError

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("auto", "ring", "recursive_doubling", "hierarchical", "node_leader",
                  "native"),
    "broadcast": ("auto", "pipeline", "binomial", "hierarchical", "native"),
    "allgather": ("auto", "ring", "hierarchical", "native"),
    "reducescatter": ("auto", "ring", "native"),
    "alltoall": ("auto", "pairwise", "native"),
}
"""The algorithms each collective offers; ``auto`` picks by message and world size."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tunables of the collectives. Sizes are in bytes.

    Attributes:
        allreduce_algorithm: ``auto`` or one of ``ALGORITHMS["allreduce"]``.
        broadcast_algorithm: ``auto`` or one of ``ALGORITHMS["broadcast"]``.
        allgather_algorithm: ``auto`` or one of ``ALGORITHMS["allgather"]``.
        reducescatter_algorithm: ``auto`` or one of ``ALGORITHMS["reducescatter"]``.
        alltoall_algorithm: ``auto`` or one of ``ALGORITHMS["alltoall"]``.
        recursive_doubling_max_bytes: ``auto`` allreduce uses recursive doubling up to
            this size, the ring above it.
        segment_bytes: the ring and the pipelined broadcast move data in pieces of at
            most this size, so a received piece is reduced while it is still in cache
            and temporary memory stays at two pieces.
        broadcast_pipeline_min_bytes: ``auto`` broadcast uses a binomial tree below this
            size and the pipelined chain from it on.
        hierarchical_min_bytes: when the ranks span several nodes (and some node holds
            more than one of them), ``auto`` allreduce and broadcast use the
            hierarchical algorithms from this size on.
        node_size: 0 takes the nodes from MPI's shared-memory split; k > 0 pretends
            that every k consecutive world ranks form a node (the last one may be
            smaller), so that the hierarchical algorithms can be tried on one machine.
    """

    allreduce_algorithm: str = "auto"
    broadcast_algorithm: str = "auto"
    allgather_algorithm: str = "auto"
    reducescatter_algorithm: str = "auto"
    alltoall_algorithm: str = "auto"
    recursive_doubling_max_bytes: int = 128 * 1024
    segment_bytes: int = 256 * 1024
    broadcast_pipeline_min_bytes: int = 512 * 1024
    hierarchical_min_bytes: int = 256 * 1024
    node_size: int = 0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = int if field.type == "int" else str
            if not isinstance(value, expected) or isinstance(value, bool):
                raise InvalidArgumentError(
                    f"{field.name} must be {expected.__name__}, got {value!r}")
        for collective, choices in ALGORITHMS.items():
            value = getattr(self, f"{collective}_algorithm")
            if value not in choices:
                raise InvalidArgumentError(
                    f"{collective}_algorithm={value!r} is not one of {', '.join(choices)}")
        for field in ("recursive_doubling_max_bytes", "broadcast_pipeline_min_bytes",
                      "hierarchical_min_bytes", "node_size"):
            if getattr(self, field) < 0:
                raise InvalidArgumentError(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.segment_bytes < 64:
            raise InvalidArgumentError(f"segment_bytes must be >= 64, got {self.segment_bytes}")


def environment_variable(field: str) -> str:
    """The variable overriding a field: ``segment_bytes`` -> ``RINGTRAIN_SEGMENT_BYTES``."""
    return "RINGTRAIN_" + field.upper()


_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Parse ``"65536"``, ``"64K"``, ``"64KiB"`` or ``"1M"`` (binary units) into bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


def settings_from_environment(environ: Mapping[str, str] | None = None) -> Settings:
    """Build :class:`Settings` from the defaults and the ``RINGTRAIN_*`` variables."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    defaults = Settings()
    for field in dataclasses.fields(Settings):
        variable = environment_variable(field.name)
        if variable not in environ:
            continue
        text = environ[variable]
        try:
            value: object = parse_size(text) if field.type == "int" else text.strip().lower()
            dataclasses.replace(defaults, **{field.name: value})
        except (ValueError, InvalidArgumentError) as error:
            warnings.warn(f"ignoring {variable}={text!r}: {error}", RuntimeWarning, stacklevel=2)
            continue
        values[field.name] = value
    return Settings(**values)


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
