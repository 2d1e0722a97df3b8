"""The per-rank supervisor: ``python -m ringtrain.launcher.rank -- COMMAND...``.

``mpiexec`` starts one supervisor per rank; the supervisor

1. reads the rank from the MPI's variables and adds the per-rank defaults
   (:func:`ringtrain.launcher.rank_env.rank_defaults`);
2. runs the command as its child, with the MPI's variables and inherited descriptors
   (Hydra's ``PMI_FD``) intact, so ``MPI_Init`` in the child works as if ``mpiexec`` had
   started it;
3. passes on the child's stdout and stderr with ``[rank] `` before every line, a whole
   line at a time (so lines of different ranks never mix);
4. when the child has ended, writes one record line to stderr saying how (exit code,
   signal, or the exception the hook reported on a private pipe), and exits with the
   child's code (``128 + N`` for signal N).

A non-zero exit of a supervisor ends the job: Hydra kills every rank when a process
that joined MPI has gone (the supervisor keeps Hydra's PMI socket open until it has
reported, so the traceback is never cut off); Open MPI aborts the job when a process
exits non-zero; for anything else the launcher stops ``mpiexec`` after a grace period
(see :mod:`ringtrain.launcher.job`).

The child stays in the supervisor's process group. Both Hydra and Open MPI signal a
rank's whole process group (``SIGINT`` on Ctrl-C, ``SIGTERM``, ``SIGKILL`` at cleanup),
so the child gets each signal once, directly, as it would under plain ``mpiexec``, and
its own children are reached too. The supervisor itself outlives the catchable ones
(``SIGINT``, ``SIGTERM``, ``SIGHUP``, ``SIGUSR1``, ``SIGUSR2``) to report how the child
ended; if the supervisor is killed, the kernel kills the child (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from ..common.excepthook import REPORT_FD_VARIABLE
from ..common.rank_identity import rank_identity
from .parent_death import signal_on_parent_death
from .rank_env import nvidia_gpus, rank_defaults, usable_cores
from .report import RankExit, encode
from .streams import LinePrefixer, write_all

OUTLIVED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1,
                    signal.SIGUSR2)
OUTPUT_AFTER_EXIT = 1.0
"""Seconds to keep passing on output after the child ended (its own children may hold
its stdout open, and must not keep the supervisor waiting)."""
PARTIAL_LINE_DELAY = 0.2
"""Seconds a line without its end waits for more before it is passed on as it is."""
READ_SIZE = 65536
COMMAND_NOT_RUN = 127


def _die_with_parent() -> None:
    """In the child, before exec: be killed when the supervisor dies (Linux only)."""
    signal_on_parent_death(signal.SIGKILL)


def _outlive(_signum: int, _frame: object) -> None:
    """The supervisor's handler of the signals its child gets from the same group."""


def _child_environment() -> tuple[dict[str, str], int, int]:
    """The child's variables, and the read and write ends of the exception report pipe."""
    environment = dict(os.environ)
    gpus = len(nvidia_gpus()) if "CUDA_VISIBLE_DEVICES" not in environment else 0
    environment.update(rank_defaults(environment, rank_identity(), usable_cores(), gpus))
    report_read, report_write = os.pipe()
    os.set_inheritable(report_write, True)
    environment[REPORT_FD_VARIABLE] = str(report_write)
    return environment, report_read, report_write


def _pass_on_output(child: subprocess.Popen, streams: dict[int, tuple[int, LinePrefixer]]
                    ) -> None:
    """Copy the child's pipes to this process's stdout/stderr, prefixed, until both end."""
    selector = selectors.DefaultSelector()
    for source in streams:
        selector.register(source, selectors.EVENT_READ)
    last_data = dict.fromkeys(streams, time.monotonic())
    ended_at = None
    try:
        while selector.get_map():
            for key, _ in selector.select(timeout=PARTIAL_LINE_DELAY / 2):
                try:
                    data = os.read(key.fd, READ_SIZE)
                except OSError as error:
                    if error.errno in (errno.EAGAIN, errno.EINTR):
                        continue
                    data = b""
                target, prefixer = streams[key.fd]
                if data:
                    write_all(target, prefixer.feed(data))
                    last_data[key.fd] = time.monotonic()
                else:
                    selector.unregister(key.fd)
                    write_all(target, prefixer.flush())
            now = time.monotonic()
            for source, (target, prefixer) in streams.items():
                if now - last_data[source] >= PARTIAL_LINE_DELAY:
                    write_all(target, prefixer.flush())
            if ended_at is None:
                if child.poll() is not None:
                    ended_at = now
            elif now - ended_at > OUTPUT_AFTER_EXIT:
                break
    finally:
        selector.close()
        for source, (target, prefixer) in streams.items():
            write_all(target, prefixer.flush())
            os.close(source)


def _reported_exception(report_read: int) -> str | None:
    """The exception the hook wrote on the report pipe, if any."""
    os.set_blocking(report_read, False)
    data = b""
    try:
        while chunk := os.read(report_read, READ_SIZE):
            data += chunk
    except BlockingIOError:
        pass
    finally:
        os.close(report_read)
    for line in reversed(data.splitlines()):
        try:
            exception = json.loads(line).get("exception")
        except (ValueError, AttributeError):
            continue
        if isinstance(exception, str):
            return exception
    return None


def supervise(command: Sequence[str]) -> int:
    """Run ``command`` as this rank's child; report how it ended; return the exit code."""
    identity = rank_identity()
    prefix = f"[{identity.label}] ".encode()
    environment, report_read, report_write = _child_environment()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        child = subprocess.Popen(list(command), env=environment, stdout=out_write,
                                 stderr=err_write, close_fds=False,
                                 preexec_fn=_die_with_parent)
    except OSError as error:
        for descriptor in (out_read, out_write, err_read, err_write, report_read,
                           report_write):
            os.close(descriptor)
        reason = error.strerror or str(error)
        write_all(2, prefix + f"ringtrain-run: cannot run {command[0]!r}: {reason}\n".encode())
        write_all(2, encode(RankExit(identity.rank, COMMAND_NOT_RUN)))
        return COMMAND_NOT_RUN
    for descriptor in (out_write, err_write, report_write):
        os.close(descriptor)
    # A handler, not SIG_IGN: an ignored signal would stay ignored in the child's exec.
    for signum in OUTLIVED_SIGNALS:
        signal.signal(signum, _outlive)
    error_prefixer = LinePrefixer(prefix)
    _pass_on_output(child, {out_read: (1, LinePrefixer(prefix)),
                            err_read: (2, error_prefixer)})
    returncode = child.wait()
    record = RankExit(identity.rank, returncode, _reported_exception(report_read))
    if not error_prefixer.at_line_start:
        write_all(2, b"\n")
    write_all(2, encode(record))
    return record.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m ringtrain.launcher.rank -- COMMAND...``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--"]:
        arguments = arguments[1:]
    if not arguments:
        print("usage: python -m ringtrain.launcher.rank -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    return supervise(arguments)


if __name__ == "__main__":
    sys.exit(main())
