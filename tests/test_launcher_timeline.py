"""ringtrain-run --timeline: the option and the ranks' environment, merging the ranks'
files (by the launcher and by hand), and whole jobs on real MPI writing one trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.collectives import timeline
from ringtrain.collectives.timeline import Timeline
from ringtrain.launcher import timeline_merge
from ringtrain.launcher.cli import CommandLineError, build_parser, job_timeline, parse_environment
from ringtrain.launcher.command import build_mpiexec_argv, rank_command
from ringtrain.launcher.mpi_vendor import Vendor
from ringtrain.launcher.timeline_merge import JobTimeline, merge
from test_launcher_argv import run_cli
from test_launcher_runs import launch, needs_mpi

E2E_TIMEOUT = 120.0


def load(path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)["traceEvents"]


def phases(events: list[dict]) -> list[dict]:
    return [event for event in events if event["ph"] != "M"]


def write_rank(path: Path, rank: int, events: int = 2, close: bool = True) -> Timeline:
    line = Timeline(str(path), rank)
    for index in range(events):
        line.record(f"allreduce 'w{index}'", "allreduce", 10.0 * index, 10.0 * index + 5,
                    {"rank": rank})
    if close:
        line.close()
    return line


# --------------------------------------------------------------------------- one naming rule

def test_the_collectives_use_the_launchers_naming_rule_and_variable():
    assert timeline.rank_path is timeline_merge.rank_path
    assert timeline.TIMELINE_VARIABLE == timeline_merge.TIMELINE_VARIABLE == "RINGTRAIN_TIMELINE"


@pytest.mark.processes
def test_the_merge_module_imports_nothing_heavy(tmp_path):
    probe = ("import json, sys\n"
             "import ringtrain.launcher.timeline_merge\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith("
             "('mpi4py', 'numpy', 'numba', 'ringtrain.collectives', 'ringtrain.kernels')))))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


# --------------------------------------------------------------------------- option and argv

def test_the_option_gives_every_rank_the_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = build_parser().parse_args(["-np", "2", "--timeline", "t.json", "python", "x.py"])
    assert options.timeline == "t.json" and options.command == ["python", "x.py"]
    environment = parse_environment(["A=1"])
    job = job_timeline(options.timeline, environment)
    absolute = str(tmp_path / "t.json")
    assert job.path == absolute
    assert environment == {"A": "1", "RINGTRAIN_TIMELINE": absolute,
                           "RINGTRAIN_TIMELINE_MERGED_BY_LAUNCHER": "1"}
    rank = rank_command(["python", "x.py"], python="python3")
    argv = build_mpiexec_argv(Vendor.MPICH, "mpiexec", 2, rank, environment=environment,
                              local_cores=2)
    assert argv == ["mpiexec", "-n", "2", "-genv", "A", "1", "-genv", "RINGTRAIN_TIMELINE",
                    absolute, "-genv", "RINGTRAIN_TIMELINE_MERGED_BY_LAUNCHER", "1",
                    "-bind-to", "none", *rank]
    argv = build_mpiexec_argv(Vendor.OPEN_MPI, "mpiexec", 2, rank, environment=environment,
                              local_cores=2)
    assert argv[3:9] == ["-x", "A=1", "-x", f"RINGTRAIN_TIMELINE={absolute}", "-x",
                         "RINGTRAIN_TIMELINE_MERGED_BY_LAUNCHER=1"]


def test_without_the_option_nothing_changes():
    options = build_parser().parse_args(["-np", "2", "python", "x.py"])
    environment = {"A": "1"}
    assert options.timeline is None and job_timeline(None, environment) is None
    assert environment == {"A": "1"}


def test_the_option_with_the_variable_set_by_env_is_refused(tmp_path):
    with pytest.raises(CommandLineError, match="give --timeline alone"):
        job_timeline(str(tmp_path / "t.json"), {"RINGTRAIN_TIMELINE": "u.json"})


@pytest.mark.parametrize("timeline_argument, message", [
    ("missing/t.json", "--timeline missing/t.json: no directory "),
    (".", "is a directory; give a file name"),
])
@pytest.mark.processes
def test_bad_timeline_paths_are_refused_before_anything_starts(tmp_path, timeline_argument,
                                                               message):
    (tmp_path / "t.py").write_text("print('should not run')\n")
    probe, errors, output = run_cli(["-np", "2", "--timeline", timeline_argument, "python",
                                     "t.py"], tmp_path)
    assert probe["code"] == 2 and output == ""
    assert len(errors) == 1 and errors[0].startswith("ringtrain-run: error: "), errors
    assert message in errors[0], errors
    assert probe["started"] == [] and probe["modules"] == []


@pytest.mark.processes
def test_the_env_conflict_is_one_line_and_exit_code_2(tmp_path):
    (tmp_path / "t.py").write_text("print('should not run')\n")
    probe, errors, _ = run_cli(["-np", "2", "--timeline", "t.json", "--env",
                                "RINGTRAIN_TIMELINE=u.json", "python", "t.py"], tmp_path)
    assert probe["code"] == 2 and probe["started"] == []
    assert errors == ["ringtrain-run: error: --timeline and --env RINGTRAIN_TIMELINE both give "
                      "the timeline: give --timeline alone"]


@pytest.mark.processes
def test_help_shows_the_option(tmp_path):
    probe, _, output = run_cli(["--help"], tmp_path)
    assert probe["code"] == 0 and "--timeline PATH" in output


# --------------------------------------------------------------------------- merging

def test_merge_keeps_every_event_with_its_rank(tmp_path):
    files = [str(tmp_path / f"t.rank{rank}.json") for rank in range(3)]
    for rank, file in enumerate(files):
        write_rank(Path(file), rank, events=rank + 1)
    out = tmp_path / "t.json"
    count = merge(files, str(out))
    events = load(out)
    assert count == len(events)
    assert sorted(event["pid"] for event in phases(events)) == [0, 1, 1, 2, 2, 2]
    assert all(event["args"]["rank"] == event["pid"] for event in phases(events))
    names = {(event["pid"], event["args"]["name"]) for event in events
             if event["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1"), (2, "rank 2")}
    with open(out, encoding="utf-8") as handle:
        trace = json.load(handle)
    assert trace["displayTimeUnit"] == "ms" and trace["otherData"]["ranks"] == 3


def _set_start(path: Path, start: float) -> None:
    trace = json.loads(path.read_text())
    trace["otherData"]["start_unix_us"] = start
    path.write_text(json.dumps(trace))


def test_merge_lines_the_ranks_clocks_up(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    write_rank(first, 0, events=1)
    write_rank(second, 1, events=1)
    _set_start(first, 1_000_000.0)
    _set_start(second, 1_250_000.5)  # started 250000.5 us after rank 0
    merge([str(first), str(second)], str(tmp_path / "t.json"))
    starts = {event["pid"]: event["ts"] for event in phases(load(tmp_path / "t.json"))}
    assert starts == {0: 0.0, 1: 250_000.5}


def test_merge_takes_the_file_of_a_rank_killed_mid_job(tmp_path):
    files = [tmp_path / "t.rank0.json", tmp_path / "t.rank1.json"]
    write_rank(files[0], 0)
    running = write_rank(files[1], 1, events=3, close=False)  # as a killed rank leaves it
    running.flush()  # killed after the timeline wrote what it kept
    assert merge([str(file) for file in files], str(tmp_path / "t.json")) > 0
    assert len([e for e in phases(load(tmp_path / "t.json")) if e["pid"] == 1]) == 3
    running.close()


def test_merge_skips_missing_empty_and_corrupt_files_with_a_warning(tmp_path, capsys):
    good = tmp_path / "good.json"
    write_rank(good, 0)
    empty, corrupt, other = tmp_path / "empty.json", tmp_path / "corrupt.json", \
        tmp_path / "other.json"
    empty.write_text("")
    corrupt.write_text('{"traceEvents": [{"name": "pa')
    other.write_text('{"not": "a trace"}')
    files = [str(good), str(tmp_path / "missing.json"), str(empty), str(corrupt), str(other)]
    count = merge(files, str(tmp_path / "t.json"))
    assert count == len(load(tmp_path / "t.json")) and len(phases(load(tmp_path / "t.json"))) == 2
    warnings = capsys.readouterr().err.splitlines()
    assert warnings[0] == f"timeline_merge: warning: timeline {tmp_path}/missing.json skipped: " \
                          "no such file"
    assert warnings[1] == f"timeline_merge: warning: timeline {empty} skipped: empty"
    assert warnings[2].startswith(f"timeline_merge: warning: timeline {corrupt} skipped: "
                                  "not valid JSON")
    assert warnings[3] == (f"timeline_merge: warning: timeline {other} skipped: not a trace "
                           "(no traceEvents list)")
    assert len(warnings) == 4


def test_merge_reads_the_array_format_and_may_write_over_an_input(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"name": "x", "ph": "X", "ts": 1, "dur": 1, "pid": 9,
                                  "tid": 1}]))
    rank = tmp_path / "rank.json"
    write_rank(rank, 0, events=1)
    before = len(load(rank))
    assert merge([str(array), str(rank)], str(rank)) == 1 + before
    assert {event["pid"] for event in phases(load(rank))} == {0, 9}
    assert sorted(os.listdir(tmp_path)) == ["array.json", "rank.json"]  # no temporary left


@pytest.mark.processes
def test_merge_from_the_command_line(tmp_path):
    files = [str(tmp_path / f"t.rank{rank}.json") for rank in range(2)]
    for rank, file in enumerate(files):
        write_rank(Path(file), rank)
    out = tmp_path / "t.json"
    result = subprocess.run([sys.executable, "-m", "ringtrain.launcher.timeline_merge",
                             str(out), *files, str(tmp_path / "missing.json")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    events = load(out)
    assert result.stderr.splitlines()[-1] == (f"timeline_merge: 2 of 3 files merged into {out} "
                                              f"({len(events)} events)")
    assert {event["pid"] for event in phases(events)} == {0, 1}
    usage = subprocess.run([sys.executable, "-m", "ringtrain.launcher.timeline_merge"],
                           capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage:" in usage.stderr


# --------------------------------------------------------------------------- the launcher's side

def test_the_job_timeline_merges_the_last_start_and_removes_the_ranks_files(tmp_path):
    path = tmp_path / "t.json"
    stale = [tmp_path / "t.rank0.json", tmp_path / "t.rank2.json"]
    for number, file in enumerate(stale):
        write_rank(file, number, events=5)
    job = JobTimeline(str(path))
    assert job.collect() is None  # never started
    job.before_start(3)
    assert not any(file.exists() for file in stale)  # a previous run's files
    for rank in range(3):
        write_rank(tmp_path / f"t.rank{rank}.json", rank)
    job.before_start(2)  # a restart with fewer ranks
    assert os.listdir(tmp_path) == []
    for rank in range(2):
        write_rank(tmp_path / f"t.rank{rank}.json", rank)
    line = job.collect()
    events = load(path)
    assert line == f"timeline of 2 ranks written to {path} ({len(events)} events)"
    assert len(phases(events)) == 4 and os.listdir(tmp_path) == ["t.json"]
    assert job.collect() is None  # once


def test_the_job_timeline_reports_ranks_that_wrote_nothing(tmp_path, capsys):
    path = tmp_path / "t.json"
    job = JobTimeline(str(path))
    job.before_start(2)
    assert job.collect() == f"no timeline written: no rank wrote its file ({tmp_path}/" \
                            "t.rank0.json, ...)"
    assert not path.exists()
    job.before_start(2)
    write_rank(tmp_path / "t.rank1.json", 1)
    assert job.collect().startswith(f"timeline of 1 of 2 ranks written to {path} (")
    assert capsys.readouterr().err == (f"ringtrain-run: warning: timeline {tmp_path}/"
                                       "t.rank0.json skipped: no such file\n")


def test_the_job_timeline_of_one_rank_is_its_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("an old file\n")
    job = JobTimeline(str(path))
    job.before_start(1)
    assert job.collect() == f"no timeline written: the rank wrote none to {path}"
    assert path.read_text() == "an old file\n"
    job.before_start(1)
    write_rank(path, 0)
    assert job.collect() == f"timeline of 1 rank written to {path} ({len(load(path))} events)"


# --------------------------------------------------------------------------- whole jobs

PROGRAM = """
import os, sys
from mpi4py import MPI
from ringtrain.collectives import timeline
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
restart = int(os.environ.get("RINGTRAIN_RESTART_COUNT", "0"))
timeline.start_timeline(os.environ["RINGTRAIN_TIMELINE"], rank, size)
line = timeline.ACTIVE
with line.span("allreduce 'w'", "allreduce", bytes=8, restart=restart):
    with line.span("allreduce 'w'", "wait for ranks"):
        comm.Barrier()
