"""horovodrun's command-line flags on ``ringtrain-run``, so a Horovod job's command line
runs after changing its first word.

Each flag is mapped to a ringtrain option or variable, accepted without effect (one line
on stderr says so), or refused with the reason. ``-np``, ``-H``/``--hosts``,
``--hostfile``, ``--min-np``, ``--max-np``, ``--host-discovery-script`` and ``--verbose``
are ringtrain-run's own; the flags below are the rest (docs/horovod.md has the table).
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, field

from ..common.environment import (ALLGATHER_ALGORITHM, ALLREDUCE_ALGORITHM, FUSION_THRESHOLD,
                                  LOG_LEVEL, STALL_CHECK_SECONDS, STALL_SHUTDOWN_SECONDS)

_LOG_LEVELS = {"TRACE": "DEBUG", "DEBUG": "DEBUG", "INFO": "INFO", "WARNING": "WARNING",
               "ERROR": "ERROR", "FATAL": "CRITICAL"}

WITHOUT_EFFECT: dict[str, str] = {
    "--timeline-mark-cycles": "there are no cycles to mark",
    "--cycle-time-ms": "calls start when they are made: there is no cycle",
    "--cache-capacity": "calls are planned once and kept; there is no response cache",
    "--disable-cache": "calls are planned once and kept; there is no response cache",
    "--start-timeout": "mpiexec starts the ranks and reports a failed start itself",
    "--mpi": "ringtrain always runs over MPI",
    "--autotune": "settings are not tuned at run time",
    "--num-nccl-streams": "ringtrain does not use NCCL",
    "--thread-affinity": "ringtrain's collectives run on the caller's threads",
    "--mpi-threads-disable": "ringtrain asks MPI for MPI_THREAD_MULTIPLE",
    "--log-hide-timestamp": "ringtrain's log lines carry no timestamp",
    "--elastic-timeout": "a restarted job waits for its ranks as mpiexec does",
}
"""Flags accepted without effect, and why."""

TAKING_A_VALUE = {"--cycle-time-ms", "--cache-capacity", "--start-timeout",
                  "--num-nccl-streams", "--thread-affinity", "--elastic-timeout"}
"""The flags of :data:`WITHOUT_EFFECT` that take a value."""

REFUSED: dict[str, str] = {
    "--gloo": "ringtrain runs over MPI only",
    "--jsrun": "start the ranks with jsrun yourself, each running the script",
    "--ssh-port": "mpiexec starts the remote ranks: set the port in ssh's configuration",
    "--ssh-identity-file": "mpiexec starts the remote ranks: set the key in ssh's "
                           "configuration",
    "--config-file": "give the options on the command line",
    "--output-filename": "each rank's output is prefixed with its rank on stdout and stderr",
}
"""Flags refused, and why."""

_SHORT = {"--ssh-port": ("-p",), "--ssh-identity-file": ("-i",)}


@dataclass
class Translation:
    """What horovodrun's flags of one command line mean for ringtrain-run.

    Attributes:
        environment: variables for every rank.
        mpiexec_args: extra options for ``mpiexec`` (``--mpi-args``).
        network_interface: ``--network-interface``, for the mpiexec of its vendor.
        notes: one line per flag accepted without effect.
    """

    environment: dict[str, str] = field(default_factory=dict)
    mpiexec_args: list[str] = field(default_factory=list)
    network_interface: str | None = None
    notes: list[str] = field(default_factory=list)


class RefusedFlag(ValueError):
    """A horovodrun flag ringtrain-run cannot honour; the message says why."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add horovodrun's flags to ``parser`` (their destinations start with ``hvd_``)."""
    group = parser.add_argument_group("horovodrun's flags (see docs/horovod.md)")
    group.add_argument("--fusion-threshold-mb", dest="hvd_fusion_mb", type=float,
                       metavar="MB", help=f"{FUSION_THRESHOLD.name} in MiB")
    group.add_argument("--log-level", dest="hvd_log_level", metavar="LEVEL",
                       help=f"{LOG_LEVEL.name} (TRACE is DEBUG, FATAL is CRITICAL)")
    group.add_argument("--no-stall-check", dest="hvd_no_stall_check", action="store_true",
                       help=f"{STALL_CHECK_SECONDS.name}=0")
    group.add_argument("--stall-check-warning-time-seconds", dest="hvd_stall_check",
                       type=float, metavar="S", help=STALL_CHECK_SECONDS.name)
    group.add_argument("--stall-check-shutdown-time-seconds", dest="hvd_stall_shutdown",
                       type=float, metavar="S", help=STALL_SHUTDOWN_SECONDS.name)
    group.add_argument("--hierarchical-allreduce", dest="hvd_hierarchical_allreduce",
                       action="store_true",
                       help=f"{ALLREDUCE_ALGORITHM.name}=hierarchical")
    group.add_argument("--hierarchical-allgather", dest="hvd_hierarchical_allgather",
                       action="store_true",
                       help=f"{ALLGATHER_ALGORITHM.name}=hierarchical")
    group.add_argument("--network-interface", dest="hvd_network_interface", metavar="IFACE",
                       help="the network interface mpiexec's ranks talk over")
    group.add_argument("--mpi-args", dest="hvd_mpi_args", metavar="ARGS",
                       help="more options for mpiexec, as one string")
    group.add_argument("--reset-limit", dest="hvd_reset_limit", type=int, metavar="K",
                       help="--max-restarts K")
    for flag, why in WITHOUT_EFFECT.items():
        group.add_argument(flag, dest=_destination(flag),
                           **({"metavar": "VALUE"} if flag in TAKING_A_VALUE
                              else {"action": "store_true"}),
                           help=f"accepted, no effect: {why}")
    for flag in REFUSED:
        group.add_argument(flag, *_SHORT.get(flag, ()), dest=_destination(flag),
                           action="store_true", help=argparse.SUPPRESS)


