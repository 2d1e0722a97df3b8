"""Diagnostics: the stall inspector names the missing rank, the debug log tags every line
with its rank, errors on the collectives thread reach the caller."""

from __future__ import annotations

import json
import re
import time

import pytest

from mpi_launch import ABORTED, run_mpi

pytestmark = pytest.mark.processes

STALL = {"RINGTRAIN_STALL_CHECK_SECONDS": "1"}


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_late_rank_is_named_by_every_waiting_rank(nprocs):
    late = nprocs - 1
    started = time.monotonic()
    output = run_mpi("diagnostics_stall", nprocs, "late", "4", timeout=120, env=STALL)
    for rank in range(late):
        warning = re.search(
            rf"r{rank} \| WARNING \| allreduce of tensor 'w' \(call 2 on ranks 0-{late}\) "
            rf"has waited (\d+) s for rank {late}, which has not called it \(it is in no "
            rf"collective; 1 earlier call on these ranks, the last \d+ s ago: allreduce of "
            rf"tensor 'v'", output)
        assert warning, output
        assert int(warning.group(1)) <= 2, output  # within the configured second or so
    if nprocs > 2:
        assert re.search(r"r0 \| WARNING \| .*; rank 1 is waiting in it too", output), output
    assert f"r{late} | WARNING" not in output, output
    assert output.count(" done") == nprocs
    assert time.monotonic() - started < 60


def test_a_rank_waiting_elsewhere_is_told_apart_from_one_that_never_came():
    output = run_mpi("diagnostics_stall", 4, "elsewhere", "4", timeout=120, env=STALL)
    assert re.search(r"r0 \| WARNING \| allreduce of tensor 'w' \(call 2 on ranks 0-3\) has "
                     r"waited \d+ s for rank 2, which is waiting in allreduce of tensor 'x' "
                     r"\(call 1 on ranks 2-3\) for \d+ s; rank 3, which has not called it",
                     output), output
    assert re.search(r"r2 \| WARNING \| allreduce of tensor 'x' \(call 1 on ranks 2-3\) has "
                     r"waited \d+ s for rank 3, which has not called it", output), output


def test_the_stall_shutdown_ends_the_job_with_the_reason():
    started = time.monotonic()
    output = run_mpi("diagnostics_stall", 2, "late", "60", timeout=60,
                     expected_status=ABORTED,
                     env={**STALL, "RINGTRAIN_STALL_SHUTDOWN_SECONDS": "3"})
    assert re.search(r"r0 \| ERROR \| allreduce of tensor 'w' .* has waited \d+ s for rank 1, "
                     r"which has not called it .*; aborting the job "
                     r"\(RINGTRAIN_STALL_SHUTDOWN_SECONDS=3\)", output), output
    assert "woke up" not in output
    assert time.monotonic() - started < 30


def test_no_stall_inspector_when_switched_off():
    output = run_mpi("diagnostics_stall", 2, "late", "2", timeout=60,
                     env={"RINGTRAIN_STALL_CHECK_SECONDS": "0"})
    assert "WARNING" not in output and output.count(" done") == 2, output


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_debug_log_has_a_rank_tagged_line_per_call(nprocs):
    output = run_mpi("diagnostics_log", nprocs, timeout=120,
                     env={"RINGTRAIN_LOG_LEVEL": "DEBUG"})
    for rank in range(nprocs):
        assert re.search(rf"^r{rank} \| DEBUG \| allreduce 'grad' 4000 B peers [\d,-]+ "
                         rf"recursive_doubling \d+\.\d{{3}} ms$", output, re.M), output
        assert re.search(rf"^r{rank} \| DEBUG \| allreduce 'big' 400000 B peers [\d,-]+ ring ",
                         output, re.M), output
        assert re.search(rf"^r{rank} \| DEBUG \| broadcast 'weights' 80 B root 0 ", output,
                         re.M), output
        assert f"rank {rank} finished" in output
    if nprocs > 1:
        assert output.count("caught: allreduce of tensor 'uneven' was called with different "
                            "arguments") == nprocs, output


def test_debug_lines_are_off_by_default():
    output = run_mpi("diagnostics_log", 2, timeout=120)
    assert "DEBUG" not in output, output


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_timeline_of_a_small_training_run(nprocs, tmp_path):
    path = tmp_path / "timeline.json"
    run_mpi("diagnostics_timeline", nprocs, timeout=120, env={"RINGTRAIN_TIMELINE": str(path)})
    # Under a plain mpiexec, rank 0 merges the ranks' files into the one trace.
    merged = json.loads(path.read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["timeline.json"]
    for rank in range(nprocs):
        events = [event for event in merged if event.get("pid") == rank]
        rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        phases: dict[str, set[str]] = {}
        for event in events:
            if event["ph"] == "X":
                assert event["pid"] == rank and event["dur"] >= 0
                phases.setdefault(rows[event["tid"]], set()).add(event["name"])
        buckets = [row for row in phases if row.startswith("gradient bucket")]
        assert "gradient bucket 1/2 [b2, w2, b1]" in buckets, phases
        assert "gradient bucket 2/2 [w1]" in buckets, phases
        small = phases["gradient bucket 1/2 [b2, w2, b1]"]
        assert {"allreduce_", "pack", "unpack", "compress", "decompress"} <= small, small
        if nprocs > 1:
            assert {"wait for ranks", "recursive doubling"} <= small, small
            # the large bucket's data phase is the one of the algorithm auto chose
            chosen = {e["args"]["algorithm"] for e in events if e["ph"] == "X"
                      and rows[e["tid"]] == "gradient bucket 2/2 [w1]"
                      and e["name"] == "allreduce_"}
            expected = {"ring": {"reduce-scatter", "allgather"}, "native": {"MPI allreduce"}}
            assert chosen and chosen <= set(expected), chosen
            for algorithm in chosen:
                assert expected[algorithm] <= phases["gradient bucket 2/2 [w1]"], algorithm
            assert {"allreduce", "wait for ranks", "MPI allreduce"} <= phases["small"]
        whole = [e for e in events if e["ph"] == "X" and e["name"] == "allreduce_"]
        assert all(e["args"]["bytes"] > 0 and e["args"]["algorithm"] for e in whole), whole
