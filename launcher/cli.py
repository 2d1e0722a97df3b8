"""The ``ringtrain-run`` command line (also ``python -m ringtrain.launcher``).

``ringtrain-run -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--env NAME=VAL ...] python
train.py ...`` finds the ``mpiexec`` of the MPI that mpi4py loads, translates the options
into its vendor's flags and runs every rank under the per-rank supervisor. Bad input
gets one line on stderr and exit code 2, before anything is started.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from collections.abc import Sequence

from .command import CommandError, build_mpiexec_argv, python_target, rank_command
from .hosts import Host, HostListError, parse_host_list, read_hostfile
from .mpi_vendor import MpiexecError, query_mpiexec
from .rank_env import usable_cores

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
"""


class UsageError(ValueError):
    """Bad command-line input; its message is printed on one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Raise instead of printing the usage and exiting: the caller prints one line."""
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ringtrain-run``."""
    import ringtrain

    parser = _Parser(prog=PROG, allow_abbrev=False, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     usage=f"{PROG} -np N [-H HOST:SLOTS,... | --hostfile FILE] "
                           "[--env NAME=VALUE ...] COMMAND [ARGS...]\n"
                           f"       {PROG} --check-build",
                     description="Start a ringtrain job: COMMAND on N ranks under the "
                                 "MPI that mpi4py uses.")
    parser.add_argument("-np", "-n", dest="nprocs", type=int, metavar="N",
                        help="number of ranks to start")
    hosts = parser.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and how many ranks each takes, e.g. node1:4,node2:4 "
                            "(default: all ranks on this machine)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="a file of hosts, one a line: HOST, HOST:SLOTS or "
                            "HOST slots=SLOTS")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set a variable on every rank (NAME alone passes on its "
                             "value here); may be repeated")
    parser.add_argument("--check-build", action="store_true",
                        help="print the versions of ringtrain, Python, mpi4py, the MPI and "
                             "the GPU libraries, the GPUs and the collectives; run nothing")
    parser.add_argument("--verbose", action="store_true",
                        help="print the mpiexec command line before running it")
    parser.add_argument("--version", action="version", version=f"{PROG} {ringtrain.__version__}")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]",
                        help="what each rank runs, e.g. python train.py")
    return parser


def parse_environment(assignments: Sequence[str]) -> dict[str, str]:
    """``["A=1", "B"]`` -> ``{"A": "1", "B": <B's value here>}``.

    Raises:
        UsageError: a name that is not a variable name, or a bare name not set here.
    """
    environment = {}
    for assignment in assignments:
        name, equals, value = assignment.partition("=")
        if not _VARIABLE_NAME.match(name):
            raise UsageError(f"--env {assignment!r}: expected NAME=VALUE with NAME a "
                             "variable name")
        if not equals:
            if name not in os.environ:
                raise UsageError(f"--env {name}: {name} is not set here; give {name}=VALUE")
            value = os.environ[name]
        environment[name] = value
    return environment


def _check_command(command: Sequence[str], local: bool) -> None:
    """Refuse a command that cannot start: nothing given, or (on this machine) a program
    or Python script that does not exist."""
    if not command:
        raise UsageError(f"no command to run: give one after the options, e.g. "
                         f"{PROG} -np 2 python train.py")
    if command[0].startswith("-"):
        raise UsageError(f"unrecognized option {command[0]!r}")
    if not local:
        return
    if shutil.which(command[0]) is None:
        raise UsageError(f"command {command[0]!r} not found (not an executable file, "
                         "nor on PATH)")
    target = python_target(command)
    if target is not None and target[0] not in ("-c", "-m") and not os.path.isfile(target[0]):
        raise UsageError(f"python script {target[0]!r} not found "
                         f"(in {os.getcwd()})")


def _hosts(options: argparse.Namespace) -> list[Host]:
    try:
        if options.hosts is not None:
            return parse_host_list(options.hosts)
        if options.hostfile is not None:
            return read_hostfile(options.hostfile)
    except HostListError as error:
        raise UsageError(str(error)) from None
    return []


def _launch(options: argparse.Namespace) -> int:
    if options.nprocs is None:
        raise UsageError("-np N is required: the number of ranks to start")
    if options.nprocs < 1:
        raise UsageError(f"-np must be a positive number of ranks, got {options.nprocs}")
    command = list(options.command)
    if command[:1] == ["--"]:
        command = command[1:]
    hosts = _hosts(options)
    environment = parse_environment(options.env)
    _check_command(command, local=not hosts)
    try:
        mpiexec = query_mpiexec()
    except MpiexecError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return ENVIRONMENT_ERROR
    try:
        argv = build_mpiexec_argv(mpiexec.vendor, mpiexec.path, options.nprocs,
                                  rank_command(command), hosts=hosts,
                                  environment=environment, local_cores=usable_cores(),
                                  as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    except CommandError as error:
        raise UsageError(str(error)) from None
    if options.verbose:
        print(f"{PROG}: {mpiexec.vendor.value} {mpiexec.version}: {shlex.join(argv)}",
              file=sys.stderr, flush=True)
    from .job import run_job

    return run_job(argv, options.nprocs)


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
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_ERROR
