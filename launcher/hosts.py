"""Host lists: ``-H host1:2,host2:2`` and host files, read into one vendor-neutral form.

A host file holds one host a line, as ``host``, ``host:SLOTS`` or Open MPI's
``host slots=SLOTS`` (a ``max_slots=N`` after it is ignored); ``#`` starts a comment.
A host without a count has one slot.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?$")
_ENTRY = re.compile(r"^(?P<name>[^:\s]+)(:(?P<slots>[^:\s]*))?$")
_HOSTFILE_LINE = re.compile(r"^(?P<name>\S+?)(:(?P<colon>\S*)|\s+slots\s*=\s*(?P<slots>\S*)"
                            r"(\s+max_slots\s*=\s*\d+)?)?$")


class HostListError(ValueError):
    """A host list or host file that cannot be read; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host and how many ranks it takes.

    Attributes:
        name: the host name (or address) that the MPI's launcher reaches it by.
        slots: the number of ranks it takes before the next host is used.
    """

    name: str
    slots: int = 1


def _host(name: str, slots_text: str | None, where: str) -> Host:
    if not _HOST_NAME.match(name):
        raise HostListError(f"{where}: {name!r} is not a host name")
    if slots_text is None:
        return Host(name)
    if not slots_text.isdigit() or int(slots_text) < 1:
        raise HostListError(f"{where}: the slot count of {name!r} must be a positive integer, "
                            f"got {slots_text!r}")
    return Host(name, int(slots_text))


def parse_host_list(text: str) -> list[Host]:
    """Read ``host1:2,host2:2`` (a host without ``:SLOTS`` has one slot).

    Raises:
        HostListError: an empty entry, a bad host name or a slot count that is not a
            positive integer.
    """
    hosts = []
    for entry in text.split(","):
        match = _ENTRY.match(entry.strip())
        if match is None:
            raise HostListError(f"malformed host list {text!r}: entry {entry!r} is not "
                                "HOST or HOST:SLOTS")
        hosts.append(_host(match["name"], match["slots"], f"malformed host list {text!r}"))
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Read a host file (``host``, ``host:SLOTS`` or ``host slots=SLOTS`` a line).

    Raises:
        HostListError: the file cannot be read, holds no host, or has a malformed line.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.readlines()
    except (OSError, UnicodeDecodeError) as error:
        raise HostListError(f"cannot read host file {path}: "
                            f"{getattr(error, 'strerror', None) or error}") from None
    hosts = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"host file {path}, line {number}"
        match = _HOSTFILE_LINE.match(text)
        if match is None:
            raise HostListError(f"{where}: {text!r} is not HOST, HOST:SLOTS or HOST slots=N")
        slots = match["colon"] if match["colon"] is not None else match["slots"]
        hosts.append(_host(match["name"], slots, where))
    if not hosts:
        raise HostListError(f"host file {path} names no host")
    return hosts


def total_slots(hosts: Sequence[Host]) -> int:
    """The number of ranks the hosts take without oversubscription."""
    return sum(host.slots for host in hosts)
