"""ringtrain's exceptions: one hierarchy, every message naming rank, collective and tensor.

Each class also derives from the built-in exception a Python user would expect
(``TypeError`` for a wrong dtype, ``ValueError`` for a bad argument, ``RuntimeError``
for a failure across ranks), so ``except RuntimeError`` keeps working in scripts
written for Horovod.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class RingtrainError(Exception):
    """Base class of every error ringtrain raises on purpose."""


class NotInitializedError(RingtrainError, RuntimeError):
    """A collective or query was called before :func:`ringtrain.init`."""


class InvalidArgumentError(RingtrainError, ValueError):
    """An argument is wrong on this rank; raised before any communication."""


class UsageError(RingtrainError, RuntimeError):
    """An API was used in an order that cannot work, e.g. ``zero_grad()`` between
    ``backward()`` and ``step()`` of a DistributedOptimizer."""


class UnsupportedDtypeError(RingtrainError, TypeError):
    """The array's dtype is not supported by this collective or operation."""


class CommunicationError(RingtrainError, RuntimeError):
    """MPI reported a failure while a collective was moving data."""


class MismatchError(RingtrainError, RuntimeError):
    """Ranks called the same collective with different arguments.

    Raised on every rank of the process set, with the same message everywhere.

    Attributes:
        collective: name of the collective, e.g. ``"allreduce"``.
        tensor_name: the ``name=`` given to the call (``None`` when unnamed).
        differences: for each differing field, the value each rank sent,
            as ``{field: {rank: value}}``.
        hint: what to do about it, where the cause is known (e.g. calls from several
            threads), or None.
    """

    def __init__(self, collective: str, tensor_name: str | None,
                 differences: Mapping[str, Mapping[int, Any]], hint: str | None = None):
        self.collective = collective
        self.tensor_name = tensor_name
        self.differences = {field: dict(values) for field, values in differences.items()}
        self.hint = hint
        message = _describe_mismatch(collective, tensor_name, self.differences)
        super().__init__(message if hint is None else f"{message}. {hint}")


class MessageMismatchError(MismatchError):
    """A point-to-point message did not match the receive posted for it (shape, dtype or
    name); raised on both ranks with the same message, and nothing was written.

    Attributes:
        sender, receiver: world ranks of the pair.
        tag: the message's tag.
        differences: ``{field: {"sent": value, "expected": value}}`` for each field that
            differs.
    """

    def __init__(self, sender: int, receiver: int, tag: int, tensor_name: str | None,
                 differences: Mapping[str, Mapping[str, Any]]):
        self.sender, self.receiver, self.tag = sender, receiver, tag
        self.collective = "send"
        self.tensor_name = tensor_name
        self.differences = {field: dict(values) for field, values in differences.items()}
        self.hint = None
        parts = "; ".join(
            f"rank {sender} sent {field} {values['sent']}, rank {receiver} expected "
            f"{field} {values['expected']}" for field, values in self.differences.items())
        RingtrainError.__init__(
            self, f"send of tensor {tensor_label(tensor_name)} from rank {sender} to rank "
                  f"{receiver} (tag {tag}) does not match the receive posted for it: {parts}")


_rank: int | None = None


class NonFiniteWarning(RuntimeWarning):
    """A compressed reduction met inf or NaN (named by rank); they reach the result."""


def set_rank(rank: int | None) -> None:
    """Record this process's rank for error messages (``init`` sets it, ``shutdown`` clears it)."""
    global _rank
    _rank = rank


def subject(collective: str, name: str | None) -> str:
    """How an error names the failing call: ``"rank 3: allreduce of tensor 'w'"``."""
    prefix = "" if _rank is None else f"rank {_rank}: "
    return f"{prefix}{collective} of tensor {tensor_label(name)}"


def tensor_label(name: str | None) -> str:
    """How a tensor is named in messages: its name quoted, or ``(unnamed)``."""
    return "(unnamed)" if name is None else repr(name)


def format_ranks(ranks: Sequence[int]) -> str:
    """``[2]`` -> ``"rank 2"``, ``[0, 1, 3]`` -> ``"ranks 0,1,3"``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ",".join(str(r) for r in ranks)


def _describe_mismatch(collective: str, tensor_name: str | None,
                       differences: Mapping[str, Mapping[int, Any]]) -> str:
    parts = []
    for field, by_rank in differences.items():
        if field == "refused":
            parts.append(_describe_refusals(by_rank))
            continue
        groups: dict[str, list[int]] = {}
        for rank in sorted(by_rank):
            groups.setdefault(_show(by_rank[rank]), []).append(rank)
        # The smallest group first: it is usually the odd one out.
        ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
        parts.append(", ".join(f"{format_ranks(ranks)} sent {field} {value}"
                               for value, ranks in ordered))
    return (f"{collective} of tensor {tensor_label(tensor_name)} was called with different "
            f"arguments across ranks: " + "; ".join(parts))


def _describe_refusals(by_rank: Mapping[int, Any]) -> str:
    """Which ranks refused the call, and why (each reason names its rank)."""
    refusing = sorted(rank for rank, reason in by_rank.items() if reason != ABSENT)
    reasons = "; ".join(dict.fromkeys(str(by_rank[rank]) for rank in refusing))
    return f"{format_ranks(refusing)} refused the call before sending anything ({reasons})"


ABSENT = "(absent)"
"""How a field a rank did not send shows in a MismatchError."""


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
