"""The ``ringtrain-run`` command line (also ``python -m ringtrain.launcher``).

``ringtrain-run -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--env NAME=VAL ...]
[--timeline PATH] python train.py ...`` finds the ``mpiexec`` of the MPI that mpi4py
loads, translates the options into its vendor's flags and runs every rank under the
per-rank supervisor. Bad input gets one line on stderr and exit code 2, before anything
is started.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..common.environment import KV_SERVERS, TIMELINE_MERGED_BY_LAUNCHER
from ..common.resize_protocol import HOSTS_UPDATED, RESIZING, clear, is_marked
from .command import CommandError, build_mpiexec_argv, python_target, rank_command
from .horovodrun import RefusedFlag, Translation, add_flags, translate
from .host_watch import HostWatcher
from .hosts import Host, HostListError, parse_host_list, read_hostfile
from .mpi_vendor import Mpiexec, MpiexecError, query_mpiexec
from .rank_env import torch_rendezvous, usable_cores
from .restart import (ELASTIC_DIR_VARIABLE, RESTART_COUNT_VARIABLE, Blacklist, DiscoveryError,
                      ElasticOptions, NotEnoughRanks, Placement, discover_hosts,
                      place_on_discovered_hosts, resize_announcement, restart_announcement,
                      should_restart)
from .timeline_merge import TIMELINE_VARIABLE, JobTimeline

if TYPE_CHECKING:
    from .job import JobResult

PROG = "ringtrain-run"
USAGE_ERROR = 2
ENVIRONMENT_ERROR = 1
_VARIABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

EPILOG = """\
examples:
  ringtrain-run -np 2 python train.py --epochs 3
  ringtrain-run -np 8 -H node1:4,node2:4 --env NCCL_DEBUG=INFO python -m mypkg.train
  ringtrain-run --check-build

