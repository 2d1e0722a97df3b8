"""ringtrain.elastic and the launcher's restart options without MPI: State's attributes
and snapshots, the atomic write, option parsing, host discovery and restart decisions."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from ringtrain.elastic import (CHECKPOINT_NAME, ELASTIC_DIR_VARIABLE, RESTART_COUNT_VARIABLE, State,
                               restart_count, write_atomically)
from ringtrain.launcher import restart as restart_module
from ringtrain.launcher.cli import CommandLineError, build_parser, elastic_options
from ringtrain.launcher.hosts import Host
from ringtrain.launcher.job import JobResult
from ringtrain.launcher.report import RankExit
from ringtrain.launcher.host_watch import HostWatcher
from ringtrain.launcher.restart import (Blacklist, DiscoveryError, ElasticOptions, NotEnoughRanks,
                                        Placement, describe_failure, discover_hosts,
                                        parse_discovered_hosts, place_on_discovered_hosts,
                                        resize_announcement, restart_announcement, should_restart)
from test_launcher_argv import run_cli


class Scaler:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def state_dict(self) -> dict:
        return {"factor": self.factor}

    def load_state_dict(self, saved: dict) -> None:
        self.factor = saved["factor"]


# --------------------------------------------------------------------------- State

def test_state_attributes(tmp_path):
    state = State(directory=str(tmp_path), epoch=0, step=0)
    state.epoch = 3
    state.loss = 0.5
    assert (state.epoch, state.step, state.loss) == (3, 0, 0.5)
    assert state.checkpoint_path == str(tmp_path / CHECKPOINT_NAME)
    with pytest.raises(AttributeError, match="no value 'missing'"):
        state.missing
    with pytest.raises(AttributeError, match="cannot start with '_'"):
        state._hidden = 1
    assert repr(state) == "State(epoch, loss, step)"


def test_state_directory_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(ELASTIC_DIR_VARIABLE, str(tmp_path))
    assert State().checkpoint_path == str(tmp_path / CHECKPOINT_NAME)
    assert State(directory="elsewhere").checkpoint_path == os.path.join("elsewhere",
                                                                        CHECKPOINT_NAME)
    monkeypatch.delenv(ELASTIC_DIR_VARIABLE)
    assert State().checkpoint_path is None


def test_snapshot_round_trip_uses_state_dict_and_copies_values():
    scaler = Scaler(2.0)
    state = State(epoch=1, weights=np.arange(3.0), scaler=scaler)
    snapshot = state.snapshot()
    assert snapshot["values"]["scaler"] == ("state_dict", {"factor": 2.0})
    other_scaler = Scaler(0.0)
    other = State(epoch=0, weights=np.zeros(3), scaler=other_scaler)
    other.load_snapshot(snapshot)
    assert other.epoch == 1 and np.array_equal(other.weights, [0.0, 1.0, 2.0])
    assert other.scaler is other_scaler and other_scaler.factor == 2.0


def test_restart_count(monkeypatch):
    monkeypatch.delenv(RESTART_COUNT_VARIABLE, raising=False)
    assert restart_count() == 0
    monkeypatch.setenv(RESTART_COUNT_VARIABLE, "2")
    assert restart_count() == 2


def test_the_launcher_and_the_ranks_name_the_same_variables():
    assert restart_module.ELASTIC_DIR_VARIABLE == ELASTIC_DIR_VARIABLE
    assert restart_module.RESTART_COUNT_VARIABLE == RESTART_COUNT_VARIABLE


@pytest.mark.processes
@pytest.mark.parametrize("statement", ["import ringtrain.elastic as elastic",
                                       "from ringtrain import elastic"])
def test_importing_ringtrain_elastic_does_not_import_mpi4py(tmp_path, statement):
    probe = (f"import sys\n{statement}\n"
             "print(elastic.State.__module__, sorted(m for m in sys.modules "
             "if m.startswith('mpi4py')))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ringtrain.trainer.elastic []"


# --------------------------------------------------------------------------- atomic write

def test_write_atomically_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "state.pkl"
    write_atomically(str(path), b"first")
    inode = path.stat().st_ino
    write_atomically(str(path), b"second")
    assert path.read_bytes() == b"second"
    assert path.stat().st_ino != inode
    assert os.listdir(tmp_path) == ["state.pkl"]


def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "state.pkl"
    write_atomically(str(path), b"committed")

    def failing_replace(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        write_atomically(str(path), b"never seen")
    assert path.read_bytes() == b"committed"
    assert os.listdir(tmp_path) == ["state.pkl"]


# --------------------------------------------------------------------------- options

def _options(*arguments: str) -> ElasticOptions:
    return elastic_options(build_parser().parse_args([*arguments, "python", "t.py"]))


def test_elastic_options_defaults_and_values(tmp_path):
    assert _options("-np", "2") == ElasticOptions(0, 1, None, None)
    assert _options("-np", "2", "--max-restarts", "3", "--min-np", "2", "--max-np", "4") \
        == ElasticOptions(3, 2, 4, None)
    script = tmp_path / "discover"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    assert _options("--host-discovery-script", str(script)) == ElasticOptions(
        0, 1, None, str(script))
    assert _options("-np", "3", "--host-discovery-script", str(script)).max_np == 3
    assert _options("-np", "2", "--discovery-interval", "0.5",
                    "--blacklist-cooldown-range", "5", "60") == ElasticOptions(
        0, 1, None, None, 0.5, (5.0, 60.0))


@pytest.mark.parametrize("arguments, message", [
    (["-np", "2", "--max-restarts", "-1"], "--max-restarts must be 0 or more, got -1"),
    (["-np", "2", "--min-np", "0"], "--min-np must be a positive number of ranks, got 0"),
    (["-np", "2", "--max-np", "0"], "--max-np must be a positive number of ranks, got 0"),
    (["-np", "2", "--min-np", "3", "--max-np", "2"], "--min-np 3 is more than --max-np 2"),
    (["-np", "1", "--min-np", "2"], "-np 1 is less than --min-np 2"),
    (["-np", "3", "--max-np", "2"], "-np 3 is more than --max-np 2"),
    (["--max-restarts", "1"], "-np N is required"),
    (["--host-discovery-script", "/nonexistent/discover"], "is not an executable file"),
    (["-H", "a:2", "--host-discovery-script", "/bin/true"], "give no -H or --hostfile"),
    (["-np", "2", "--discovery-interval", "0"], "--discovery-interval must be a positive"),
    (["-np", "2", "--blacklist-cooldown-range", "9", "3"], "needs 0 <= MIN <= MAX, got 9 3"),
])
def test_bad_elastic_options_are_refused(arguments, message):
    with pytest.raises(CommandLineError, match=re.escape(message)):
        _options(*arguments)


@pytest.mark.processes
def test_a_bad_elastic_option_exits_2_before_anything_starts(tmp_path):
    (tmp_path / "t.py").write_text("print('should not run')\n")
    probe, errors, output = run_cli(["-np", "2", "--max-restarts", "-1", "python", "t.py"],
                                    tmp_path)
    assert probe["code"] == 2 and probe["started"] == [] and probe["modules"] == []
    assert errors == ["ringtrain-run: error: --max-restarts must be 0 or more, got -1"]
    assert output == ""


# --------------------------------------------------------------------------- discovery

def test_parse_discovered_hosts():
    assert parse_discovered_hosts("node1:4\n\n# spare\nnode2:2  # late\nnode3\n") == [
        Host("node1", 4), Host("node2", 2), Host("node3", 1)]
    assert parse_discovered_hosts("") == []
    with pytest.raises(DiscoveryError, match="printed 'node1:x'"):
        parse_discovered_hosts("node1:x\n")


def _script(tmp_path, body: str) -> str:
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


@pytest.mark.processes
def test_discover_hosts_runs_the_script_with_the_restart_count(tmp_path):
    script = _script(tmp_path, 'echo "localhost:$(( RINGTRAIN_RESTART_COUNT + 1 ))"\n')
    assert discover_hosts(script, 0) == [Host("localhost", 1)]
    assert discover_hosts(script, 2) == [Host("localhost", 3)]


@pytest.mark.processes
def test_a_failing_discovery_script_is_an_error(tmp_path):
    with pytest.raises(DiscoveryError, match="exited with code 3: no cluster"):
        discover_hosts(_script(tmp_path, "echo no cluster >&2; exit 3\n"), 0)
    with pytest.raises(DiscoveryError, match="ran for more than 0 s"):
        discover_hosts(_script(tmp_path, "sleep 5\n"), 0, timeout=0.2)


def test_placement_on_discovered_hosts():
    hosts = [Host("a", 2), Host("b", 2)]
    assert place_on_discovered_hosts(hosts, ElasticOptions()) == Placement(4, tuple(hosts))
    assert place_on_discovered_hosts(hosts, ElasticOptions(max_np=3)).nprocs == 3
    with pytest.raises(NotEnoughRanks, match=r"offers 4 slots \(a:2,b:2\), fewer than "
                                             "--min-np 5"):
        place_on_discovered_hosts(hosts, ElasticOptions(min_np=5))
    with pytest.raises(NotEnoughRanks, match=r"offers 0 slots \(no host\)"):
        place_on_discovered_hosts([], ElasticOptions())
    assert place_on_discovered_hosts(hosts, ElasticOptions(max_np=3)) == Placement(
        3, (Host("a", 2), Host("b", 1)))
    assert place_on_discovered_hosts(hosts, ElasticOptions(max_np=2)) == Placement(
        2, (Host("a", 2),))


def test_ranks_fill_the_hosts_in_order():
    placement = Placement(4, (Host("a", 1), Host("b", 3)))
    assert [placement.host_of_rank(r) for r in range(5)] == ["a", "b", "b", "b", None]
    assert Placement(2).host_of_rank(0) is None
    assert placement.describe() == "a:1,b:3" and Placement(1).describe() == "1 rank here"


def test_a_failed_host_cools_down_longer_after_each_failure():
    blacklist = Blacklist((10.0, 25.0))
    hosts = [Host("a", 1), Host("b", 2)]
    assert blacklist.add("b", now=100.0) == 10.0
    assert blacklist.allowed(hosts, 109.0) == [Host("a", 1)]
    assert blacklist.allowed(hosts, 110.0) == hosts
    assert blacklist.add("b", now=200.0) == 20.0
    assert blacklist.add("b", now=300.0) == 25.0
    assert place_on_discovered_hosts(hosts, ElasticOptions(), blacklist, 310.0) == Placement(
        1, (Host("a", 1),))
    assert place_on_discovered_hosts(hosts, ElasticOptions(min_np=2), blacklist,
                                     310.0) == Placement(3, tuple(hosts))


@pytest.mark.processes
def test_the_watcher_writes_the_notice_while_the_hosts_differ(tmp_path):
    offered = tmp_path / "offered"
    offered.write_text("localhost:2\n")
    script = _script(tmp_path, f"cat {offered}\n")
    options = ElasticOptions(min_np=2, discovery_script=script)
    running = Placement(2, (Host("localhost", 2),))
    watcher = HostWatcher(options, Blacklist((10.0, 10.0)), running, str(tmp_path), 0)
    notice = tmp_path / "hosts-updated"
    watcher.poll()
    assert not notice.exists() and watcher.changed is None
    offered.write_text("localhost:2\nother:1\n")
    watcher.poll()
    assert notice.read_text() == "localhost:2,other:1\n"
    assert watcher.changed == Placement(3, (Host("localhost", 2), Host("other", 1)))
    offered.write_text("localhost:1\n")  # fewer than --min-np: the job keeps its ranks
    watcher.poll()
    assert notice.exists() and watcher.changed.nprocs == 3
    offered.write_text("localhost:2\n")
    watcher.poll()
    assert not notice.exists() and watcher.changed is None
    offered.write_text("localhost:3\n")
    polling = HostWatcher(dataclasses.replace(options, discovery_interval=0.05),
                          Blacklist((10.0, 10.0)), running, str(tmp_path), 0).start()
    deadline = time.monotonic() + 10
    while not notice.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert polling.stop() == Placement(3, (Host("localhost", 3),))


def test_resize_announcement():
    assert resize_announcement(Placement(2, (Host("localhost", 2),)),
                               Placement(3, (Host("localhost", 3),))) == (
        "the hosts changed (localhost:2 -> localhost:3): resuming from the last commit with "
        "3 ranks")


# --------------------------------------------------------------------------- decisions

KILLED = JobResult(137, "rank 1 was killed by signal 9 (SIGKILL); the job was stopped "
                        "(exit code 137)", RankExit(1, -9))


@pytest.mark.parametrize("result, restarts_done, max_restarts, expected", [
    (KILLED, 0, 1, True),
    (KILLED, 1, 1, False),
    (KILLED, 0, 0, False),
    (JobResult(0, None), 0, 3, False),
    (JobResult(130, "the job was stopped by SIGINT", None, 2), 0, 3, False),
    (JobResult(1, "mpiexec exited with code 1"), 0, 3, True),
])
def test_should_restart(result, restarts_done, max_restarts, expected):
    options = ElasticOptions(max_restarts=max_restarts)
    assert should_restart(result, restarts_done, options) is expected


def test_restart_announcement():
    options = ElasticOptions(max_restarts=3)
    assert restart_announcement(KILLED, Placement(2), 1, options) == (
        "rank 1 failed (was killed by signal 9 (SIGKILL)); restarting with 2 ranks "
        "(restart 1 of 3)")
    raised = JobResult(1, "...", RankExit(0, 1, "ValueError: bad batch"))
    assert restart_announcement(raised, Placement(1), 2, options) == (
        "rank 0 failed (raised ValueError: bad batch and exited with code 1); restarting "
        "with 1 rank (restart 2 of 3)")
    assert describe_failure(JobResult(1, "mpiexec exited with code 1")) == (
        "the job failed (mpiexec exited with code 1)")
