"""Restarting a failed job: where the next start runs, and whether there is one.

With ``--max-restarts K``, a job in which a rank fails is started again (a fresh
``mpiexec``), up to K times; the ranks pick up the last state committed through
:mod:`ringtrain.elastic` from ``$RINGTRAIN_ELASTIC_DIR``. Without a host discovery
script every start has the same ranks on the same hosts. With one, every start (the
first included) runs it; it prints the hosts that are available now, ``HOST:SLOTS`` a
line, and the job gets the sum of their slots, at most ``--max-np``, and does not start
with fewer than ``--min-np``. A host whose rank failed is left out of the next starts
for a cool-down (:class:`Blacklist`). While a job runs, the script is polled
(:mod:`ringtrain.launcher.host_watch`) and a change of hosts resizes the job at its
next commit, without a failure (:mod:`ringtrain.common.resize_protocol`).

Everything except :func:`discover_hosts` is a pure function, tested without MPI.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from collections.abc import Sequence

from ..common.environment import ELASTIC_DIR, RESTART_COUNT
from .hosts import Host, HostListError, parse_host_list, total_slots
from .job import JobResult
from .report import describe_exit

ELASTIC_DIR_VARIABLE = ELASTIC_DIR.name
RESTART_COUNT_VARIABLE = RESTART_COUNT.name
DISCOVERY_TIMEOUT = 60.0


class DiscoveryError(RuntimeError):
    """The host discovery script failed or printed something that is not a host list."""


class NotEnoughRanks(RuntimeError):
    """Fewer ranks are available than ``--min-np``."""


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """The launcher's restart settings.

    Attributes:
        max_restarts: how many times a failed job is started again (0: never).
        min_np: the fewest ranks a job starts with.
        max_np: the most ranks a job starts with (None: no limit).
        discovery_script: the executable that lists the available hosts, or None.
        discovery_interval: seconds between two polls of the script while a job runs.
        blacklist_cooldown: a failed host's first cool-down and the longest, in seconds.
    """

    max_restarts: int = 0
    min_np: int = 1
    max_np: int | None = None
    discovery_script: str | None = None
    discovery_interval: float = 1.0
    blacklist_cooldown: tuple[float, float] = (10.0, 300.0)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one start of the job runs: ``nprocs`` ranks on ``hosts`` (empty: here)."""

    nprocs: int
    hosts: tuple[Host, ...] = ()

    def host_of_rank(self, rank: int) -> str | None:
        """The host rank ``rank`` runs on (the ranks fill the hosts' slots in order), or
        None when the start names no hosts."""
        first = 0
        for host in self.hosts:
            if rank < first + host.slots:
                return host.name
            first += host.slots
        return None

    def describe(self) -> str:
        """``localhost:2,node2:1``, or ``N ranks here``."""
        if not self.hosts:
            return f"{self.nprocs} rank{'s' if self.nprocs != 1 else ''} here"
        return ",".join(f"{host.name}:{host.slots}" for host in self.hosts)


class Blacklist:
    """Hosts whose ranks failed, kept out of the job for a cool-down (as Horovod's
    ``--blacklist-cooldown-range``): a host's first failure keeps it out for the shorter
    bound, each further one twice as long as the last, at most the longer bound.

    Args:
        cooldown: the shortest and the longest cool-down, in seconds.
    """

    def __init__(self, cooldown: tuple[float, float]):
        self.cooldown = cooldown
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def add(self, host: str, now: float) -> float:
        """Keep ``host`` out from ``now`` on; returns the cool-down in seconds."""
        failures = self._failures[host] = self._failures.get(host, 0) + 1
        shortest, longest = self.cooldown
        seconds = min(longest, shortest * 2 ** (failures - 1))
        self._until[host] = now + seconds
        return seconds

    def allowed(self, hosts: Sequence[Host], now: float) -> list[Host]:
        """``hosts`` without those cooling down at ``now``."""
        return [host for host in hosts if self._until.get(host.name, 0.0) <= now]


def parse_discovered_hosts(text: str) -> list[Host]:
    """Read a discovery script's output: ``HOST:SLOTS`` (or ``HOST``) a line; blank
    lines and ``#`` comments are skipped. No line at all is no host.

    Raises:
        DiscoveryError: a line that is not ``HOST`` or ``HOST:SLOTS``.
    """
    hosts = []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            hosts += parse_host_list(entry)
        except HostListError as error:
            raise DiscoveryError(f"the host discovery script printed {entry!r}: {error}") \
                from None
    return hosts


