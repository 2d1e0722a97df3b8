"""Run ``mpiexec``, watch the ranks' reports, stop the job when a rank fails.

``mpiexec`` runs in its own session, with this process's stdin and stdout; its stderr
passes through here so the supervisors' records (:mod:`ringtrain.launcher.report`) can
be taken out. When a rank has failed, the MPI usually ends the job by itself within a
second; if ``mpiexec`` is still running :data:`FAILURE_GRACE` seconds later (a rank
that failed before joining MPI, which Hydra does not count as a failure), it gets
``SIGTERM``, and ``SIGKILL`` (with every process below it) after :data:`TERMINATE_GRACE`
more. ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` sent to the launcher are passed on to
``mpiexec``, which passes them on to the ranks (a second Ctrl-C makes Hydra kill them).

The exit code is the first failing rank's (``128 + N`` for a rank killed by signal N),
else ``mpiexec``'s own.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import psutil

from .parent_death import signal_on_parent_death
from .report import RankExit, describe, describe_exit
from .streams import RecordFilter, write_all

FAILURE_GRACE = 2.0
TERMINATE_GRACE = 3.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
READ_SIZE = 65536


def _start_session() -> None:
    """In ``mpiexec``, before exec: its own session (terminal signals come through the
    launcher, once), and ``SIGTERM`` if the launcher dies, so the job never outlives it."""
    os.setsid()
    signal_on_parent_death(signal.SIGTERM)


class _Job:
    """One ``mpiexec`` run and what has been learned about its ranks."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process
        self.records: list[RankExit] = []
        self.failed_at: float | None = None
        self.terminated_at: float | None = None
        self.interrupted: int | None = None

    def forward(self, signum: int, _frame: object) -> None:
        """Pass a signal on to ``mpiexec``, which passes it on to the ranks."""
        self.interrupted = signum
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def add(self, records: list[RankExit]) -> None:
        """Take in the records read from the ranks; note when the first failure came."""
        self.records += records
        if self.failed_at is None and any(record.failed for record in records):
            self.failed_at = time.monotonic()

    def enforce_deadlines(self) -> None:
        """Terminate, then kill, an ``mpiexec`` that outlives a failure."""
        if self.process.poll() is not None:
            return
        now = time.monotonic()
        if self.terminated_at is None:
            if self.failed_at is not None and now - self.failed_at > FAILURE_GRACE:
                self.process.send_signal(signal.SIGTERM)
                self.terminated_at = now
        elif now - self.terminated_at > TERMINATE_GRACE:
            kill_process_tree(self.process.pid)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, found by parentage (the ranks run in sessions of
    their own, so neither a process group nor a session holds them all); none when
    ``pid`` is gone."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def kill_process_tree(pid: int) -> None:
    """``SIGKILL`` to ``pid`` and every process below it (the last resort)."""
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except OSError:
            pass


def _pump(job: _Job, source: int) -> None:
    """Pass ``mpiexec``'s stderr on, taking out records, until it ends and has exited."""
    records = RecordFilter()
    selector = selectors.DefaultSelector()
    selector.register(source, selectors.EVENT_READ)
    open_stream = True
    exited_at = None
    while True:
        if open_stream:
            for _ in selector.select(timeout=0.2):
                try:
                    data = os.read(source, READ_SIZE)
                except OSError as error:
                    if error.errno in (errno.EAGAIN, errno.EINTR):
                        continue
                    data = b""
                if not data:
                    selector.unregister(source)
                    open_stream = False
                    break
                shown, found = records.feed(data)
                write_all(2, shown)
                job.add(found)
        else:
            time.sleep(0.2)
        job.enforce_deadlines()
        if job.process.poll() is not None:
            # Processes left behind by mpiexec may hold the pipe open: stop waiting soon.
            exited_at = exited_at or time.monotonic()
            if not open_stream or time.monotonic() - exited_at > 1.0:
                break
    selector.close()
    write_all(2, records.finish())


def _summary(job: _Job, nprocs: int, returncode: int) -> tuple[str | None, int]:
    failures = [record for record in job.records if record.failed]
    if job.interrupted is not None:
        stopped = f"the job was stopped by {signal.Signals(job.interrupted).name}"
        first = f"; first, {describe(failures[0])}" if failures else ""
        return stopped + first, 128 + job.interrupted
    if failures:
        first = failures[0]
        finished = sum(not record.failed for record in job.records)
        stopped = "; the job was stopped" if finished + 1 < nprocs else ""
        return f"{describe(first)}{stopped} (exit code {first.exit_code})", first.exit_code
    if returncode != 0:
        code = 128 - returncode if returncode < 0 else returncode
        return f"mpiexec {describe_exit(returncode)}", code
    return None, 0


@dataclasses.dataclass(frozen=True)
class JobResult:
    """How one ``mpiexec`` run ended.

    Attributes:
        exit_code: 0, the first failing rank's exit code, or ``mpiexec``'s.
        summary: the launcher's last line without its ``ringtrain-run:`` prefix (None
            when every rank succeeded).
        first_failure: the record of the first rank that failed, if one did.
        interrupted: the signal the launcher passed on to the job, if any.
    """

    exit_code: int
    summary: str | None
    first_failure: RankExit | None = None
    interrupted: int | None = None


def run_job_attempt(argv: Sequence[str], nprocs: int,
                    environment: Mapping[str, str] | None = None) -> JobResult:
    """Run the ``mpiexec`` command ``argv`` to its end, without printing the summary.

    The arguments are those of :func:`run_job`.
    """
    process = subprocess.Popen(list(argv), env=None if environment is None else dict(environment),
                               stderr=subprocess.PIPE, preexec_fn=_start_session)
    job = _Job(process)
    previous = {signum: signal.signal(signum, job.forward) for signum in FORWARDED_SIGNALS}
    try:
        _pump(job, process.stderr.fileno())
        returncode = process.wait()
    finally:
        process.stderr.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    message, code = _summary(job, nprocs, returncode)
    failures = [record for record in job.records if record.failed]
    return JobResult(code, message, failures[0] if failures else None, job.interrupted)


def print_summary(message: str) -> None:
    """Write the launcher's line ``ringtrain-run: MESSAGE`` to stderr, after the job's output."""
    sys.stderr.flush()
    write_all(2, f"ringtrain-run: {message}\n".encode())


def run_job(argv: Sequence[str], nprocs: int,
            environment: Mapping[str, str] | None = None) -> int:
    """Run the ``mpiexec`` command ``argv``; return the job's exit code.

    Args:
        argv: the full ``mpiexec`` command, as built by
            :func:`ringtrain.launcher.command.build_mpiexec_argv`.
        nprocs: the number of ranks it starts (for the report).
        environment: ``mpiexec``'s variables; default this process's.

    Returns:
        0 when every rank succeeded; the first failing rank's exit code (``128 + N``
        for a signal N); otherwise ``mpiexec``'s exit code.
    """
    result = run_job_attempt(argv, nprocs, environment)
    if result.summary is not None:
        print_summary(result.summary)
    return result.exit_code