def _destination(flag: str) -> str:
    return "hvd_" + flag.lstrip("-").replace("-", "_")


def translate(options: argparse.Namespace) -> Translation:
    """What the horovodrun flags among ``options`` mean.

    Raises:
        RefusedFlag: a refused flag, or a ``--log-level`` that is not a level.
    """
    for flag, why in REFUSED.items():
        if getattr(options, _destination(flag)):
            raise RefusedFlag(f"{flag} is not supported: {why}")
    result = Translation()
    environment = result.environment
    if options.hvd_fusion_mb is not None:
        environment[FUSION_THRESHOLD.name] = str(int(options.hvd_fusion_mb * (1 << 20)))
    if options.hvd_log_level is not None:
        level = _LOG_LEVELS.get(options.hvd_log_level.strip().upper())
        if level is None:
            raise RefusedFlag(f"--log-level {options.hvd_log_level!r}: use one of "
                              f"{', '.join(_LOG_LEVELS)}")
        environment[LOG_LEVEL.name] = level
    if options.hvd_no_stall_check:
        environment[STALL_CHECK_SECONDS.name] = "0"
    elif options.hvd_stall_check is not None:
        environment[STALL_CHECK_SECONDS.name] = str(options.hvd_stall_check)
    if options.hvd_stall_shutdown is not None:
        environment[STALL_SHUTDOWN_SECONDS.name] = str(options.hvd_stall_shutdown)
    if options.hvd_hierarchical_allreduce:
        environment[ALLREDUCE_ALGORITHM.name] = "hierarchical"
    if options.hvd_hierarchical_allgather:
        environment[ALLGATHER_ALGORITHM.name] = "hierarchical"
    if options.hvd_mpi_args:
        result.mpiexec_args = shlex.split(options.hvd_mpi_args)
    result.network_interface = options.hvd_network_interface
    for flag, why in WITHOUT_EFFECT.items():
        if getattr(options, _destination(flag)) not in (None, False):
            result.notes.append(f"{flag} has no effect: {why}")
    return result