Every rank gets OMP_NUM_THREADS (cores / ranks on its node), CUDA_VISIBLE_DEVICES (its
local rank, when the node has GPUs) and PYTHONUNBUFFERED=1 unless already set. Output
lines start with [rank]. An unhandled exception on any rank prints its traceback and
stops the job; the exit code is the first failing rank's (128 + N for signal N).
With --max-restarts K, a failed job is started again (up to K times) and its ranks
resume from the state they committed with ringtrain.elastic in $RINGTRAIN_ELASTIC_DIR.
With --timeline PATH, every rank records what its collectives do, and the ranks' records
are merged into PATH when the job ends: open it in https://ui.perfetto.dev.
"""


class CommandLineError(ValueError):
    """Bad command-line input; its message is printed on one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise instead of printing the usage and exiting: the caller prints one line."""
        raise CommandLineError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ringtrain-run``."""
    import ringtrain

    parser = _Parser(prog=PROG, allow_abbrev=False, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     usage=f"{PROG} -np N [-H HOST:SLOTS,... | --hostfile FILE] "
                           "[--env NAME=VALUE ...] [--timeline PATH]\n"
                           "                     [--max-restarts K] [--min-np N] [--max-np N] "
                           "[--elastic-dir DIR]\n"
                           "                     [--host-discovery-script PATH] "
                           "COMMAND [ARGS...]\n"
                           f"       {PROG} --check-build",
                     description="Start a ringtrain job: COMMAND on N ranks under the "
                                 "MPI that mpi4py uses.")
    parser.add_argument("-np", "-n", "--num-proc", dest="nprocs", type=int, metavar="N",
                        help="number of ranks to start")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and how many ranks each takes, e.g. node1:4,node2:4 "
                            "(default: all ranks on this machine)")
    hosts.add_argument("--hostfile", "-hostfile", metavar="FILE",
                       help="a file of hosts, one a line: HOST, HOST:SLOTS or "
                            "HOST slots=SLOTS")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set a variable on every rank (NAME alone passes on its "
                             "value here); may be repeated")
    parser.add_argument("--servers", type=int, default=None, metavar="K",
                        help="ringtrain.kvstore's async modes: the last K ranks serve the "
                             "keys (sets $RINGTRAIN_KV_SERVERS; default 1)")
    parser.add_argument("--timeline", "--timeline-filename", metavar="PATH",
                        help="record what every rank's collectives do, as a Chrome trace "
                             "written to PATH when the job ends (view it in Perfetto)")
    elastic = parser.add_argument_group("restarts (elastic training, see ringtrain.elastic)")
    elastic.add_argument("--max-restarts", type=int, default=0, metavar="K",
                         help="start a failed job again, up to K times (default 0)")
    elastic.add_argument("--min-np", type=int, default=None, metavar="N",
                         help="start no job with fewer than N ranks (default 1)")
    elastic.add_argument("--max-np", type=int, default=None, metavar="N",
                         help="start no job with more than N ranks (default: -np with a "
                              "discovery script, else no limit)")
    elastic.add_argument("--host-discovery-script", metavar="PATH",
                         help="an executable printing the available hosts, HOST:SLOTS a "
                              "line; run before every start, which gets their slots as ranks")
    elastic.add_argument("--discovery-interval", type=float, default=1.0, metavar="SECONDS",
                         help="how often the discovery script is run while the job runs; "
                              "when the hosts change, the job resizes at its next commit "
                              "(default 1)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                         default=(10.0, 300.0), metavar=("MIN", "MAX"),
                         help="a host whose rank failed is left out for MIN seconds, twice "
                              "as long after each further failure, at most MAX (default "
                              "10 300)")
    elastic.add_argument("--elastic-dir", metavar="DIR",
                         help="where the ranks commit their state ($RINGTRAIN_ELASTIC_DIR); "
                              "default: a temporary directory, removed at the end")
    parser.add_argument("--check-build", action="store_true",
                        help="print the versions of ringtrain, Python, mpi4py, the MPI and "
                             "the GPU libraries, the GPUs and the collectives; run nothing")
    parser.add_argument("--verbose", action="store_true",
                        help="print the mpiexec command line before running it")
    parser.add_argument("--version", action="version", version=f"{PROG} {ringtrain.__version__}")
    add_flags(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                        help="what each rank runs, e.g. python train.py")
    return parser


def parse_environment(assignments: Sequence[str]) -> dict[str, str]:
    """``["A=1", "B"]`` -> ``{"A": "1", "B": <B's value here>}``.

    Raises:
        CommandLineError: a name that is not a variable name, or a bare name not set here.
    """
    environment = {}
    for assignment in assignments:
        name, equals, value = assignment.partition("=")
        if not _VARIABLE_NAME.match(name):
            raise CommandLineError(f"--env {assignment!r}: expected NAME=VALUE with NAME a "
                                   "variable name")
        if not equals:
            if name not in os.environ:
                raise CommandLineError(f"--env {name}: {name} is not set here; give {name}=VALUE")
            value = os.environ[name]
        environment[name] = value
    return environment


def kvstore_servers(servers: int | None, nprocs: int | None,
                    environment: dict[str, str]) -> None:
    """Set ``RINGTRAIN_KV_SERVERS`` in ``environment`` for ``--servers K``.

    Raises:
        CommandLineError: K < 1, or no rank left to be a worker.
    """
    if servers is None:
        return
    if servers < 1:
        raise CommandLineError(f"--servers {servers}: give a number of server ranks >= 1")
    if nprocs is not None and servers >= nprocs:
        raise CommandLineError(f"--servers {servers}: -np {nprocs} leaves no rank to be a "
                               f"worker")
    environment[KV_SERVERS.name] = str(servers)