def discover_hosts(script: str, restart: int, timeout: float = DISCOVERY_TIMEOUT) -> list[Host]:
    """Run the discovery script and read the hosts it prints.

    The script runs with ``RINGTRAIN_RESTART_COUNT`` set to the number of the start it
    is asked about (0 for the first).

    Raises:
        DiscoveryError: it cannot run, exits non-zero, runs past ``timeout`` seconds,
            or prints a malformed line.
    """
    environment = {**os.environ, RESTART_COUNT_VARIABLE: str(restart)}
    try:
        finished = subprocess.run([script], capture_output=True, text=True, errors="replace",
                                  timeout=timeout, env=environment, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"the host discovery script {script} ran for more than "
                             f"{timeout:.0f} s") from None
    except OSError as error:
        raise DiscoveryError(f"cannot run the host discovery script {script}: "
                             f"{error.strerror or error}") from None
    if finished.returncode != 0:
        last = (finished.stderr.strip().splitlines() or [""])[-1]
        raise DiscoveryError(f"the host discovery script {script} "
                             f"{describe_exit(finished.returncode)}"
                             + (f": {last}" if last else ""))
    return parse_discovered_hosts(finished.stdout)


def place_on_discovered_hosts(hosts: Sequence[Host], options: ElasticOptions,
                              blacklist: Blacklist | None = None,
                              now: float = 0.0) -> Placement:
    """The ranks of a start on the discovered hosts: their slots, capped at ``max_np``;
    hosts beyond the cap are left out, and so are those cooling down in ``blacklist`` at
    ``now``, unless the others have fewer than ``min_np`` slots (a failure need not be
    the host's fault).

    Raises:
        NotEnoughRanks: fewer slots than ``min_np``.
    """
    if blacklist is not None:
        allowed = blacklist.allowed(hosts, now)
        if total_slots(allowed) >= options.min_np:
            hosts = allowed
    available = total_slots(hosts)
    if available < options.min_np:
        listed = ",".join(f"{host.name}:{host.slots}" for host in hosts) or "no host"
        raise NotEnoughRanks(f"the host discovery script offers {available} "
                             f"slot{'s' if available != 1 else ''} ({listed}), fewer than "
                             f"--min-np {options.min_np}")
    nprocs = available if options.max_np is None else min(available, options.max_np)
    used, kept = 0, []
    for host in hosts:
        if used >= nprocs:
            break
        kept.append(Host(host.name, min(host.slots, nprocs - used)))
        used += kept[-1].slots
    return Placement(nprocs, tuple(kept))


def should_restart(result: JobResult, restarts_done: int, options: ElasticOptions) -> bool:
    """Whether a job that ended with ``result`` is started again: it failed, it was not
    stopped by a signal to the launcher (Ctrl-C), and restarts remain."""
    return (result.exit_code != 0 and result.interrupted is None
            and restarts_done < options.max_restarts)


def describe_failure(result: JobResult) -> str:
    """``rank 1 failed (was killed by signal 9 (SIGKILL))``, or ``the job failed (...)``
    when no rank reported a failure."""
    record = result.first_failure
    if record is None:
        return f"the job failed ({result.summary or f'exit code {result.exit_code}'})"
    who = "a rank" if record.rank is None else f"rank {record.rank}"
    how = describe_exit(record.returncode)
    if record.exception is not None:
        how = f"raised {record.exception} and {how}"
    return f"{who} failed ({how})"


def resize_announcement(before: Placement, after: Placement) -> str:
    """The launcher's one line for a resize, e.g. ``the hosts changed (localhost:2 ->
    localhost:3): resuming from the last commit with 3 ranks``."""
    ranks = f"{after.nprocs} rank{'s' if after.nprocs != 1 else ''}"
    return (f"the hosts changed ({before.describe()} -> {after.describe()}): resuming from "
            f"the last commit with {ranks}")


def restart_announcement(result: JobResult, placement: Placement, restart: int,
                         options: ElasticOptions) -> str:
    """The launcher's line before restart number ``restart`` (counted from 1), e.g.
    ``rank 1 failed (...); restarting with 2 ranks (restart 1 of 3)``."""
    ranks = f"{placement.nprocs} rank{'s' if placement.nprocs != 1 else ''}"
    return (f"{describe_failure(result)}; restarting with {ranks} "
            f"(restart {restart} of {options.max_restarts})")
