"""Start the programs under tests/mpi/ with mpiexec, with a hard timeout.

``run_mpi("allreduce", 4)`` runs ``mpiexec -n 4 python tests/mpi/allreduce.py`` in its
own session (so nothing it starts can outlive a timeout), and fails the calling test:

* on a timeout: which program and how many ranks hung, the stacks the ranks dumped
  when asked (the programs register faulthandler on SIGUSR1), and the output so far;
* on a non-zero exit: the exit status and the combined output (stdout and stderr).

``run_checks("allreduce", 4, 20)`` also fails unless the program's summary line says that
all of its checks passed, at least 20 of them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).resolve().parent
PROGRAMS = TESTS / "mpi"
ROOT = TESTS.parent
DEFAULT_TIMEOUT = 180.0
DUMP_SECONDS = 0.5  # for each rank to dump its stacks before the next is asked
MAX_SHOWN = 60_000  # characters of output shown in a failure (head and tail kept)

# MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 (MPICH's progress engine yielding between polls) was
# measured on a two-core machine with these programs at np=3 and np=4 and made no
# measurable difference, so the environment is left as it is.


def find_mpiexec() -> str | None:
    """The mpiexec next to this Python (a virtualenv's MPI), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the MPI proxies start the ranks in new sessions, so
    they are found by parentage, not by process group); none when ``pid`` is gone."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def processes_running(*tokens: str) -> list[str]:
    """``"pid: command line"`` of every process whose command line holds all ``tokens``."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or ())
        if line and all(token in line for token in tokens):
            found.append(f"{process.pid}: {line}")
    return found


def assert_none_running(*tokens: str, wait: float) -> None:
    """Wait up to ``wait`` seconds for the processes holding ``tokens`` to end; fail if not."""
    deadline = time.monotonic() + wait
    while processes_running(*tokens) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_running(*tokens)
    assert not left, f"processes left running: {left}"


def _command_line(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _kill_tree(process: subprocess.Popen, program: Path) -> None:
    """Ask the ranks for their stacks, then kill mpiexec and everything it started."""
    below = descendants(process.pid)
    ranks = [pid for pid in below if str(program) in _command_line(pid)]
    for pid in ranks:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        # One rank at a time: faulthandler writes a stack line in several pieces, which
        # mpiexec would interleave with another rank's dump.
        time.sleep(DUMP_SECONDS)
    if ranks:
        time.sleep(1.0)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _shown(output: str) -> str:
    if len(output) <= MAX_SHOWN:
        return output
    half = MAX_SHOWN // 2
    return f"{output[:half]}\n... [{len(output) - MAX_SHOWN} characters left out] ...\n" \
           f"{output[-half:]}"


ABORTED = (1, 9)
"""mpiexec's exit status after a rank called ``MPI_Abort(comm, 1)``: 1, or 9 when it
reports a rank it killed (SIGKILL) before the aborting rank had exited."""


def run_mpi(program: str, nprocs: int, *args: str, timeout: float = DEFAULT_TIMEOUT,
            env: Mapping[str, str] | None = None,
            expected_status: int | tuple[int, ...] = 0) -> str:
    """Run ``tests/mpi/<program>.py`` on ``nprocs`` ranks; return its output.

    Args:
        program: file name under tests/mpi/, with or without ``.py``.
        nprocs: number of ranks.
        *args: arguments for the program.
        timeout: seconds before the whole job is killed and the test fails.
        env: extra environment variables.
        expected_status: the exit status that counts as success (or any of several).

    Returns:
        The combined stdout and stderr, when the program exited with ``expected_status``.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec not found (next to the Python interpreter or on PATH)")
    path = PROGRAMS / (program if program.endswith(".py") else program + ".py")
    assert path.is_file(), f"no test program {path}"
    environment = dict(os.environ)
    environment["PYTHONUNBUFFERED"] = "1"
    environment.update(env or {})
    command = [mpiexec, "-n", str(nprocs), sys.executable, str(path), *args]
    label = f"{path.name} with np={nprocs}"
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, env=environment, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(process, path)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            output = b"(the output could not be collected)"
        text = output.decode(errors="replace")
        pytest.fail(f"{label} HUNG: killed after {timeout:.0f} s.\n"
                    f"command: {' '.join(command)}\n"
                    f"----- output so far (with the stacks the ranks dumped) -----\n"
                    f"{_shown(text)}", pytrace=False)
    text = output.decode(errors="replace")
    statuses = expected_status if isinstance(expected_status, tuple) else (expected_status,)
    if process.returncode not in statuses:
        failed = [line for line in text.splitlines()
                  if " FAIL " in line or "HANG" in line or "ABORT" in line]
        summary = "\n".join(failed[:40])
        pytest.fail(f"{label} FAILED with exit status {process.returncode} (expected "
                    f"{expected_status}) after "
                    f"{time.monotonic() - start:.1f} s.\n"
                    f"command: {' '.join(command)}\n"
                    f"----- failures -----\n{summary}\n"
                    f"----- output (stdout and stderr) -----\n{_shown(text)}", pytrace=False)
    return text