line.instant("allreduce 'w'", "done", rank=rank)
print("wrote", os.path.basename(line.path))
if sys.argv[1:] == ["fail"] and rank == 1 and restart == 0:
    raise ValueError("rank 1 fails")
timeline.stop_timeline()
"""


def assert_job_trace(path: Path, ranks: int, restart: int = 0) -> list[dict]:
    events = load(path)
    done = phases(events)
    assert sorted(event["pid"] for event in done) == sorted(list(range(ranks)) * 3)
    for rank in range(ranks):
        names = [event["name"] for event in done if event["pid"] == rank]
        assert names == ["wait for ranks", "allreduce", "done"], names
    assert {event["args"]["restart"] for event in done if event["name"] == "allreduce"} \
        == {restart}
    assert os.listdir(path.parent) == [path.name]  # the ranks' files are gone
    return events


@pytest.mark.processes
@needs_mpi
def test_a_job_of_two_ranks_writes_one_trace(tmp_path):
    path = tmp_path / "t.json"
    run = launch("-np", "2", "--timeline", str(path), "python", "-c", PROGRAM,
                 timeout=E2E_TIMEOUT)
    assert run.returncode == 0, run
    assert sorted(run.stdout.splitlines()) == ["[0] wrote t.rank0.json",
                                               "[1] wrote t.rank1.json"], run
    events = assert_job_trace(path, 2)
    assert run.stderr.splitlines()[-1] == (f"ringtrain-run: timeline of 2 ranks written to "
                                           f"{path} ({len(events)} events)"), run


@pytest.mark.processes
@needs_mpi
def test_a_job_of_one_rank_writes_the_trace_itself(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = launch("-np", "1", "--timeline", "t.json", "python", "-c", PROGRAM,
                 timeout=E2E_TIMEOUT)
    assert run.returncode == 0, run
    assert run.stdout.splitlines() == ["[0] wrote t.json"], run
    events = assert_job_trace(tmp_path / "t.json", 1)
    assert run.stderr.splitlines()[-1] == (f"ringtrain-run: timeline of 1 rank written to "
                                           f"{tmp_path / 't.json'} ({len(events)} events)"), run


@pytest.mark.processes
@needs_mpi
def test_a_failed_job_still_writes_its_trace_before_the_summary(tmp_path):
    path = tmp_path / "t.json"
    run = launch("-np", "2", "--timeline", str(path), "python", "-c", PROGRAM, "fail",
                 timeout=E2E_TIMEOUT)
    assert run.returncode == 1, run
    events = assert_job_trace(path, 2)
    lines = run.stderr.splitlines()
    assert lines[-2] == (f"ringtrain-run: timeline of 2 ranks written to {path} "
                         f"({len(events)} events)"), run
    assert lines[-1].startswith("ringtrain-run: rank 1 raised ValueError: rank 1 fails"), run


@pytest.mark.processes
@needs_mpi
def test_after_a_restart_the_trace_is_the_last_starts(tmp_path):
    path = tmp_path / "t.json"
    run = launch("-np", "2", "--max-restarts", "1", "--timeline", str(path), "python", "-c",
                 PROGRAM, "fail", timeout=E2E_TIMEOUT)
    assert run.returncode == 0, run
    assert "restarting with 2 ranks (restart 1 of 1)" in run.stderr, run
    events = assert_job_trace(path, 2, restart=1)
    assert run.stderr.splitlines()[-1] == (f"ringtrain-run: timeline of 2 ranks written to "
                                           f"{path} ({len(events)} events)"), run


@pytest.mark.processes
@needs_mpi
@pytest.mark.parametrize("variable, ending", [("RINGTRAIN_TIMELINE", "exit"),
                                              ("HOROVOD_TIMELINE", "shutdown")])
def test_a_plain_mpiexec_job_writes_one_trace_at_the_named_path(tmp_path, variable, ending):
    """Rank 0 merges the ranks' files when ringtrain shuts down or the process exits."""
    from mpi_launch import run_mpi

    path = tmp_path / "trace.json"
    run_mpi("timeline_job", 3, ending, env={variable: str(path)}, timeout=E2E_TIMEOUT)
    events = load(path)
    assert {event["pid"] for event in events} == {0, 1, 2}
    assert {event["name"] for event in phases(events)} >= {"allreduce", "broadcast"}
    assert sorted(os.listdir(tmp_path)) == ["trace.json"]
