"""Run the KVStore's multi-rank programs under tests/mpi/ (1 to 4 ranks), and its async
modes under ringtrain-run."""

from __future__ import annotations

import re
import sys

import pytest

from mpi_launch import ABORTED, ROOT, TRAINING, run_in_bundle, run_mpi
from test_launcher_runs import launch, needs_mpi

pytestmark = pytest.mark.processes

# Each program, the world sizes it runs at, and the fewest checks it must report passed.
PROGRAMS = {"kvstore_sync": ([1, 2, 3, 4], 14), "kvstore_async": ([1, 2, 3, 4], 8)}


@pytest.mark.parametrize("program,nprocs",
                         [(p, n) for p, (sizes, _) in PROGRAMS.items() for n in sizes],
                         ids=lambda v: v if isinstance(v, str) else f"np{v}")
def test_program(program, nprocs):
    run_in_bundle(program, TRAINING, nprocs, PROGRAMS[program][1],
                  timeout=240 * len(TRAINING))


@needs_mpi
def test_ringtrain_run_servers_sets_the_number_of_server_ranks():
    example = str(ROOT / "examples" / "kvstore_async.py")
    run = launch("-np", "3", "--servers", "2", sys.executable, example, "--steps", "10",
                 "--slow-sleep", "0")
    assert run.returncode == 0, run
    assert "[0] 3 ranks: final loss" in run.stdout, run
    assert "(dist_async, 1 workers, 2 servers)" in run.stdout, run


@needs_mpi
def test_a_worker_that_dies_ends_the_job_while_the_server_serves_the_others():
    """Worker 0 pushes forever and worker 1 fails: ringtrain-run names rank 1 and stops
    the job, the server having served worker 0 until then."""
    code = ("import numpy as np, time\n"
            "from ringtrain import kvstore\n"
            "kv = kvstore.create('dist_async')\n"
            "kv.init(0, np.zeros(3))\n"
            "if kv.rank == 1:\n"
            "    time.sleep(0.5)\n"
            "    raise RuntimeError('worker 1 cannot go on')\n"
            "while True:\n"
            "    kv.push(0, np.ones(3))\n"
            "    time.sleep(0.01)\n")
    run = launch("-np", "3", sys.executable, "-c", code)
    assert run.returncode == 1, run
    assert run.stderr.splitlines()[-1].startswith(
        "ringtrain-run: rank 1 raised RuntimeError: worker 1 cannot go on"), run


@needs_mpi
def test_an_optimizer_that_fails_on_a_server_ends_the_job_naming_the_key():
    code = ("import numpy as np\n"
            "from ringtrain import kvstore\n"
            "def update(key, grad, weight):\n"
            "    if key == 'bad':\n"
            "        raise ValueError('no update for this key')\n"
            "kv = kvstore.create('dist_async')\n"
            "kv.set_optimizer(update)\n"
            "kv.init(['good', 'bad'], [np.zeros(3), np.zeros(3)])\n"
            "kv.push('good', np.ones(3))\n"
            "kv.push('bad', np.ones(3))\n"
            "kv.pull('bad')\n"
            "print('not reached')\n")
    run = launch("-np", "2", sys.executable, "-c", code)
    assert run.returncode != 0 and "not reached" not in run.stdout, run
    assert "kvstore server rank 1: push of key 'bad' from worker 0 failed" in run.stderr, run
    assert "ValueError: no update for this key" in run.stderr, run


@pytest.mark.parametrize("late,call", [("init", "allgather_object of tensor 'kvstore init'"),
                                       ("barrier", "barrier of tensor")])
def test_a_worker_missing_from_a_call_of_every_worker_is_named(late, call):
    """Worker 1 does not come to ``init`` (or to a ``barrier``): worker 0 names it, then
    the stall shutdown ends the job instead of a hang."""
    output = run_mpi("kvstore_stall", 3, late, timeout=60, expected_status=ABORTED,
                     env={"RINGTRAIN_STALL_CHECK_SECONDS": "1",
                          "RINGTRAIN_STALL_SHUTDOWN_SECONDS": "3"})
    assert f"r0 | WARNING | {call}" in output, output
    assert re.search(r"r0 \| ERROR \| .* has waited \d+ s for rank 1, which has not called "
                     r"it .*; aborting the job", output), output
    assert "done" not in output, output