def job_timeline(path: str | None, environment: dict[str, str]) -> JobTimeline | None:
    """For ``--timeline PATH``: check that PATH can be written here, and give every rank
    ``RINGTRAIN_TIMELINE`` (the absolute path) in ``environment``, and the word that the
    launcher merges the ranks' files.

    Returns:
        What merges the ranks' files after the job; None without ``--timeline``.

    Raises:
        CommandLineError: PATH is a directory or its directory is missing or not writable, or
            ``--env`` sets ``RINGTRAIN_TIMELINE`` too.
    """
    if path is None:
        return None
    if TIMELINE_VARIABLE in environment:
        raise CommandLineError(f"--timeline and --env {TIMELINE_VARIABLE} both give the timeline: "
                               "give --timeline alone")
    timeline = JobTimeline(path)
    directory = os.path.dirname(timeline.path)
    if os.path.isdir(timeline.path):
        raise CommandLineError(f"--timeline {path}: {timeline.path} is a directory; give a file "
                               "name, e.g. timeline.json")
    if not os.path.isdir(directory):
        raise CommandLineError(f"--timeline {path}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CommandLineError(f"--timeline {path}: cannot write in {directory}")
    environment[TIMELINE_VARIABLE] = timeline.path
    environment[TIMELINE_MERGED_BY_LAUNCHER.name] = "1"
    return timeline


def _finish_timeline(timeline: JobTimeline | None) -> None:
    """Merge the ranks' timelines, once, and say so on one line."""
    from .job import print_summary

    if timeline is None:
        return
    try:
        line = timeline.collect()
    except OSError as error:
        line = (f"cannot write the timeline {timeline.path} ({error.strerror or error}); "
                "the ranks' files are kept")
    if line is not None:
        print_summary(line)


def _check_command(command: Sequence[str], local: bool) -> None:
    """Refuse a command that cannot start: nothing given, or (on this machine) a program
    or Python script that does not exist."""
    if not command:
        raise CommandLineError(f"no command to run: give one after the options, e.g. "
                               f"{PROG} -np 2 python train.py")
    if command[0].startswith("-"):
        raise CommandLineError(f"unrecognized option {command[0]!r}")
    if not local:
        return
    if shutil.which(command[0]) is None:
        raise CommandLineError(f"command {command[0]!r} not found (not an executable file, "
                               "nor on PATH)")
    target = python_target(command)
    if target is not None and target[0] not in ("-c", "-m") and not os.path.isfile(target[0]):
        raise CommandLineError(f"python script {target[0]!r} not found "
                               f"(in {os.getcwd()})")


def _hosts(options: argparse.Namespace) -> list[Host]:
    try:
        if options.hosts is not None:
            return parse_host_list(options.hosts)
        if options.hostfile is not None:
            return read_hostfile(options.hostfile)
    except HostListError as error:
        raise CommandLineError(str(error)) from None
    return []


def elastic_options(options: argparse.Namespace) -> ElasticOptions:
    """The restart settings of the command line, checked.

    Raises:
        CommandLineError: a negative ``--max-restarts``, a count below 1, ``--min-np`` above
            ``--max-np``, ``-np`` outside them, a discovery script given with hosts or
            not executable, or ``-np`` missing without a discovery script.
    """
    script = options.host_discovery_script
    if options.max_restarts < 0:
        raise CommandLineError(f"--max-restarts must be 0 or more, got {options.max_restarts}")
    for flag, value in (("-np", options.nprocs), ("--min-np", options.min_np),
                        ("--max-np", options.max_np)):
        if value is not None and value < 1:
            raise CommandLineError(f"{flag} must be a positive number of ranks, got {value}")
    if script is None and options.nprocs is None:
        raise CommandLineError("-np N is required: the number of ranks to start")
    max_np = options.max_np if options.max_np is not None or script is None else options.nprocs
    min_np = 1 if options.min_np is None else options.min_np
    if max_np is not None and min_np > max_np:
        raise CommandLineError(f"--min-np {min_np} is more than --max-np {max_np}")
    if script is None:
        if options.nprocs < min_np:
            raise CommandLineError(f"-np {options.nprocs} is less than --min-np {min_np}")
        if max_np is not None and options.nprocs > max_np:
            raise CommandLineError(f"-np {options.nprocs} is more than --max-np {max_np}")
    else:
        if options.hosts is not None or options.hostfile is not None:
            raise CommandLineError("--host-discovery-script chooses the hosts: give no -H or "
                                   "--hostfile with it")
        if not (os.path.isfile(script) and os.access(script, os.X_OK)):
            raise CommandLineError(f"host discovery script {script!r} is not an executable file")
    if not options.discovery_interval > 0:
        raise CommandLineError(f"--discovery-interval must be a positive number of seconds, "
                               f"got {options.discovery_interval}")
    shortest, longest = options.blacklist_cooldown_range
    if not 0 <= shortest <= longest:
        raise CommandLineError(f"--blacklist-cooldown-range MIN MAX needs 0 <= MIN <= MAX, got "
                               f"{shortest:g} {longest:g}")
    return ElasticOptions(options.max_restarts, min_np, max_np,
                          None if script is None else os.path.abspath(script),
                          options.discovery_interval, (shortest, longest))


def _placement(elastic: ElasticOptions, nprocs: int | None, hosts: list[Host],
               restart: int, blacklist: Blacklist) -> Placement:
    if elastic.discovery_script is None:
        return Placement(nprocs, tuple(hosts))
    return place_on_discovered_hosts(discover_hosts(elastic.discovery_script, restart), elastic,
                                     blacklist, time.monotonic())


def horovodrun_flags(options: argparse.Namespace) -> Translation:
    """What horovodrun's flags among ``options`` mean; ``--reset-limit K`` becomes
    ``--max-restarts K``. Each flag without effect is said on stderr.

    Raises:
        CommandLineError: a refused flag, or ``--reset-limit`` with ``--max-restarts``.
    """
    try:
        translation = translate(options)
    except RefusedFlag as error:
        raise CommandLineError(str(error)) from None
    if options.hvd_reset_limit is not None:
        if options.max_restarts:
            raise CommandLineError("--reset-limit and --max-restarts both give the restarts: "
                                   "give one")
        options.max_restarts = options.hvd_reset_limit
    for note in translation.notes:
        print(f"{PROG}: {note}", file=sys.stderr)
    return translation


def _launch(options: argparse.Namespace) -> int:
    horovodrun = horovodrun_flags(options)
    elastic = elastic_options(options)
    command = list(options.command)
    if command[:1] == ["--"]:
        command = command[1:]
    hosts = _hosts(options)
    environment = {**horovodrun.environment, **parse_environment(options.env)}
    kvstore_servers(options.servers, options.nprocs, environment)
    timeline = job_timeline(options.timeline, environment)
    _check_command(command, local=not hosts and elastic.discovery_script is None)
    try:
        mpiexec = query_mpiexec()
    except MpiexecError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return ENVIRONMENT_ERROR
    blacklist = Blacklist(elastic.blacklist_cooldown)
    try:
        placement = _placement(elastic, options.nprocs, hosts, 0, blacklist)
    except (DiscoveryError, NotEnoughRanks) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return ENVIRONMENT_ERROR
    restarting = (elastic.max_restarts > 0 or elastic.discovery_script is not None
                  or options.elastic_dir is not None)
    created_directory = None
    if restarting:
        if options.elastic_dir is None:
            created_directory = tempfile.mkdtemp(prefix="ringtrain-elastic-")
        else:
            os.makedirs(options.elastic_dir, exist_ok=True)
        environment[ELASTIC_DIR_VARIABLE] = os.path.abspath(
            options.elastic_dir or created_directory)
    try:
        return _run_with_restarts(options, elastic, mpiexec, command, environment, placement,
                                  restarting, timeline, horovodrun, blacklist)
    finally:
        _finish_timeline(timeline)  # when the job did not get as far as its summary
        if created_directory is not None:
            shutil.rmtree(created_directory, ignore_errors=True)


def _run_with_restarts(options: argparse.Namespace, elastic: ElasticOptions, mpiexec: Mpiexec,
                       command: list[str], environment: dict[str, str], placement: Placement,
                       restarting: bool, timeline: JobTimeline | None,
                       horovodrun: Translation, blacklist: Blacklist) -> int:
    from .job import print_summary, run_job_attempt

    directory = environment.get(ELASTIC_DIR_VARIABLE)
    restart = failures = 0
    while True:
        if restarting:
            environment[RESTART_COUNT_VARIABLE] = str(restart)
        first_host = placement.host_of_rank(0)
        attempt = {**environment, **torch_rendezvous(first_host, {**os.environ, **environment})}
        try:
            argv = build_mpiexec_argv(mpiexec.vendor, mpiexec.path, placement.nprocs,
                                      rank_command(command), hosts=placement.hosts,
                                      environment=attempt, local_cores=usable_cores(),
                                      as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
                                      network_interface=horovodrun.network_interface,
                                      extra_options=horovodrun.mpiexec_args)
        except CommandError as error:
            raise CommandLineError(str(error)) from None
        if options.verbose:
            print(f"{PROG}: {mpiexec.vendor.value} {mpiexec.version}: {shlex.join(argv)}",
                  file=sys.stderr, flush=True)
        if timeline is not None:
            timeline.before_start(placement.nprocs)
        watcher = None if elastic.discovery_script is None or directory is None else \
            HostWatcher(elastic, blacklist, placement, directory, restart).start()
        result = run_job_attempt(argv, placement.nprocs)
        changed = watcher.stop() if watcher is not None else None
        resized = is_marked(directory, RESIZING)
        clear(directory, RESIZING, HOSTS_UPDATED)
        if resized and result.exit_code == 0 and result.interrupted is None:
            restart += 1
            try:
                resumed = changed or _placement(elastic, placement.nprocs,
                                                list(placement.hosts), restart, blacklist)
            except (DiscoveryError, NotEnoughRanks) as error:
                _finish_timeline(timeline)
                print_summary(f"the job stopped to resize, but cannot restart: {error}")
                return ENVIRONMENT_ERROR
            print_summary(resize_announcement(placement, resumed))
            placement = resumed
            continue
        if not should_restart(result, failures, elastic):
            _finish_timeline(timeline)  # before the summary, which stays the last line
            if result.summary is not None:
                spent = f"; no restart left (--max-restarts {elastic.max_restarts})" \
                    if result.exit_code != 0 and elastic.max_restarts > 0 \
                    and result.interrupted is None else ""
                print_summary(result.summary + spent)
            return result.exit_code
        restart += 1
        failures += 1
        failed_host = _blacklist_failed_host(result, placement, elastic, blacklist)
        try:
            placement = _placement(elastic, placement.nprocs, list(placement.hosts), restart,
                                   blacklist)
        except (DiscoveryError, NotEnoughRanks) as error:
            _finish_timeline(timeline)
            print_summary(f"{result.summary}; cannot restart: {error}")
            return result.exit_code
        left_out = ""
        if failed_host is not None and failed_host[0] not in {h.name for h in placement.hosts}:
            left_out = f"; host {failed_host[0]} left out for {failed_host[1]:g} s"
        print_summary(restart_announcement(result, placement, failures, elastic) + left_out)


def _blacklist_failed_host(result: JobResult, placement: Placement, elastic: ElasticOptions,
                           blacklist: Blacklist) -> tuple[str, float] | None:
    """Put the host of the failed rank on the blacklist (with a discovery script, which
    can offer others); the host and its cool-down, or None."""
    record = result.first_failure
    if elastic.discovery_script is None or record is None or record.rank is None:
        return None
    host = placement.host_of_rank(record.rank)
    if host is None:
        return None
    return host, blacklist.add(host, time.monotonic())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ringtrain-run``; returns the exit code.

    Args:
        argv: the arguments after the program name; default ``sys.argv[1:]``.
    """
    try:
        options = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        if options.check_build:
            from .check_build import check_build

            return check_build()
        return _launch(options)
    except CommandLineError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
