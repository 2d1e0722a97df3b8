"""PyTorch's own distributed test suite, run against the ``"ringtrain"`` backend under mpiexec.

torch ships its distributed tests in the wheel
(``torch/testing/_internal/distributed/distributed_test.py``: ``DistributedTest._DistTestBase``,
about 290 tests parameterized by the ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` variables).
torch's own harness (``TestDistBackend``, ``MultiProcessTestCase``) spawns the ranks of each
test itself, which a backend over MPI cannot use: its processes must be started by mpiexec.
This script runs the same tests the way that harness does, with the ranks started by mpiexec::

    . .venv/bin/activate
    pip install expecttest            # torch's test utilities import it
    python tests/torch_distributed_suite.py                      # world size 2, every test
    python tests/torch_distributed_suite.py --world-size 3
    python tests/torch_distributed_suite.py -k allreduce -k broadcast   # names holding either
    python tests/torch_distributed_suite.py --isolate -k test_ddp_logging_data_cpu
    python tests/torch_distributed_suite.py --summary /tmp/ringtrain_torch_suite/ws2/results.json

A whole run takes five to ten minutes at world size 2 or 3 on two cores (a test that
hangs adds up to ``--grace`` or ``--timeout`` seconds, and a new job's start). It is not a
pytest module (its name does not start with ``test_``); nothing in the repository's own
test runs starts it.

How it works
============

The *driver* (this script without ``--worker``) lists the test names and starts
``mpiexec -n N python tests/torch_distributed_suite.py --worker ...``. Each MPI rank plays
one rank of every test, one test after the other, as ``TestDistBackend._run`` does in a
spawned process: it makes the test case (a subclass of ``TestDistBackend`` and
``DistributedTest._DistTestBase``, as torch's ``test/distributed/test_distributed_spawn.py``
builds it) with the test's name, sets its ``rank``, calls
``init_process_group("ringtrain")`` (rank and size from MPI; ``--init file`` uses torch's
``file://`` rendezvous with ``rank=`` and ``world_size=`` as torch's harness does), passes
torch's file barrier, runs the test method, passes the barrier again and destroys the
groups. Each test gets a folder of its own as ``TEMP_DIR`` (with ``barrier/``,
``test_dir/`` and ``init_dir/``), as torch's harness makes one for each test.

A test that unittest would skip before running it (``unittest.skip`` and torch's
``skip_but_pass_in_sandcastle_if`` only mark the method) is skipped before the group is
made, as torch's harness skips it before spawning. A rank's outcome is ``passed``,
``skipped`` (``unittest.SkipTest``, or ``sys.exit`` with one of the codes of ``TEST_SKIPS``
in ``common_distributed.py``) or ``failed``; the test's outcome is merged as torch's
harness merges its processes' exit codes: an error on any rank fails it, else rank 0's skip
skips it. The ranks tell each other their outcomes through files
in the run's folder, never through the backend under test.

A failure on one rank can leave the others waiting in a collective. A watchdog thread on
every rank ends the job, after dumping every thread's stack (faulthandler), when a test
has run longer than ``--timeout`` seconds, or when another rank failed the test
``--grace`` seconds ago and this one has not finished it; ``faulthandler``'s own timer is
the last resort for a rank whose interpreter is stuck. After a test that failed on any
rank the job stops (the backend may hold messages of the failed test), and after one that
hung or crashed it has been ended; either way the driver starts mpiexec again from the
next test, so one bad test never hides the results of the others. ``--rerun-failed`` runs
every test that did not pass or skip once more, alone in a fresh job, and records that
outcome too (``isolated``), telling a test that fails by itself from one that fails
after another.

Which tests run for a backend is decided by torch from the backend's name:
``DistTestCases.backend_feature`` sets list the backends that implement a feature. The
worker adds ``"ringtrain"`` to the sets of the features the backend implements on CPU
before the suite is imported (``--features``, default ``plugin ddp subgroup``):

* ``plugin``: the backend is a third-party backend registered with
  ``Backend.register_backend`` (``require_backend_is_available`` then counts it as
  available);
* ``ddp``: ``DistributedDataParallel`` on CPU tensors runs on it (its allreduce, broadcast
  and allgather, with asynchronous work and futures for the reducer and the hooks);
* ``subgroup``: ``new_group`` makes groups of some of the ranks (ringtrain process sets).

``gpu`` and ``cuda`` are left out: they mean NCCL-like CUDA collectives, which need GPUs
(``--features plugin ddp subgroup gpu cuda`` on a machine with one GPU per rank).

Many tests are kept by name to ``gloo`` or ``mpi`` (``require_backend_is_available({"gloo"})``,
``BACKEND != "mpi"``, ``skip_if_small_worldsize``, which lets only ``mpi`` run below eight
ranks). ``--gates-as gloo`` (or ``mpi``) takes those decisions as for that name, while the
tests still run on ringtrain (``init_process_group("ringtrain")``, and the suite's
``BACKEND`` set back to ``"ringtrain"`` once imported): it tells a test that torch only
keeps to another backend from one that needs what that backend has (GPUs, timeouts,
sparse tensors). Its results go to their own folder (``ws<N>-gates-as-<name>``)::

    python tests/torch_distributed_suite.py --gates-as gloo --names-file skipped.txt

Results
=======

Under ``--out-dir`` (default ``/tmp/ringtrain_torch_suite/ws<N>``): ``results.json``, one
record per test (name, outcome, seconds, the first line of the error, each rank's outcome
and traceback, the stacks dumped on a hang, the outcome when rerun alone), written after
each mpiexec job so that an interrupted run keeps what it had (``--resume`` goes on from
there); ``logs/`` has the output of every job and the stacks each rank dumped. The driver
ends with a summary: totals, skip reasons and failures grouped by the first line of their
error.

Each rank runs torch with one intra-op thread (``OMP_NUM_THREADS=1`` unless set), as the
ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import faulthandler
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
BACKEND = "ringtrain"
DEFAULT_FEATURES = ("plugin", "ddp", "subgroup")
DEFAULT_TIMEOUT = 300.0
"""Seconds a test may take on its slowest rank (init and teardown included)."""
DEFAULT_GRACE = 40.0
"""Seconds the other ranks get to finish a test after one rank failed it."""
SLOW_TESTS = {"test_ddp_uneven_inputs": 900.0}
"""Tests that take longer than ``--timeout`` on two shared cores: their own limit."""
ERROR_CHARS = 6000
"""Characters of a traceback (its end) kept in the results."""
STACK_CHARS = 8000
"""Characters of a rank's dumped stacks kept in the results."""
OUTCOMES = ("passed", "failed", "skipped", "hung", "crashed", "not run")


