"""ringtrain-run end to end on real MPI: prefixed output, per-rank defaults, a failing or
killed rank ending the whole job fast with a report naming it, and --check-build.

Every run has a hard timeout; on a timeout the launcher and everything below it (the
MPI starts ranks in sessions of their own, so they are found by parentage) is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from mpi_launch import assert_none_running, descendants, find_mpiexec
from ringtrain.launcher import job
from ringtrain.launcher.job import FAILURE_GRACE, TERMINATE_GRACE
from ringtrain.launcher.report import RankExit, encode

pytestmark = pytest.mark.processes

PROGRAMS = Path(__file__).resolve().parent / "launcher_programs"
FAILING = str(PROGRAMS / "rank1_fails.py")
RUN_TIMEOUT = 60.0
FAST = 10.0  # seconds within which a failed rank must have ended the job

needs_mpi = pytest.mark.skipif(find_mpiexec() is None, reason="mpiexec not found")


@dataclass
class Run:
    """What one ``ringtrain-run`` printed, how it exited, and how long it took."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def __str__(self) -> str:
        return (f"exit code {self.returncode} after {self.seconds:.1f} s\n"
                f"----- stdout -----\n{self.stdout}\n----- stderr -----\n{self.stderr}")


def _launcher() -> list[str]:
    script = Path(sys.executable).parent / "ringtrain-run"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "ringtrain.launcher"]


def _kill_tree(process: subprocess.Popen) -> None:
    below = descendants(process.pid)
    for pid in [process.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(*arguments: str, timeout: float = RUN_TIMEOUT) -> Run:
    """Run ``ringtrain-run ARGUMENTS`` with a hard timeout; fail the test if it hangs."""
    return run_with_timeout([*_launcher(), *arguments], timeout)


def run_with_timeout(command: list[str], timeout: float = RUN_TIMEOUT) -> Run:
    """Run ``command`` in a session of its own; kill its whole tree and fail on a timeout."""
    environment = {**os.environ}
    environment.pop("OMP_NUM_THREADS", None)
    start = time.monotonic()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, errors="replace",
                               start_new_session=True, env=environment)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(process)
        stdout, stderr = process.communicate(timeout=15)
        pytest.fail(f"HUNG: {' '.join(command)} killed after {timeout:.0f} s\n"
                    f"----- stdout -----\n{stdout}\n----- stderr -----\n{stderr}",
                    pytrace=False)
    return Run(process.returncode, stdout, stderr, time.monotonic() - start)


def assert_nothing_left(token: str) -> None:
    """No process of the run marked with ``token`` is left after 5 s."""
    assert_none_running(token, wait=5)


def failing_run(mode: str) -> Run:
    token = f"token-{uuid.uuid4().hex}"
    run = launch("-np", "2", sys.executable, FAILING, mode, token)
    assert_nothing_left(token)
    return run


# --------------------------------------------------------------------------- success

@needs_mpi
def test_two_ranks_with_prefixed_output_on_both_streams():
    code = ("import sys, numpy as np, ringtrain as rt\n"
            "rt.init()\n"
            "total = rt.allreduce(np.arange(3.0) * (rt.rank() + 1), op=rt.Sum)\n"
            "print('sum', rt.rank(), total.tolist())\n"
            "print('to stderr', rt.rank(), file=sys.stderr)\n")
    run = launch("-np", "2", "python", "-c", code)
    assert run.returncode == 0, run
    stdout = sorted(run.stdout.splitlines())
    assert stdout == ["[0] sum 0 [0.0, 3.0, 6.0]", "[1] sum 1 [0.0, 3.0, 6.0]"], run
    assert sorted(run.stderr.splitlines()) == ["[0] to stderr 0", "[1] to stderr 1"], run


