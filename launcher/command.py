"""The ``mpiexec`` command line, as a list, for each vendor.

Everything here is a pure function of its arguments, so the translation is tested for
every vendor without an MPI:

    option            MPICH (Hydra)         Open MPI                Intel MPI (Hydra)
    hosts             -hosts h1:2,h2:2      -H h1:2,h2:2            -hosts h1,h2 -ppn 2
    environment       -genv NAME VAL        -x NAME=VAL             -genv NAME VAL
    no binding        -bind-to none         --bind-to none          -genv I_MPI_PIN off
    ranks > slots     (nothing needed)      --oversubscribe         (nothing needed)
    running as root   (nothing needed)      --allow-run-as-root     (nothing needed)

Each rank runs the per-rank supervisor (:mod:`ringtrain.launcher.rank`), which runs the
user's command; a Python command runs under :mod:`ringtrain.launcher.run_python`, which
installs the exception hook.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence

from .hosts import Host, total_slots
from .mpi_vendor import Vendor

SUPERVISOR_MODULE = "ringtrain.launcher.rank"
PYTHON_RUNNER_MODULE = "ringtrain.launcher.run_python"

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
# Interpreter options without a value, as of CPython 3.10 to 3.13 (-h, -V and -? are left
# out: with them Python runs no program).
_PYTHON_FLAGS = frozenset("bBdEiIOPqRsSuvx")
_PYTHON_OPTIONS_WITH_VALUE = frozenset("WX")
_PYTHON_LONG_OPTIONS_WITH_VALUE = frozenset({"--check-hash-based-pycs"})


class CommandError(ValueError):
    """A launch that the chosen MPI cannot express; the message says why."""


def _hosts_argv(vendor: Vendor, hosts: Sequence[Host]) -> list[str]:
    listed = ",".join(f"{host.name}:{host.slots}" for host in hosts)
    if vendor is Vendor.MPICH:
        return ["-hosts", listed]
    if vendor is Vendor.OPEN_MPI:
        return ["-H", listed]
    slots = {host.slots for host in hosts}
    if len(slots) > 1:
        raise CommandError("Intel MPI takes one slot count for all hosts (-ppn); got "
                           f"{listed}: give every host the same count")
    return ["-hosts", ",".join(host.name for host in hosts), "-ppn", str(slots.pop())]


def _environment_argv(vendor: Vendor, environment: Mapping[str, str]) -> list[str]:
    argv: list[str] = []
    for name, value in environment.items():
        if vendor is Vendor.OPEN_MPI:
            argv += ["-x", f"{name}={value}"]
        else:
            argv += ["-genv", name, value]
    return argv


def build_mpiexec_argv(vendor: Vendor, mpiexec: str, nprocs: int, rank_command: Sequence[str],
                       *, hosts: Sequence[Host] = (), environment: Mapping[str, str] | None = None,
                       local_cores: int = 1, as_root: bool = False,
                       network_interface: str | None = None,
                       extra_options: Sequence[str] = ()) -> list[str]:
    """The ``mpiexec`` argv that starts ``rank_command`` on ``nprocs`` ranks.

    Args:
        vendor: whose ``mpiexec`` it is; decides the spelling of every option.
        mpiexec: the ``mpiexec`` executable, first element of the result.
        nprocs: number of ranks.
        rank_command: what each rank runs (see :func:`rank_command`).
        hosts: where the ranks run; empty runs them all on this machine.
        environment: variables set for every rank (``--env NAME=VAL``).
        local_cores: the cores of this machine; with no ``hosts``, more ranks than
            this is oversubscription (with ``hosts``, more ranks than their slots).
        as_root: whether the launcher runs as root (Open MPI refuses that unless told).
        network_interface: the interface the ranks talk over, in the vendor's spelling.
        extra_options: more ``mpiexec`` options, put before the rank command.

    Returns:
        The argv list; nothing is joined into a shell string.

    Raises:
        CommandError: Intel MPI and hosts with different slot counts.
    """
    argv = [mpiexec, "-n", str(nprocs)]
    if hosts:
        argv += _hosts_argv(vendor, hosts)
    environment = dict(environment or {})
    if vendor is Vendor.INTEL_MPI and "I_MPI_PIN" not in environment:
        environment["I_MPI_PIN"] = "off"
    argv += _environment_argv(vendor, environment)
    if vendor is Vendor.MPICH:
        argv += ["-bind-to", "none"]
    elif vendor is Vendor.OPEN_MPI:
        argv += ["--bind-to", "none"]
        if nprocs > (total_slots(hosts) if hosts else local_cores):
            argv.append("--oversubscribe")
        if as_root:
            argv.append("--allow-run-as-root")
    if network_interface:
        argv += network_interface_argv(vendor, network_interface)
    return argv + list(extra_options) + list(rank_command)


def network_interface_argv(vendor: Vendor, interface: str) -> list[str]:
    """The ``mpiexec`` options that make the ranks talk over network ``interface``."""
    if vendor is Vendor.OPEN_MPI:
        return ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include",
                interface]
    return ["-iface", interface]


def is_python(program: str) -> bool:
    """Whether ``program`` names a Python interpreter (``python``, ``python3.11``, this one)."""
    if _PYTHON_NAME.match(os.path.basename(program)):
        return True
    return os.path.sep in program and os.path.realpath(program) == os.path.realpath(
        sys.executable)


def _split_python_command(command: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """Split ``python [options] target args`` into (interpreter options, target and args).

    The target is ``-c CODE``, ``-m MODULE`` or a script path. None when Python would run
    no program given on the command line (interactive, stdin, ``-h``, ``-V``) or an option
    is not known.
    """
    options: list[str] = []
    arguments = list(command[1:])
    while arguments:
        argument = arguments.pop(0)
        if argument == "--":
            return (options, arguments) if arguments and arguments[0] != "-" else None
        if argument == "-":
            return None
        if not argument.startswith("-"):
            return options, [argument, *arguments]
        if argument.startswith("--"):
            name, equals, _ = argument.partition("=")
            if name not in _PYTHON_LONG_OPTIONS_WITH_VALUE or not (equals or arguments):
                return None
            options += [argument] if equals else [argument, arguments.pop(0)]
            continue
        for position, letter in enumerate(argument[1:], start=1):
            if letter in _PYTHON_FLAGS:
                options.append(f"-{letter}")
                continue
            if letter not in "cm" and letter not in _PYTHON_OPTIONS_WITH_VALUE:
                return None
            value = argument[position + 1:]
            if not value:
                if not arguments:
                    return None
                value = arguments.pop(0)
            if letter in "cm":
                return options, [f"-{letter}", value, *arguments]
            options += [f"-{letter}", value]
            break
    return None


def python_target(command: Sequence[str]) -> list[str] | None:
    """For a Python command, the program and its arguments (``["-c", CODE, ...]``,
    ``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``); None for any other command."""
    if not command or not is_python(command[0]):
        return None
    split = _split_python_command(command)
    return None if split is None else split[1]


def wrap_python_command(command: Sequence[str]) -> list[str]:
    """Run a Python command under :mod:`ringtrain.launcher.run_python`; leave others as they are.

    ``python -u train.py --lr 1`` becomes
    ``python -u -m ringtrain.launcher.run_python train.py --lr 1``: the same interpreter and
    options, the same program, with an exception hook that stops the whole job.
    """
    command = list(command)
    if not command or not is_python(command[0]):
        return command
    split = _split_python_command(command)
    if split is None:
        return command
    options, target = split
    return [command[0], *options, "-m", PYTHON_RUNNER_MODULE, *target]


def rank_command(command: Sequence[str], python: str | None = None) -> list[str]:
    """What every rank runs: the supervisor, which runs ``command`` (wrapped if Python).

    Args:
        command: the user's command, e.g. ``["python", "train.py"]``.
        python: the interpreter for the supervisor; default this one.
    """
    return [python or sys.executable, "-m", SUPERVISOR_MODULE, "--",
            *wrap_python_command(command)]