# ====================================================================== worker (one rank)

class _Worker:
    """One MPI rank running the tests ``names[start:stop]`` one after the other."""

    def __init__(self, args: argparse.Namespace):
        from mpi4py import MPI  # MPI's rank and size; ringtrain starts on init_process_group

        self.rank = MPI.COMM_WORLD.Get_rank()
        self.size = MPI.COMM_WORLD.Get_size()
        self.args = args
        self.state = Path(args.state)
        self.launch = args.launch
        self.results = self.state / "results"
        self.names: list[str] = json.loads((self.state / "tests.json").read_text())
        self.current: tuple[int, float] | None = None  # (index, start) of the test running
        self.result_written = threading.Event()
        self.stacks = open(self.state / "logs" / f"stacks.rank{self.rank}.txt", "a")
        faulthandler.enable(file=self.stacks, all_threads=True)
        faulthandler.register(signal.SIGUSR1, file=self.stacks, all_threads=True)
        if self.size != args.world_size:
            raise SystemExit(f"rank {self.rank}: started with {self.size} ranks by mpiexec, "
                             f"--world-size says {args.world_size}")

    # ------------------------------------------------------------------ files

    def result_path(self, index: int, rank: int) -> Path:
        return self.results / f"{self.launch}-{index}.rank{rank}.json"

    def teardown_path(self, index: int, rank: int) -> Path:
        return self.results / f"{self.launch}-{index}.teardown.rank{rank}.json"

    def abort_path(self) -> Path:
        return self.results / f"{self.launch}.abort.json"

    def read_result(self, index: int, rank: int) -> dict | None:
        try:
            return json.loads(self.result_path(index, rank).read_text())
        except (OSError, ValueError):
            return None

    def write_json(self, path: Path, record: dict) -> None:
        part = path.with_name(path.name + f".part{self.rank}")
        part.write_text(json.dumps(record))
        os.replace(part, path)

    # ------------------------------------------------------------------ the suite

    def import_suite(self) -> type:
        """Import torch's suite for this backend and build its test case class."""
        # --gates-as: the skip decorators read the name when the module is imported, and
        # some read the variable when the test runs; the tests themselves run on ringtrain.
        os.environ["BACKEND"] = self.args.gates_as or BACKEND
        os.environ["WORLD_SIZE"] = str(self.size)
        os.environ.setdefault("TEMP_DIR", str(self.state))
        import torch

        import ringtrain.torch  # noqa: F401  registers the backend "ringtrain"

        torch.backends.cuda.matmul.allow_tf32 = False  # as test_distributed_spawn.py
        from torch.testing._internal.common_distributed import DistTestCases

        # The decorators read these sets when the suite's module is imported.
        for feature in self.args.features:
            DistTestCases.backend_feature.setdefault(feature, set()).add(BACKEND)
        from torch.testing._internal.distributed import distributed_test as suite

        suite.BACKEND = BACKEND
        self.suite = suite
        return _test_case_class(suite)

    def run(self) -> int:
        cls = self.import_suite()
        threading.Thread(target=self._watch, name="suite watchdog", daemon=True).start()
        stop = min(self.args.stop, len(self.names))
        for index in range(self.args.start, stop):
            record = self.run_test(cls, index, self.names[index])
            others = self.wait_for_others(index)
            clean = all(r["outcome"] in ("passed", "skipped") for r in others)
            if not clean or not self.teardown_everywhere(index):
                _say(self.rank, f"=== test {index} {record['name']} failed: this job stops "
                                f"here, the driver starts the next test in a new one")
                # Every rank has every record: leave at once, whatever the backend holds.
                sys.stdout.flush()
                sys.stderr.flush()
                self.stacks.flush()
                os._exit(0)
            faulthandler.cancel_dump_traceback_later()
            self.current = None
        return 0

    def run_test(self, cls: type, index: int, name: str) -> dict:
        """Run test ``name`` as ``TestDistBackend._run`` does; write this rank's record."""
        import torch
        import torch.distributed as dist
        from torch.testing._internal import common_utils
        from torch.testing._internal.common_distributed import TEST_SKIPS

        suite = self.suite
        limit = SLOW_TESTS.get(name, self.args.timeout)
        start = time.monotonic()
        self.result_written.clear()
        self.current = (index, start)
        self.write_json(self.state / "logs" / f"progress.rank{self.rank}.json",
                        {"launch": self.launch, "index": index, "name": name,
                         "time": time.time()})
        self.stacks.write(f"\n--- launch {self.launch}, test {index} {name}: started "
                          f"{datetime.datetime.now():%H:%M:%S}\n")
        self.stacks.flush()
        # The last resort, for an interpreter that no Python thread can interrupt.
        faulthandler.dump_traceback_later(limit + 60, exit=True, file=self.stacks)
        _say(self.rank, f"=== test {index} {name}")

        folder = self.state / "t" / f"{self.launch}-{index}"
        for sub in ("barrier", "test_dir", "init_dir"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        os.environ["TEMP_DIR"] = str(folder)
        # Barrier.init() would remove the other ranks' files: the folder is fresh instead.
        suite.Barrier.barrier_id = 0

        record: dict[str, Any] = {"index": index, "name": name, "rank": self.rank,
                                  "launch": self.launch}
        phase = "init"
        skip_codes = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}
        try:
            test = cls(name)
            # unittest's own check, which the method's call alone skips (torch's
            # skip_but_pass_in_sandcastle_if only marks the method)
            method = getattr(test, name)
            if getattr(cls, "__unittest_skip__", False) or \
                    getattr(method, "__unittest_skip__", False):
                raise unittest.SkipTest(getattr(cls, "__unittest_skip_why__", "") or
                                        getattr(method, "__unittest_skip_why__", ""))
            test.rank = self.rank
            test.file_name = str(folder / "init_dir" / "store_file")
            world_size = int(test.world_size)
            if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
                sys.exit(TEST_SKIPS[f"multi-gpu-{world_size}"].exit_code)
            seconds = suite.CUSTOM_PG_TIMEOUT.get(name, suite.default_pg_timeout)
            timeout = datetime.timedelta(seconds=seconds)
            if self.args.init == "file":
                dist.init_process_group(init_method=test.init_method, backend=BACKEND,
                                        world_size=world_size, rank=self.rank,
                                        timeout=timeout)
            else:  # ringtrain's rendezvous: rank and size from MPI
                dist.init_process_group(BACKEND, timeout=timeout)
            test._barrier()
            phase = "test"
            # What MultiProcessTestCase.run_test does before the test method.
            torch._C._set_print_stack_traces_on_fatal_signal(True)
            os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"
            common_utils.set_rng_seed()
            getattr(test, name)()
            phase = "barrier after the test"
            test._barrier()
            record["outcome"] = "passed"
        except unittest.SkipTest as skip:
            record.update(outcome="skipped", reason=_sorted_sets(str(skip)) or "SkipTest")
        except SystemExit as leaving:
            code = leaving.code
            if code in skip_codes:
                record.update(outcome="skipped", reason=skip_codes[code])
            elif code in (0, None):
                record["outcome"] = "passed"  # the process would have exited 0
            else:
                record.update(outcome="failed", error=f"SystemExit: {code}",
                              traceback=traceback.format_exc()[-ERROR_CHARS:])
        except BaseException as error:  # noqa: BLE001  (KeyboardInterrupt included)
            record.update(outcome="failed", error=_summary(error),
                          traceback=traceback.format_exc()[-ERROR_CHARS:])
            if isinstance(error, KeyboardInterrupt):
                raise
        record["phase"] = phase
        record["seconds"] = round(time.monotonic() - start, 3)
        record["time"] = time.time()
        self.write_json(self.result_path(index, self.rank), record)
        self.result_written.set()
        _say(self.rank, f"=== test {index} {name}: {record['outcome']} "
                        f"({record['seconds']:.1f} s) {record.get('error', '')}")
        return record

    def wait_for_others(self, index: int) -> list[dict]:
        """Every rank's record of test ``index`` (the watchdog ends the job meanwhile if
        they do not come)."""
        while True:
            records = [self.read_result(index, rank) for rank in range(self.size)]
            if all(r is not None for r in records):
                return records  # type: ignore[return-value]
            time.sleep(0.05)

    def teardown_everywhere(self, index: int) -> bool:
        """Destroy the groups the test left (``_run`` destroys the default group); whether
        that went well on every rank (each rank's word is written for the driver)."""
        import torch.distributed as dist

        word: dict[str, Any] = {"ok": True}
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except (AssertionError, ValueError):
            pass  # as MultiProcessTestCase.run_test: the test destroyed them itself
        except Exception as error:  # noqa: BLE001
            word = {"ok": False, "error": _summary(error),
                    "traceback": traceback.format_exc()[-ERROR_CHARS:]}
        self.write_json(self.teardown_path(index, self.rank), word)
        while True:
            words = []
            for rank in range(self.size):
                try:
                    words.append(json.loads(self.teardown_path(index, rank).read_text()))
                except (OSError, ValueError):
                    break
            if len(words) == self.size:
                break
            time.sleep(0.05)
        if self.rank == 0:
            shutil.rmtree(self.state / "t" / f"{self.launch}-{index}", ignore_errors=True)
        return all(w["ok"] for w in words)

    # ------------------------------------------------------------------ watchdog

    def _watch(self) -> None:
        """End the job when the running test hangs (see the module's docstring)."""
        while True:
            time.sleep(0.5)
            current = self.current
            if current is None:
                continue
            index, start = current
            reason = self._abort_reason(index, start)
            if reason is None:
                continue
            try:
                fd = os.open(self.abort_path(), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                with os.fdopen(fd, "w") as out:
                    json.dump({"index": index, "rank": self.rank, "reason": reason}, out)
                first = True
            except FileExistsError:
                first = False  # another rank ends the job: dump, then leave with it
            self.stacks.write(f"--- rank {self.rank}, test {index} {self.names[index]}: "
                              f"{reason}; stacks:\n")
            self.stacks.flush()
            faulthandler.dump_traceback(file=self.stacks, all_threads=True)
            self.stacks.write(f"--- end of rank {self.rank}'s stacks\n")
            self.stacks.flush()
            _say(self.rank, f"=== test {index} {self.names[index]}: {reason}; "
                            f"ending the job")
            time.sleep(3.0 if first else 0.5)  # the others dump their stacks first
            os._exit(3)

    def _abort_reason(self, index: int, start: float) -> str | None:
        try:
            marker = json.loads(self.abort_path().read_text())
            if marker.get("index") == index:
                return f"rank {marker['rank']} ends the job ({marker['reason']})"
        except (OSError, ValueError):
            pass
        name = self.names[index]
        limit = SLOW_TESTS.get(name, self.args.timeout)
        if time.monotonic() - start > limit:
            return f"timed out after {limit:g} s"
        failed = [r for r in (self.read_result(index, rank) for rank in range(self.size))
                  if r is not None and r["outcome"] == "failed"]
        if not failed:
            return None
        since = time.time() - min(r["time"] for r in failed)
        done = self.result_written.is_set()
        # A rank that finished waits a little longer: the one still in the test dumps first.
        if since > self.args.grace + (5.0 if done else 0.0):
            ranks = ", ".join(str(r["rank"]) for r in failed)
            waiting = "seen the others finish" if done else "finished it"
            return f"rank(s) {ranks} failed the test {since:.0f} s ago and this rank has " \
                   f"not {waiting}"
        return None


def _test_case_class(suite: Any) -> type:
    """The test case class of torch's ``test_distributed_spawn.py``, less the spawning."""

    class TestDistBackendWithMpiexec(suite.TestDistBackend,
                                     suite.DistributedTest._DistTestBase):
        """torch's distributed tests, one rank of each per MPI process."""

    name = f"TestDistBackendWithMpiexec{BACKEND.upper()}"
    TestDistBackendWithMpiexec.__name__ = TestDistBackendWithMpiexec.__qualname__ = name
    return TestDistBackendWithMpiexec


def _sorted_sets(text: str) -> str:
    """``text`` with the items of each ``{...}`` in it sorted (the reasons that name a set
    of backends print it in the order of the process's string hashes)."""
    return re.sub(r"\{([^{}]*)\}",
                  lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", text)


def _summary(error: BaseException) -> str:
    """``"Type: first line of the message"``."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    first = lines[0].strip() if lines else ""
    if len(first) > 300:
        first = first[:297] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _say(rank: int, text: str) -> None:
    print(f"[rank {rank}] {text}", file=sys.stderr, flush=True)


# ====================================================================== driver

def _test_names() -> list[str]:
    """The suite's test names, in unittest's order (imported here without MPI)."""
    os.environ.setdefault("BACKEND", BACKEND)
    os.environ.setdefault("WORLD_SIZE", "2")
    os.environ.setdefault("TEMP_DIR", "/tmp")
    import ringtrain.torch  # noqa: F401
    from torch.testing._internal.distributed import distributed_test as suite

    return list(unittest.TestLoader().getTestCaseNames(suite.DistributedTest._DistTestBase))


def _selected(names: list[str], patterns: list[str] | None) -> list[str]:
    if not patterns:
        return names
    chosen = []
    for name in names:
        for pattern in patterns:
            glob = any(c in pattern for c in "*?[")
            if (fnmatch.fnmatchcase(name, pattern) if glob else pattern in name):
                chosen.append(name)
                break
    return chosen


def _mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("mpiexec not found (next to the Python interpreter or on PATH)")
    return found


def _kill_job(process: subprocess.Popen) -> None:
    """Ask the ranks for their stacks (SIGUSR1), then kill mpiexec and all below it (the
    MPI proxies start the ranks in sessions of their own)."""
    import psutil

    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        below = []
    for child in below:
        try:
            if str(SCRIPT) in " ".join(child.cmdline()):
                child.send_signal(signal.SIGUSR1)
                time.sleep(0.5)  # one rank at a time
        except psutil.Error:
            pass
    time.sleep(1.0)
    for pid in [process.pid, *(child.pid for child in below)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Driver:
    """Starts the jobs, merges the ranks' records, keeps ``results.json`` up to date."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        gates = f"-gates-as-{args.gates_as}" if args.gates_as else ""
        self.out = Path(args.out_dir or
                        f"/tmp/ringtrain_torch_suite/ws{args.world_size}{gates}")
        self.state = self.out / "state"
        self.results_file = self.out / "results.json"
        self.names = _selected(_test_names(), args.k)
        if args.names_file:
            wanted = set(Path(args.names_file).read_text().split())
            self.names = [name for name in self.names if name in wanted]
        self.launches = 0
        self.records: dict[str, dict] = {}
        if args.resume and self.results_file.exists():
            saved = json.loads(self.results_file.read_text())
            self.records = {r["name"]: r for r in saved["tests"]
                            if r["outcome"] != "not run"}
            self.launches = saved.get("launches", 0)
        elif self.out.exists():
            shutil.rmtree(self.out)
        for sub in ("results", "logs", "t"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        (self.state / "tests.json").write_text(json.dumps(self.names))
        (self.state / "logs").mkdir(exist_ok=True)
        self.started = time.time()

    # ------------------------------------------------------------------ running

    def run(self) -> int:
        todo = [i for i, name in enumerate(self.names) if name not in self.records]
        self._run_indices(todo, isolate=self.args.isolate, key="outcome")
        if self.args.rerun_failed:
            again = [i for i, name in enumerate(self.names)
                     if self.records.get(name, {}).get("outcome") in ("failed", "hung",
                                                                      "crashed")]
            self._run_indices(again, isolate=True, key="isolated")
        self.save()
        print(summary_text(json.loads(self.results_file.read_text())))
        return 0

    def _run_indices(self, indices: list[int], isolate: bool, key: str) -> None:
        """Run the tests at ``indices`` (ascending), a job per test when ``isolate``, else
        a job per run of consecutive tests, started again after a failure."""
        pending = list(indices)
        while pending:
            start = pending[0]
            stop = start + 1
            if not isolate:  # the consecutive ones from start
                while stop < len(self.names) and stop in pending:
                    stop += 1
            finished = self._launch(start, stop, key)
            done = set(range(start, max(finished, start + 1)))
            pending = [i for i in pending if i not in done]
            self.save()

    def _launch(self, start: int, stop: int, key: str) -> int:
        """One mpiexec job over tests ``start..stop-1``; returns the index it got to (the
        next test to run)."""
        self.launches += 1
        launch = self.launches
        log_path = self.out / "logs" / f"job{launch:04d}.log"
        command = [_mpiexec(), "-n", str(self.args.world_size), sys.executable, str(SCRIPT),
                   "--worker", "--state", str(self.state), "--launch", str(launch),
                   "--start", str(start), "--stop", str(stop), "--world-size",
                   str(self.args.world_size), "--timeout", str(self.args.timeout),
                   "--grace", str(self.args.grace), "--init", self.args.init,
                   "--features", *self.args.features]
        if self.args.gates_as:
            command += ["--gates-as", self.args.gates_as]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)  # rank and size come from MPI
        print(f"[driver] job {launch}: tests {start}..{stop - 1} of {len(self.names)} "
              f"({self.names[start]} ...), log {log_path}", flush=True)
        began = time.monotonic()
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            killed = self._supervise(process, launch)
        seconds = time.monotonic() - began
        return self._collect(launch, start, stop, key, process.returncode, killed, log_path,
                             seconds)

    def _supervise(self, process: subprocess.Popen, launch: int) -> bool:
        """Wait for the job; kill it when a test outlives the ranks' own watchdogs."""
        startup_limit = 300.0
        began = time.monotonic()
        while process.poll() is None:
            time.sleep(2.0)
            progress = self._progress(launch)
            if progress:
                index = max(p["index"] for p in progress)
                name = self.names[index]
                limit = SLOW_TESTS.get(name, self.args.timeout) + 120.0
                since = time.time() - max(p["time"] for p in progress
                                          if p["index"] == index)
            else:
                limit, since = startup_limit, time.monotonic() - began
            if since > limit:
                print(f"[driver] job {launch} outlived its watchdogs: killing it", flush=True)
                _kill_job(process)
                process.wait()
                return True
        return False

    def _progress(self, launch: int) -> list[dict]:
        found = []
        for rank in range(self.args.world_size):
            try:
                record = json.loads((self.state / "logs" /
                                     f"progress.rank{rank}.json").read_text())
            except (OSError, ValueError):
                continue
            if record.get("launch") == launch:
                found.append(record)
        return found

    # ------------------------------------------------------------------ merging

    def _rank_records(self, launch: int, index: int) -> list[dict | None]:
        found = []
        for rank in range(self.args.world_size):
            path = self.state / "results" / f"{launch}-{index}.rank{rank}.json"
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                found.append(None)
        return found

    def _collect(self, launch: int, start: int, stop: int, key: str, returncode: int,
                 killed: bool, log_path: Path, seconds: float) -> int:
        """Record the tests job ``launch`` ran; return the index of the next test to run."""
        abort = None
        try:
            abort = json.loads((self.state / "results" / f"{launch}.abort.json").read_text())
        except (OSError, ValueError):
            pass
        progress = self._progress(launch)
        reached = max((p["index"] for p in progress), default=start - 1)
        for index in range(start, stop):
            ranks = self._rank_records(launch, index)
            if index > reached and not any(ranks):
                if index > start:
                    return index  # the job stopped before it: run it in the next
                self._store({"name": self.names[index], "outcome": "crashed",
                             "seconds": round(seconds, 1), "job": launch,
                             "error": f"the job ended (mpiexec status {returncode}) before "
                                      f"the test started; see {log_path}"}, key)
                return index + 1
            record = _merged(self.names[index], ranks)
            record["job"] = launch
            complete = all(r is not None for r in ranks)
            ended_here = index == reached and (killed or abort_for(abort, index))
            teardown = self._teardown_errors(launch, index)
            if not complete:
                self._unfinished(record, ranks, abort, killed, returncode, launch, index)
            elif teardown and record["outcome"] in ("passed", "skipped"):
                record.update(outcome="failed", phase="teardown",
                              error=f"destroy_process_group: {teardown[0]}")
            elif ended_here and record["outcome"] in ("passed", "skipped"):
                why = abort["reason"] if abort_for(abort, index) else "killed by the driver"
                record.update(outcome="hung", phase="teardown",
                              error=f"after the test's {record['outcome']}: the groups' "
                                    f"destruction did not end ({why})",
                              stacks=self._stacks(launch, index))
            elif index == reached and index < stop - 1 and returncode != 0 \
                    and record["outcome"] in ("passed", "skipped"):
                record.update(outcome="crashed", phase="teardown",
                              error=f"the job ended (mpiexec status {returncode}) after the "
                                    f"test's {record['outcome']}, destroying the groups",
                              stacks=self._stacks(launch, index))
            self._store(record, key)
            if not complete or record["outcome"] not in ("passed", "skipped"):
                return index + 1
        return stop

    def _teardown_errors(self, launch: int, index: int) -> list[str]:
        errors = []
        for rank in range(self.args.world_size):
            path = self.state / "results" / f"{launch}-{index}.teardown.rank{rank}.json"
            try:
                word = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if not word["ok"]:
                errors.append(f"rank {rank}: {word['error']}")
        return errors

    def _unfinished(self, record: dict, ranks: list[dict | None], abort: dict | None,
                    killed: bool, returncode: int, launch: int, index: int) -> None:
        """The outcome of a test that some rank did not finish: hung (the watchdogs or the
        driver ended the job) or crashed (the job ended by itself); a failure on another
        rank stays the outcome, with a note."""
        missing = [rank for rank, r in enumerate(ranks) if r is None]
        if abort_for(abort, index) or killed:
            why = abort["reason"] if abort_for(abort, index) else \
                "killed by the driver (the ranks' watchdogs did not end the job)"
            note = f"ranks {missing} did not finish: {why}"
            if record["outcome"] != "failed":
                record["outcome"] = "hung"
                record["error"] = note
            else:
                record["note"] = note
        else:
            note = f"the job ended (mpiexec status {returncode}) with ranks {missing} " \
                   f"in the test"
            if record["outcome"] != "failed":
                record["outcome"] = "crashed"
                record["error"] = note
            else:
                record["note"] = note
        record["stacks"] = self._stacks(launch, index)

    def _stacks(self, launch: int, index: int) -> dict[str, str]:
        header = f"--- launch {launch}, test {index} "
        found = {}
        for rank in range(self.args.world_size):
            path = self.state / "logs" / f"stacks.rank{rank}.txt"
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            at = text.rfind(header)
            if at >= 0:
                found[str(rank)] = text[at:at + STACK_CHARS]
        return found

    def _store(self, record: dict, key: str) -> None:
        name = record["name"]
        if key == "outcome":
            self.records[name] = record
            print(f"[driver] {record['outcome']:>7}  {name}  ({record.get('seconds', 0):.1f} s)"
                  f"  {record.get('error') or record.get('reason') or ''}", flush=True)
        else:
            kept = self.records.setdefault(name, {"name": name, "outcome": "not run"})
            fields = ("outcome", "seconds", "error", "reason", "note", "job")
            kept[key] = {k: record.get(k) for k in fields}
            kept[key]["ranks"] = record.get("ranks")
            print(f"[driver] alone: {record['outcome']:>7}  {name}  "
                  f"{record.get('error') or ''}", flush=True)

    def save(self) -> None:
        tests = []
        for name in self.names:
            tests.append(self.records.get(name, {"name": name, "outcome": "not run"}))
        import torch

        totals = collections.Counter(t["outcome"] for t in tests)
        data = {"backend": BACKEND, "world_size": self.args.world_size,
                "init": self.args.init, "features_added": list(self.args.features),
                "gates_as": self.args.gates_as,
                "torch": torch.__version__, "launches": self.launches,
                "seconds": round(time.time() - self.started, 1),
                "totals": {o: totals.get(o, 0) for o in OUTCOMES},
                "tests": tests}
        part = self.results_file.with_suffix(".part")
        part.write_text(json.dumps(data, indent=1))
        os.replace(part, self.results_file)


def abort_for(abort: dict | None, index: int) -> bool:
    return abort is not None and abort.get("index") == index


def _merged(name: str, ranks: list[dict | None]) -> dict:
    """One outcome from the ranks' records, as torch's harness merges exit codes: an error
    on any rank fails the test, else rank 0's skip skips it."""
    present = [r for r in ranks if r is not None]
    record: dict[str, Any] = {"name": name,
                              "seconds": max((r["seconds"] for r in present), default=0.0)}
    fields = ("outcome", "phase", "error", "reason", "seconds", "traceback")
    record["ranks"] = {str(r["rank"]): {k: r.get(k) for k in fields} for r in present}
    failed = [r for r in present if r["outcome"] == "failed"]
    if failed:
        # the error in the test itself before one met later (e.g. a barrier's timeout)
        first = min(failed, key=lambda r: (r.get("phase") != "test", r["time"]))
        record.update(outcome="failed", error=f"rank {first['rank']}: {first['error']}",
                      phase=first.get("phase"))
        return record
    if not present:
        record["outcome"] = "not run"
        return record
    lead = ranks[0] if ranks[0] is not None else present[0]
    record["outcome"] = lead["outcome"]
    if lead["outcome"] == "skipped":
        record["reason"] = lead.get("reason")
    return record


# ====================================================================== summary

def summary_text(data: dict) -> str:
    tests = data["tests"]
    totals = data["totals"]
    lines = [f"torch {data['torch']} distributed suite on '{data['backend']}', world size "
             f"{data['world_size']}, init {data['init']}, features added "
             f"{data['features_added']}"
             + (f", skip decisions as for '{data['gates_as']}'" if data.get("gates_as") else "")
             + f": {len(tests)} tests, {data['launches']} mpiexec jobs, "
             f"{data['seconds'] / 60:.0f} min"]
    reasons = collections.Counter(t.get("reason") for t in tests if t["outcome"] == "skipped")
    if reasons:
        lines.append("\nskipped, by reason:")
        lines += [f"  {count:4d}  {reason}" for reason, count in reasons.most_common()]
    bad = [t for t in tests if t["outcome"] in ("failed", "hung", "crashed")]
    if bad:
        lines.append("\nfailed, hung or crashed:")
        for t in bad:
            alone = t.get("isolated")
            extra = f"  [alone: {alone['outcome']}]" if alone else ""
            lines.append(f"  {t['outcome']:>7}  {t['name']}: {t.get('error')}{extra}")
    lines.append("")
    others = ", ".join(f"{totals[o]} {o}" for o in ("hung", "crashed", "not run") if totals[o])
    lines.append(f"{totals['passed']} passed, {totals['failed']} failed, "
                 f"{totals['skipped']} skipped" + (f" ({others})" if others else ""))
    return "\n".join(lines)


# ====================================================================== main

def _arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="torch's distributed test suite against the 'ringtrain' backend, "
                    "ranks started by mpiexec (see the module's docstring)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("-k", action="append", metavar="PATTERN",
                        help="run the tests whose names hold PATTERN (or match it as a "
                             "glob); may be repeated")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds a test may take (default {DEFAULT_TIMEOUT:.0f})")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE,
                        help="seconds the other ranks get to finish a test after one rank "
                             f"failed it (default {DEFAULT_GRACE:.0f})")
    parser.add_argument("--init", choices=("env", "file"), default="env",
                        help="env: init_process_group('ringtrain') with rank and size from "
                             "MPI (default); file: torch's file:// rendezvous with rank= "
                             "and world_size=, as torch's harness")
    parser.add_argument("--features", nargs="+", default=list(DEFAULT_FEATURES),
                        help="DistTestCases.backend_feature sets 'ringtrain' is added to "
                             f"(default: {' '.join(DEFAULT_FEATURES)})")
    parser.add_argument("--names-file", metavar="FILE",
                        help="run only the tests named in FILE (whitespace-separated)")
    parser.add_argument("--gates-as", metavar="BACKEND",
                        help="decide torch's skips by backend name as for BACKEND (e.g. "
                             "gloo, mpi), the tests still running on ringtrain: shows what "
                             "the tests torch keeps to other backends' names do on it")
    parser.add_argument("--isolate", action="store_true",
                        help="a fresh mpiexec job for every test")
    parser.add_argument("--rerun-failed", action="store_true",
                        help="run every test that failed, hung or crashed again alone")
    parser.add_argument("--resume", action="store_true",
                        help="keep the results in --out-dir and run the tests it lacks")
    parser.add_argument("--out-dir", help="default /tmp/ringtrain_torch_suite/ws<N>")
    parser.add_argument("--list", action="store_true", help="print the test names and exit")
    parser.add_argument("--summary", metavar="RESULTS_JSON",
                        help="print the summary of a results.json and exit")
    worker = parser.add_argument_group("internal (the ranks of a job)")
    worker.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    worker.add_argument("--state", help=argparse.SUPPRESS)
    worker.add_argument("--launch", type=int, default=0, help=argparse.SUPPRESS)
    worker.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    worker.add_argument("--stop", type=int, default=1 << 30, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.summary:
        print(summary_text(json.loads(Path(args.summary).read_text())))
        return 0
    try:
        import expecttest  # noqa: F401
    except ImportError:
        raise SystemExit("torch's test utilities import expecttest: pip install expecttest")
    if args.worker:
        return _Worker(args).run()
    if args.list:
        print("\n".join(_selected(_test_names(), args.k)))
        return 0
    if args.world_size < 2:
        raise SystemExit("--world-size: at least 2")
    return _Driver(args).run()


if __name__ == "__main__":
    sys.exit(main())