def gpu_found() -> bool:
    """Whether numba (outside its simulator) sees a CUDA GPU, asked in a fresh process."""
    probe = "from numba import cuda; print(cuda.is_available())"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items()
                                 if k != "NUMBA_ENABLE_CUDASIM"}, timeout=120)
    return result.stdout.strip() == "True"


def require_gpu() -> None:
    """Skip the calling test when no CUDA GPU is found, unless ``RINGTRAIN_TEST_GPU=1``
    says one must be there: then the test runs, and fails without one."""
    if os.environ.get("RINGTRAIN_TEST_GPU") != "1" and not gpu_found():
        pytest.skip("no CUDA GPU (RINGTRAIN_TEST_GPU=1 makes this a failure)")


COLLECTIVES = ("allreduce", "broadcast", "gather_scatter", "mismatch", "process_sets",
               "lifecycle", "compression", "join", "threads", "bfloat16")
"""The collectives' programs, run at 1 to 4 ranks in one launch per rank count."""

TRAINING = ("torch_tensors", "trainer_gold", "trainer_behaviour", "trainer_mixed_precision",
            "sharded_optimizer", "trainer_broadcast", "horovod_ops", "horovod_training",
            "pipeline", "pruning", "kvstore_sync", "kvstore_async", "balance",
            "balance_gold")
"""The programs of the trainer and of the front ends on it (torch tensors, Horovod's
API, pipelines, pruning, the KVStore, load balancing), one launch per rank count."""

STALL_CHECKED = ("point_to_point", "torch_backend")
"""Programs run with the stall inspector checking every second
(``RINGTRAIN_STALL_CHECK_SECONDS=1``): point-to-point and torch.distributed."""

STALL_CHECK_EVERY_SECOND = {"RINGTRAIN_STALL_CHECK_SECONDS": "1"}

NEEDS_TORCH = frozenset({"torch_tensors", "sharded_optimizer", "horovod_ops",
                         "horovod_training", "pipeline", "pruning", "kvstore_sync",
                         "point_to_point", "torch_backend", "balance_gold"})
"""Programs that import torch: left out of their launch (and their tests skipped) where
it is not installed."""

_BUNDLES: dict[tuple, tuple[str, str | None]] = {}


def run_in_bundle(program: str, bundle: Sequence[str], nprocs: int, at_least: int = 1, *,
                  timeout: float = DEFAULT_TIMEOUT,
                  env: Mapping[str, str] | None = None) -> str:
    """Check ``program`` as :func:`run_checks` does, run in one launch with the other
    programs of ``bundle`` (tests/mpi/bundle.py): the first test that asks for a bundle,
    ``nprocs`` and ``env`` starts it, the others read its output.

    Args:
        timeout: seconds for the whole bundle.

    Returns:
        The bundle's output.
    """
    assert program in bundle, f"{program} is not in the bundle {list(bundle)}"
    if importlib.util.find_spec("torch") is None:
        if program in NEEDS_TORCH:
            pytest.skip(f"{program} needs torch")
        bundle = [p for p in bundle if p not in NEEDS_TORCH]
    key = (tuple(bundle), nprocs, tuple(sorted((env or {}).items())))
    if key not in _BUNDLES:
        try:
            _BUNDLES[key] = (run_mpi("bundle", nprocs, *bundle, timeout=timeout, env=env,
                                     expected_status=(0, 1)), None)
        except pytest.fail.Exception as failure:  # hung or crashed: every program says why
            _BUNDLES[key] = ("", str(failure))
    output, failure = _BUNDLES[key]
    summary = re.search(rf"(?m)^{re.escape(program)}\.py np={nprocs}: "
                        rf"(all (\d+) checks passed|.*FAILED.*)$", output)
    if summary is None:
        pytest.fail(f"{program}.py np={nprocs} did not finish in the launch of "
                    f"{' '.join(bundle)}:\n{failure or _shown(output)}", pytrace=False)
    if summary.group(2) is None:
        mine = "\n".join(line for line in output.splitlines()
                         if f"FAIL {program}: " in line or "HANG" in line)
        pytest.fail(f"{summary.group(0)}\n{mine}\n----- output of the launch -----\n"
                    f"{_shown(output)}", pytrace=False)
    assert int(summary.group(2)) >= at_least, \
        f"{program}.py np={nprocs}: {summary.group(2)} checks passed, expected at least " \
        f"{at_least}:\n{output}"
    return output


def run_checks(program: str, nprocs: int, at_least: int = 1, *, args: Sequence[str] = (),
               **options) -> str:
    """Run ``program`` with ``args`` as :func:`run_mpi` does (``options`` are its keyword
    arguments) and fail unless its summary line says that all its checks passed, at
    least ``at_least`` of them; returns the output."""
    output = run_mpi(program, nprocs, *args, **options)
    summary = re.search(rf"{re.escape(program)}\.py np={nprocs}: all (\d+) checks passed",
                        output)
    assert summary, f"no summary line in the output of {program}.py np={nprocs}:\n{output}"
    assert int(summary.group(1)) >= at_least, \
        f"{program}.py np={nprocs}: {summary.group(1)} checks passed, expected at least " \
        f"{at_least}:\n{output}"
    return output
