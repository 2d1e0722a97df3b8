"""An exception hook that shows a rank's traceback once, marked, and stops the whole job.

Without it, a rank that dies of an exception after ``MPI_Init`` leaves the others
blocked in their next collective, and its own exit blocks in ``MPI_Finalize``. The
runner (:mod:`ringtrain.launcher.run_python`) installs it before the program starts;
``ringtrain.init`` installs it in a job of several processes where the program kept
Python's own hook (``RINGTRAIN_STOP_JOB_ON_EXCEPTION=0``: not). With it, the traceback
is printed between two banner lines naming the rank, and then:

* under the ``ringtrain-run`` supervisor, the process ends at once with ``os._exit`` (no
  ``MPI_Finalize``); the supervisor passes on all of the output, reports the exception
  and exits non-zero, which ends the job (see :mod:`ringtrain.launcher.rank`);
* otherwise, if MPI is running, ``MPI.COMM_WORLD.Abort`` ends the job;
* if MPI was never started, Python exits with code 1 as usual.

It never imports mpi4py: it only looks for ``mpi4py.MPI`` among the loaded modules.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import struct
import sys
import termios
import time
import traceback
from collections.abc import Callable, Collection
from types import TracebackType

from .environment import REPORT_FD
from .rank_identity import rank_identity

REPORT_FD_VARIABLE = REPORT_FD.name
"""Set by the supervisor to a pipe on which the hook reports the exception."""

READ_WAIT_SECONDS = 2.0
"""How long an aborting rank waits for its output still in a pipe to be read."""

_HIDDEN_MODULES = frozenset({"runpy"})
_hidden_files: frozenset[str] = frozenset()
_report_fd: int | None = None
_before_stopping: list[Callable[[], None]] = []


def install(hidden_files: Collection[str] = ()) -> None:
    """Make :func:`report_and_stop` the exception hook of this process.

    Args:
        hidden_files: source files of the frames that start the user's program (the
            runner's own), left out of tracebacks like ``runpy``'s.
    """
    global _hidden_files, _report_fd
    _hidden_files = frozenset(hidden_files)
    # The pipe is this process's; programs it starts must not inherit it.
    descriptor = REPORT_FD.pop()
    if descriptor is not None:
        _report_fd = descriptor
        try:
            os.set_inheritable(_report_fd, False)
        except OSError:
            _report_fd = None
    sys.excepthook = report_and_stop


def install_unless_replaced() -> None:
    """:func:`install`, unless the program replaced Python's own hook (with the runner's,
    a debugger's, its own): what ``ringtrain.init`` does in a job of several processes,
    so that under plain ``mpiexec`` too an unhandled exception on one rank ends the job
    instead of leaving the others waiting for it."""
    if sys.excepthook is sys.__excepthook__:
        install()


def is_supervised() -> bool:
    """Whether this process runs under the ``ringtrain-run`` supervisor."""
    return _report_fd is not None


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None:
        frame = tb.tb_frame
        if (frame.f_code.co_filename not in _hidden_files
                and frame.f_globals.get("__name__") not in _HIDDEN_MODULES):
            return tb
        tb = tb.tb_next
    return tb


def exception_summary(error: BaseException) -> str:
    """``"ValueError: bad value"``: the type and the first line of the message."""
    message = str(error).strip().splitlines()
    name = type(error).__qualname__
    if not message:
        return name
    first = message[0] if len(message[0]) <= 200 else message[0][:197] + "..."
    return f"{name}: {first}"


def format_failure(exc_type: type[BaseException], error: BaseException,
                   tb: TracebackType | None) -> str:
    """The traceback between two banner lines that name this rank."""
    identity = rank_identity()
    place = f"rank {identity.label}" + (f" of {identity.size}" if identity.size else "")
    body = "".join(traceback.format_exception(exc_type, error, _user_frames(tb)))
    return (f"======== unhandled exception on {place}; stopping the job ========\n"
            f"{body.rstrip()}\n"
            f"======== end of the traceback of rank {identity.label} ========\n")


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


def unread_bytes(descriptor: int) -> int:
    """Bytes written to ``descriptor`` not yet read at the other end, if it is a pipe."""
    try:
        if not stat.S_ISFIFO(os.fstat(descriptor).st_mode):
            return 0
        return struct.unpack("i", fcntl.ioctl(descriptor, termios.FIONREAD, bytes(4)))[0]
    except OSError:
        return 0


def wait_until_read(descriptors: tuple[int, ...] = (1, 2),
                    seconds: float = READ_WAIT_SECONDS) -> None:
    """Wait, at most ``seconds``, until what this process wrote to ``descriptors`` (its
    standard output and error) through pipes has been read: mpiexec's proxy reads those
    pipes, and once ``MPI_Abort`` makes it end the job, output still in them would be
    lost (the traceback that says why the job stopped among it)."""
    deadline = time.monotonic() + seconds
    while any(unread_bytes(descriptor) for descriptor in descriptors) \
            and time.monotonic() < deadline:
        time.sleep(0.001)


def _running_mpi():
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi
    except Exception:  # a half-imported or broken mpi4py: treat MPI as not running
        pass
    return None


def before_stopping(action: Callable[[], None]) -> None:
    """Have ``action`` run (its errors ignored) before :func:`stop_job` ends this
    process: e.g. a file whose writer keeps data in memory is written and closed."""
    if action not in _before_stopping:
        _before_stopping.append(action)


def stop_job(exit_code: int) -> None:
    """End this process so that the job ends too, if MPI is running; else return.

    Under the supervisor, exit at once (skipping ``MPI_Finalize``, which would wait for
    ranks that are blocked in a collective); otherwise ``MPI.COMM_WORLD.Abort``.
    """
    mpi = _running_mpi()
    if mpi is None:
        return
    for action in _before_stopping:
        try:
            action()
        except Exception:  # the job ends anyway: what one action cannot do is lost
            pass
    _flush_standard_streams()
    if is_supervised():
        os._exit(exit_code)
    wait_until_read()
    mpi.COMM_WORLD.Abort(exit_code)


def report_and_stop(exc_type: type[BaseException], error: BaseException,
                    tb: TracebackType | None) -> None:
    """The exception hook: print the marked traceback, report it, stop the job."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut it short
    except ValueError:  # not the main thread
        pass
    text = format_failure(exc_type, error, tb)
    try:
        stream = sys.stderr if sys.stderr is not None else sys.__stderr__
        stream.write(text)
        stream.flush()
    except (OSError, ValueError, AttributeError):
        os.write(2, text.encode(errors="replace"))
    if _report_fd is not None:
        report = json.dumps({"exception": exception_summary(error)}).encode() + b"\n"
        try:
            os.write(_report_fd, report)
        except OSError:
            pass
    stop_job(130 if issubclass(exc_type, KeyboardInterrupt) else 1)