@needs_mpi
def test_environment_and_per_rank_defaults():
    code = ("import os\n"
            "print(os.environ['MPI_LOCALRANKID' if 'MPI_LOCALRANKID' in os.environ "
            "else 'OMPI_COMM_WORLD_LOCAL_RANK'], os.environ['RINGTRAIN_LAUNCHER_TEST'], "
            "os.environ['OMP_NUM_THREADS'], os.environ['PYTHONUNBUFFERED'])\n")
    cores = len(os.sched_getaffinity(0))
    run = launch("-np", "2", "--env", "RINGTRAIN_LAUNCHER_TEST=a b", "python", "-c", code)
    assert run.returncode == 0, run
    threads = max(1, cores // 2)
    assert sorted(run.stdout.splitlines()) == [f"[0] 0 a b {threads} 1",
                                               f"[1] 1 a b {threads} 1"], run
    run = launch("-np", "2", "--env", "RINGTRAIN_LAUNCHER_TEST=x", "--env", "OMP_NUM_THREADS=3",
                 "python", "-c", code)
    assert sorted(run.stdout.splitlines()) == ["[0] 0 x 3 1", "[1] 1 x 3 1"], run


@needs_mpi
def test_torchruns_variables_reach_every_rank():
    """A script written for torchrun finds what torchrun would have set."""
    code = ("import os\n"
            "print(*(os.environ[n] for n in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', "
            "'LOCAL_WORLD_SIZE', 'MASTER_ADDR')), int(os.environ['MASTER_PORT']) > 0)\n")
    run = launch("-np", "2", "python", "-c", code)
    assert run.returncode == 0, run
    assert sorted(run.stdout.splitlines()) == ["[0] 0 0 2 2 127.0.0.1 True",
                                               "[1] 1 1 2 2 127.0.0.1 True"], run


# --------------------------------------------------------------------------- failures

@needs_mpi
def test_an_exception_on_rank_1_stops_the_job_with_its_traceback():
    run = failing_run("raise")
    assert run.returncode == 1, run
    assert run.seconds < FAST, run
    assert "the allreduce returned" not in run.stdout, run
    assert "[0] rank 0 waits in allreduce" in run.stdout, run
    lines = run.stderr.splitlines()
    banner = [line for line in lines if "unhandled exception" in line]
    assert banner == ["[1] ======== unhandled exception on rank 1 of 2; stopping the job "
                      "========"], run
    start = lines.index(banner[0])
    traceback = lines[start:start + 8]
    assert traceback[1] == "[1] Traceback (most recent call last):", run
    assert any("in fail_on_rank_1" in line for line in traceback), run
    assert "[1] ValueError: rank 1 cannot go on" in traceback, run
    assert sum("ValueError: rank 1 cannot go on" in line for line in lines
               if line.startswith("[1] ")) == 1, run
    assert not any("runpy" in line or "run_python" in line for line in lines), run
    assert lines[-1] == ("ringtrain-run: rank 1 raised ValueError: rank 1 cannot go on (its "
                         "traceback is above) and exited with code 1; the job was stopped "
                         "(exit code 1)"), run


@needs_mpi
def test_a_rank_killed_by_sigkill_ends_the_job_and_is_named():
    run = failing_run("kill")
    assert run.seconds < FAST, run
    assert run.returncode == 128 + 9, run
    assert "rank 1 was killed by signal 9 (SIGKILL)" in run.stderr.splitlines()[-1], run
    assert "the allreduce returned" not in run.stdout, run


@needs_mpi
def test_a_non_zero_exit_after_joining_mpi_ends_the_job():
    run = failing_run("exit")
    assert run.seconds < FAST, run
    assert run.returncode == 3, run
    assert run.stderr.splitlines()[-1].startswith("ringtrain-run: rank 1 exited with code 3"), run


@needs_mpi
def test_the_runner_under_plain_mpiexec_aborts_the_job_on_an_exception():
    assert_plain_mpiexec_stops_at_rank_1s_exception("-m", "ringtrain.launcher.run_python")


@needs_mpi
def test_under_plain_mpiexec_init_makes_an_exception_end_the_job():
    """``mpiexec -n 2 python train.py``: no runner, yet ringtrain.init installed the hook,
    so rank 0, waiting in an allreduce for rank 1, does not wait forever."""
    assert_plain_mpiexec_stops_at_rank_1s_exception()


def assert_plain_mpiexec_stops_at_rank_1s_exception(*python_options: str) -> None:
    token = f"token-{uuid.uuid4().hex}"
    run = run_with_timeout([find_mpiexec(), "-n", "2", sys.executable, *python_options,
                            FAILING, "raise", token])
    assert_nothing_left(token)
    assert run.returncode != 0, run
    assert run.seconds < FAST, run
    assert "======== unhandled exception on rank 1 of 2; stopping the job ========" in run.stderr
    assert "ValueError: rank 1 cannot go on" in run.stderr, run
    assert "the allreduce returned" not in run.stdout, run


@needs_mpi
def test_a_rank_that_fails_before_mpi_starts_ends_the_job():
    run = failing_run("early")
    assert run.seconds < FAST, run
    assert run.returncode == 3, run
    assert "rank 1 exited with code 3" in run.stderr.splitlines()[-1], run


# --------------------------------------------------------------------------- --check-build

@needs_mpi
def test_check_build_reports_the_installation():
    run = launch("--check-build")
    assert run.returncode == 0, run
    fields = {}
    for line in run.stdout.splitlines():
        label, value = line[:16].strip(), line[17:]
        if label:
            fields[label] = value
    for label in ["ringtrain", "Python", "mpi4py", "mpiexec", "MPI vendor", "MPI library",
                  "CUDA-aware MPI", "numba", "numba-cuda", "CuPy", "torch", "GPUs",
                  "collectives", "algorithms"]:
        assert fields.get(label), f"{label} missing\n{run}"
    import mpi4py

    import ringtrain

    assert fields["ringtrain"] == ringtrain.__version__
    assert fields["mpi4py"] == mpi4py.__version__
    assert fields["mpiexec"] == find_mpiexec()
    assert fields["MPI vendor"].split()[0] in ("MPICH", "Open", "Intel")
    assert fields["CUDA-aware MPI"].startswith(("yes (", "no (")), fields["CUDA-aware MPI"]
    assert "allreduce" in fields["collectives"] and "alltoall" in run.stdout
    assert fields["algorithms"].startswith("allreduce: auto, ring")
    assert run.stderr == "", run


# --------------------------------------------------------------------------- last resort

# A child that starts a grandchild, prints its pid, and sleeps.
PARENT_OF_ONE = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("find", [job._descendants, descendants],
                         ids=["launcher", "tests"])
def test_descendants_finds_children_and_grandchildren(find):
    child = subprocess.Popen([sys.executable, "-c", PARENT_OF_ONE], stdout=subprocess.PIPE,
                             text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert find(child.pid) == [grandchild]
        assert {child.pid, grandchild} <= set(find(os.getpid()))
    finally:
        job.kill_process_tree(child.pid)
        child.wait(timeout=10)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert find(child.pid) == []
    assert _ended(grandchild, wait=10)


def _ended(pid: int, wait: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


# An mpiexec that ignores SIGTERM after a rank reported a failure, with a process below it.
STUBBORN_MPIEXEC = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]])
sys.stderr.buffer.write(%r)
sys.stderr.flush()
time.sleep(60)
""" % encode(RankExit(1, 3))


def test_an_mpiexec_that_outlives_a_failure_is_killed_with_everything_below_it():
    token = f"token-{uuid.uuid4().hex}"
    launcher = ("import sys\n"
                "from ringtrain.launcher.job import run_job\n"
                "sys.exit(run_job([sys.executable, '-c', sys.argv[1], sys.argv[2]], 2))\n")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", launcher, STUBBORN_MPIEXEC, token],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT)
    seconds = time.monotonic() - start
    assert result.returncode == 3, result
    assert FAILURE_GRACE + TERMINATE_GRACE <= seconds < FAILURE_GRACE + TERMINATE_GRACE + 5
    assert result.stderr == "ringtrain-run: rank 1 exited with code 3; the job was stopped " \
                            "(exit code 3)\n", result
    assert_nothing_left(token)
