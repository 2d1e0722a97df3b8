"""The timeline writer without MPI: a valid JSON file after every event, from any thread;
rows, ids and metadata; spans; odd names; the per-rank file names; starting and stopping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ringtrain.collectives import NotInitializedError, timeline
from ringtrain.collectives.timeline import Timeline, rank_path, start_timeline, stop_timeline

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_timeline_left():
    """Every test starts and ends without a running timeline."""
    stop_timeline()
    yield
    stop_timeline()


def load(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        trace = json.load(handle)
    assert trace["displayTimeUnit"] == "ms"
    return trace["traceEvents"]


def phases(events: list[dict]) -> list[dict]:
    return [event for event in events if event["ph"] != "M"]


def row_names(events: list[dict]) -> dict[int, str]:
    """tid -> row name, checking that each row is announced once."""
    names: dict[int, str] = {}
    for event in events:
        if event["ph"] == "M" and event["name"] == "thread_name":
            assert event["tid"] not in names, f"row {event['tid']} announced twice"
            names[event["tid"]] = event["args"]["name"]
    return names


# --------------------------------------------------------------------------- the file

def test_a_new_timeline_is_valid_json_naming_its_rank(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 3)
    events = load(path)
    assert {"name": "process_name", "ph": "M", "pid": 3, "tid": 0,
            "args": {"name": "rank 3"}} in events
    assert phases(events) == []
    with open(path, encoding="utf-8") as handle:
        assert json.load(handle)["otherData"]["rank"] == 3
    line.close()


def test_the_file_is_valid_json_after_every_event(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 0.0)  # every event written at once
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    for count in range(1, 41):
        start = line.now()
        if count % 3 == 0:
            line.instant(f"row {count % 4}", "moment", n=count)
        else:
            line.record(f"row {count % 4}", "pack", start, line.now(), {"n": count})
        events = phases(load(path))
        assert len(events) == count
        assert events[-1]["args"] == {"n": count}
    assert os.path.getsize(path) == len(path.read_bytes())
    assert path.read_text().endswith("\n]}\n")
    line.close()


def test_events_are_written_in_batches_and_the_file_stays_valid(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 3600.0)
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    for count in range(3):
        line.record("row", "pack", line.now(), line.now(), {"n": count})
        assert phases(load(path)) == []  # kept, and the file still whole
    line.flush()
    assert [event["args"]["n"] for event in phases(load(path))] == [0, 1, 2]
    line.instant("row", "moment")
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 0.0)  # the next event writes both
    line.record("row", "unpack", line.now(), line.now())
    names = [event["name"] for event in phases(load(path))]
    assert names == ["pack", "pack", "pack", "moment", "unpack"]
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 3600.0)
    line.record("row", "last", line.now(), line.now())
    line.close()
    assert phases(load(path))[-1]["name"] == "last"  # closing writes what was kept


def test_events_from_four_threads_each_leave_a_valid_file(tmp_path, monkeypatch):
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 0.0)
    path = tmp_path / "t.json"
    line = Timeline(str(path), 1)
    # Check the file after every write, inside the writer's lock: no other event can be
    # half-written at that moment.
    write, checked = line._write, []

    def write_and_check(events):
        write(events)
        checked.append(len(phases(load(path))))

    line._write = write_and_check
    per_thread, barrier = 50, threading.Barrier(4)

    def work(thread: int) -> None:
        barrier.wait()
        for index in range(per_thread):
            start = line.now()
            line.record(f"tensor {thread}", "reduce-scatter", start, line.now(),
                        {"thread": thread, "index": index})
            if index % 10 == 0:
                line.record("shared bucket", "allgather", start, line.now(), {"thread": thread})

    threads = [threading.Thread(target=work, args=(number,)) for number in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    line.close()
    total = 4 * per_thread + 4 * 5
    assert checked == list(range(1, total + 1))
    events = load(path)
    names = row_names(events)
    assert sorted(names.values()) == ["shared bucket"] + [f"tensor {n}" for n in range(4)]
    assert sorted(names) == list(range(1, 6))
    by_row = {name: [event for event in phases(events) if names[event["tid"]] == name]
              for name in names.values()}
    for thread in range(4):
        row = by_row[f"tensor {thread}"]
        assert [event["args"]["index"] for event in row] == list(range(per_thread))
        assert {event["args"]["thread"] for event in row} == {thread}
    assert len(by_row["shared bucket"]) == 20
    assert all(event["pid"] == 1 for event in events)


def test_complete_events_their_rows_and_sort_order(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 2)
    line.record("allreduce 'b'", "pack", 1.0, 2.5, {"bytes": 16})
    line.record("allreduce 'a'", "MPI allreduce", 3.0, 3.0)
    line.record("allreduce 'b'", "unpack", 4.0, 5.0)
    line.close()
    events = load(path)
    assert row_names(events) == {1: "allreduce 'b'", 2: "allreduce 'a'"}
    sort = {event["tid"]: event["args"]["sort_index"] for event in events
            if event["name"] == "thread_sort_index"}
    assert sort == {1: 1, 2: 2}
    assert phases(events) == [
        {"name": "pack", "ph": "X", "ts": 1.0, "dur": 1.5, "pid": 2, "tid": 1,
         "args": {"bytes": 16}},
        {"name": "MPI allreduce", "ph": "X", "ts": 3.0, "dur": 0.0, "pid": 2, "tid": 2,
         "args": {}},
        {"name": "unpack", "ph": "X", "ts": 4.0, "dur": 1.0, "pid": 2, "tid": 1, "args": {}}]


def test_rounding_keeps_nested_phases_inside_their_parent(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    line.record("r", "allreduce", 10.00049, 20.00049)
    line.record("r", "pack", 10.0004, 20.0004)
    line.record("r", "backwards", 5.0, 4.0)
    line.close()
    outer, inner, backwards = phases(load(path))
    assert outer["ts"] <= inner["ts"]
    assert inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert backwards["dur"] == 0.0


def test_now_counts_microseconds_from_the_start(tmp_path):
    line = Timeline(str(tmp_path / "t.json"), 0)
    first = line.now()
    second = line.now()
    assert 0 <= first <= second < 60e6
    line.close()


def test_from_monotonic_puts_the_compiled_calls_clock_on_the_timeline(tmp_path):
    """Times that compiled calls take (``clock_gettime(CLOCK_MONOTONIC)``) land where
    :meth:`Timeline.now` puts the same moment."""
    line = Timeline(str(tmp_path / "t.json"), 0)
    before = line.now()
    converted = line.from_monotonic(time.clock_gettime(time.CLOCK_MONOTONIC))
    after = line.now()
    assert before - 50 <= converted <= after + 50
    line.close()


def test_phases_recorded_together_equal_phases_recorded_one_by_one(tmp_path):
    together, alone = tmp_path / "together.json", tmp_path / "alone.json"
    args = {"bytes": 1 << 20}
    recorded = [("wait for ranks", 1.0, 2.5, None), ("reduce-scatter", 2.5, 7.25, args),
                ("allgather", 7.25, 9.0, args), ("reduce-scatter", 11.0, 12.0, args),
                ("odd", 12.0, 13.0, {"list": [1, 2], "nan": float("nan")})]
    line = Timeline(str(together), 1)
    line.record_phases("allreduce 'w'", recorded[:3])
    line.record_phases("allreduce 'w'", recorded[3:])
    line.close()
    line = Timeline(str(alone), 1)
    for phase, start, end, phase_args in recorded:
        line.record("allreduce 'w'", phase, start, end, phase_args)
    line.close()
    assert load(together) == load(alone)
    assert [(event["name"], event["ts"], event["dur"], event["args"])
            for event in phases(load(together))] == [
        ("wait for ranks", 1.0, 1.5, {}), ("reduce-scatter", 2.5, 4.75, args),
        ("allgather", 7.25, 1.75, args), ("reduce-scatter", 11.0, 1.0, args),
        ("odd", 12.0, 1.0, {"list": [1, 2], "nan": "nan"})]


def test_a_span_records_its_body_and_takes_args_from_it(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    with line.span("allreduce 'w'", "allreduce", bytes=64) as args:
        args["algorithm"] = "ring"
        with line.span("allreduce 'w'", "reduce-scatter"):
            pass
    line.close()
    inner, outer = phases(load(path))
    assert (outer["name"], inner["name"]) == ("allreduce", "reduce-scatter")
    assert outer["args"] == {"bytes": 64, "algorithm": "ring"}
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def test_a_span_records_the_error_and_lets_it_through(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    with pytest.raises(KeyError):
        with line.span("bucket 1/2", "unpack", bytes=8):
            raise KeyError("x")
    line.close()
    (event,) = phases(load(path))
    assert event["name"] == "unpack" and event["args"] == {"bytes": 8, "error": "KeyError"}


def test_instant_events(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 5)
    line.instant("allreduce 'w'", "wait for ranks", ranks=[1, 2])
    line.close()
    (event,) = phases(load(path))
    assert event["ph"] == "i" and event["s"] == "t" and event["pid"] == 5
    assert event["args"] == {"ranks": [1, 2]} and event["ts"] >= 0


ODD_NAMES = ['allreduce "w"', "it's", "back\\slash", "new\nline\ttab", "grad ∇ 权重 🚀",
             "\x00\x1f", "]} , {", "lone \udc80 surrogate", ""]


def test_odd_names_and_args_stay_valid_json(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    for name in ODD_NAMES:
        line.record(name, name, 0.0, 1.0, {name: name})
        load(path)
    line.record(7, "numbered row", 0.0, 1.0)
    line.close()
    events = load(path)
    assert list(row_names(events).values()) == ODD_NAMES + ["7"]
    assert [event["name"] for event in phases(events)] == ODD_NAMES + ["numbered row"]
    assert [event["args"] for event in phases(events)][:-1] == [{n: n} for n in ODD_NAMES]


def test_numpy_and_non_finite_args(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    line.record("r", "pack", 0.0, 1.0, {"bytes": np.int64(4096), "dtype": np.dtype("float16"),
                                        "scale": np.float32(0.5), "shape": (2, 3)})
    line.record("r", "compress", 0.0, 1.0, {"nan": float("nan"), "inf": np.float64("inf"),
                                            (1, 2): "tuple key", "ok": 1})
    line.close()
    first, second = phases(load(path))
    assert first["args"] == {"bytes": 4096, "dtype": "float16", "scale": 0.5, "shape": [2, 3]}
    assert second["args"] == {"nan": "nan", "inf": "inf", "(1, 2)": "tuple key", "ok": 1}
    json.loads(path.read_text(), parse_constant=pytest.fail)  # no NaN or Infinity in it


def test_events_after_close_are_ignored(tmp_path):
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    line.record("r", "pack", 0.0, 1.0)
    line.close()
    before = path.read_bytes()
    line.record("r", "unpack", 1.0, 2.0)
    line.instant("r", "moment")
    with line.span("r", "allreduce"):
        pass
    line.close()
    assert line.closed and path.read_bytes() == before
    assert len(phases(load(path))) == 1


class _FullDisk:
    def seek(self, _position):
        return 0

    def write(self, _data):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass

    def close(self):
        pass


def test_a_failing_write_stops_the_timeline_not_the_program(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(timeline, "FLUSH_SECONDS", 0.0)
    path = tmp_path / "t.json"
    line = Timeline(str(path), 0)
    line.record("r", "pack", 0.0, 1.0)
    line._file.close()
    line._file = _FullDisk()
    line.record("r", "unpack", 1.0, 2.0)
    line.record("r", "unpack", 2.0, 3.0)
    assert line.closed
    assert capsys.readouterr().err == (f"ringtrain: the timeline {path} stopped: cannot write "
                                       "it ([Errno 28] No space left on device)\n")
    assert len(phases(load(path))) == 1


# --------------------------------------------------------------------------- unwritable paths

def test_an_unwritable_path_is_named_at_the_start(tmp_path):
    missing = tmp_path / "no such directory" / "t.json"
    with pytest.raises(FileNotFoundError, match=r"cannot write the timeline file .*"
                       r"no such directory/t\.json \(No such file or directory\)"):
        Timeline(str(missing), 0)
    with pytest.raises(IsADirectoryError, match=f"cannot write the timeline file {tmp_path}"):
        start_timeline(str(tmp_path), 0, 1)
    assert timeline.ACTIVE is None


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_disk_at_the_start_is_an_error():
    with pytest.raises(OSError, match="cannot write the timeline file /dev/full"):
        Timeline("/dev/full", 0)


# --------------------------------------------------------------------------- file names

@pytest.mark.parametrize("path, rank, size, expected", [
    ("t.json", 0, 1, "t.json"),
    ("/runs/t", 0, 1, "/runs/t"),
    ("/runs/t.json", 0, 2, "/runs/t.rank0.json"),
    ("/runs/t.json", 11, 12, "/runs/t.rank11.json"),
    ("/runs/t.trace", 1, 2, "/runs/t.rank1.trace"),
    ("/runs/t", 1, 2, "/runs/t.rank1.json"),
    ("/runs.d/t", 1, 2, "/runs.d/t.rank1.json"),
    ("t.tar.json", 1, 2, "t.tar.rank1.json"),
])
def test_rank_path(path, rank, size, expected):
    assert rank_path(path, rank, size) == expected


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0)])
def test_rank_path_refuses_a_rank_out_of_range(rank, size):
    with pytest.raises(ValueError, match=f"no rank {rank} among {size} ranks"):
        rank_path("t.json", rank, size)


# --------------------------------------------------------------------------- start, stop

def test_start_and_stop_with_explicit_rank_and_size(tmp_path):
    assert timeline.ACTIVE is None
    assert timeline.TIMELINE_VARIABLE == "RINGTRAIN_TIMELINE"
    start_timeline(str(tmp_path / "t.json"), 1, 4)
    first = timeline.ACTIVE
    assert isinstance(first, Timeline) and first.rank == 1
    assert first.path == str(tmp_path / "t.rank1.json")
    first.record("r", "pack", 0.0, 1.0)
    start_timeline(str(tmp_path / "u.json"), 0, 1)  # closes the running one
    second = timeline.ACTIVE
    assert first.closed and second is not first and second.path == str(tmp_path / "u.json")
    stop_timeline()
    assert timeline.ACTIVE is None and second.closed
    stop_timeline()  # nothing running: nothing to do
    assert timeline.ACTIVE is None
    assert len(phases(load(tmp_path / "t.rank1.json"))) == 1
    assert sorted(os.listdir(tmp_path)) == ["t.rank1.json", "u.json"]


def test_start_refuses_a_rank_out_of_range(tmp_path):
    with pytest.raises(ValueError, match="no rank 4 among 4 ranks"):
        start_timeline(str(tmp_path / "t.json"), 4, 4)
    assert timeline.ACTIVE is None and os.listdir(tmp_path) == []


def test_start_without_rank_needs_ringtrain_initialized(tmp_path):
    with pytest.raises(NotInitializedError, match="not initialized"):
        start_timeline(str(tmp_path / "t.json"))
    with pytest.raises(NotInitializedError):
        start_timeline(str(tmp_path / "t.json"), rank=0)
    assert timeline.ACTIVE is None


def test_start_without_rank_takes_the_world_that_init_gave(tmp_path):
    timeline.set_world((2, 4))  # as ringtrain.init does
    try:
        start_timeline(str(tmp_path / "t.json"))
        assert timeline.ACTIVE.path == str(tmp_path / "t.rank2.json")
        start_timeline(str(tmp_path / "u.json"), rank=1)
        assert timeline.ACTIVE.path == str(tmp_path / "u.rank1.json")
    finally:
        stop_timeline()
        timeline.set_world(None)  # as shutdown does
    with pytest.raises(NotInitializedError):
        start_timeline(str(tmp_path / "t.json"))


# Loads collectives/timeline.py under a bare stand-in for the ringtrain.collectives
# package, so that nothing but the module itself (and what it imports) is imported.
ALONE = """
import importlib, json, sys, types
import ringtrain
package = types.ModuleType("ringtrain.collectives")
package.__path__ = [sys.argv[1]]
sys.modules["ringtrain.collectives"] = package
module = importlib.import_module("ringtrain.collectives.timeline")
assert module.ACTIVE is None
print(json.dumps(sorted(name for name in sys.modules if name.startswith(
    ("mpi4py", "numpy", "numba", "ringtrain.collectives.", "ringtrain.kernels")))))
"""


@pytest.mark.processes
def test_the_module_itself_imports_neither_mpi4py_nor_the_world():
    result = subprocess.run([sys.executable, "-c", ALONE, str(ROOT / "collectives")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["ringtrain.collectives.errors",
                                         "ringtrain.collectives.timeline"]
