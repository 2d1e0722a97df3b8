"""ringtrain-run without MPI: vendor detection, the mpiexec argv of each vendor, host lists,
per-rank defaults, output prefixes and records, and bad input refused before anything
starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ringtrain.launcher import command as command_module
from ringtrain.common import excepthook
from ringtrain.launcher import rank_env
from ringtrain.launcher.cli import CommandLineError, kvstore_servers, parse_environment
from ringtrain.launcher.command import (PYTHON_RUNNER_MODULE, SUPERVISOR_MODULE, CommandError,
                                        build_mpiexec_argv, python_target, rank_command,
                                        wrap_python_command)
from ringtrain.launcher.hosts import Host, HostListError, parse_host_list, read_hostfile
from ringtrain.launcher.mpi_vendor import Vendor, detect_vendor, vendor_version
from ringtrain.launcher.rank_env import rank_defaults
from ringtrain.common.rank_identity import RankIdentity, rank_identity
from ringtrain.launcher.report import RankExit, decode, describe, encode
from ringtrain.launcher.streams import LinePrefixer, RecordFilter

MPICH_VERSION = """HYDRA build details:
    Version:                                 4.1.2
    Release Date:                            Wed Jun  7 15:22:45 CDT 2023
    Process Manager:                         pmi
"""
OPEN_MPI_4_VERSION = ("mpirun (Open MPI) 4.1.5\n\n"
                      "Report bugs to http://www.open-mpi.org/community/help/\n")
OPEN_MPI_5_VERSION = ("mpiexec (Open MPI) 5.0.3\n\n"
                      "Report bugs to https://www.open-mpi.org/community/help/\n")
INTEL_VERSION = ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 "
                 "(id: c2e19c2f3e)\nCopyright 2003-2023, Intel Corporation.\n")
RANK = ["python3", "-m", SUPERVISOR_MODULE, "--", "python", "-m", PYTHON_RUNNER_MODULE,
        "train.py"]


# --------------------------------------------------------------------------- vendors

@pytest.mark.parametrize("text, vendor, version", [
    (MPICH_VERSION, Vendor.MPICH, "4.1.2"),
    (OPEN_MPI_4_VERSION, Vendor.OPEN_MPI, "4.1.5"),
    (OPEN_MPI_5_VERSION, Vendor.OPEN_MPI, "5.0.3"),
    ("mpirun (OpenRTE) 3.1.6\n", Vendor.OPEN_MPI, "3.1.6"),
    (INTEL_VERSION, Vendor.INTEL_MPI, "2021.10"),
])
def test_vendor_and_version_from_mpiexec_version(text, vendor, version):
    assert detect_vendor(text) is vendor
    assert vendor_version(vendor, text) == version


def test_an_unknown_mpiexec_has_no_vendor():
    assert detect_vendor("slurm 23.02.4\n") is None


# --------------------------------------------------------------------------- argv per vendor

def test_mpich_argv():
    argv = build_mpiexec_argv(Vendor.MPICH, "/venv/bin/mpiexec", 4, RANK, local_cores=2)
    assert argv == ["/venv/bin/mpiexec", "-n", "4", "-bind-to", "none", *RANK]


def test_open_mpi_argv_oversubscribes_only_past_the_cores():
    argv = build_mpiexec_argv(Vendor.OPEN_MPI, "mpiexec", 2, RANK, local_cores=2)
    assert argv == ["mpiexec", "-n", "2", "--bind-to", "none", *RANK]
    argv = build_mpiexec_argv(Vendor.OPEN_MPI, "mpiexec", 3, RANK, local_cores=2)
    assert argv == ["mpiexec", "-n", "3", "--bind-to", "none", "--oversubscribe", *RANK]


def test_intel_mpi_argv_turns_pinning_off():
    argv = build_mpiexec_argv(Vendor.INTEL_MPI, "mpiexec", 2, RANK, local_cores=8)
    assert argv == ["mpiexec", "-n", "2", "-genv", "I_MPI_PIN", "off", *RANK]
    argv = build_mpiexec_argv(Vendor.INTEL_MPI, "mpiexec", 2, RANK,
                              environment={"I_MPI_PIN": "on"})
    assert argv == ["mpiexec", "-n", "2", "-genv", "I_MPI_PIN", "on", *RANK]


HOSTS = [Host("node1", 2), Host("node2", 2)]


@pytest.mark.parametrize("vendor, expected", [
    (Vendor.MPICH, ["-hosts", "node1:2,node2:2"]),
    (Vendor.OPEN_MPI, ["-H", "node1:2,node2:2"]),
    (Vendor.INTEL_MPI, ["-hosts", "node1,node2", "-ppn", "2"]),
])
def test_hosts_per_vendor(vendor, expected):
    argv = build_mpiexec_argv(vendor, "mpiexec", 4, RANK, hosts=HOSTS, local_cores=1)
    assert argv[3:3 + len(expected)] == expected
    # Four ranks on four slots: no oversubscription, though this machine has one core.
    assert "--oversubscribe" not in argv


def test_open_mpi_oversubscribes_past_the_slots_of_the_hosts():
    argv = build_mpiexec_argv(Vendor.OPEN_MPI, "mpiexec", 5, RANK, hosts=HOSTS, local_cores=64)
    assert "--oversubscribe" in argv


def test_intel_mpi_refuses_hosts_with_different_slot_counts():
    with pytest.raises(CommandError, match="same count"):
        build_mpiexec_argv(Vendor.INTEL_MPI, "mpiexec", 3, RANK,
                           hosts=[Host("a", 2), Host("b", 1)])


@pytest.mark.parametrize("vendor, expected", [
    (Vendor.MPICH, ["-genv", "NCCL_DEBUG", "INFO", "-genv", "EMPTY", ""]),
    (Vendor.OPEN_MPI, ["-x", "NCCL_DEBUG=INFO", "-x", "EMPTY="]),
    (Vendor.INTEL_MPI, ["-genv", "NCCL_DEBUG", "INFO", "-genv", "EMPTY", ""]),
])
def test_environment_per_vendor(vendor, expected):
    argv = build_mpiexec_argv(vendor, "mpiexec", 2, RANK,
                              environment={"NCCL_DEBUG": "INFO", "EMPTY": ""}, local_cores=2)
    assert argv[3:3 + len(expected)] == expected


@pytest.mark.parametrize("vendor", list(Vendor))
def test_allow_run_as_root_only_for_open_mpi_as_root(vendor):
    as_root = build_mpiexec_argv(vendor, "mpiexec", 2, RANK, local_cores=2, as_root=True)
    as_user = build_mpiexec_argv(vendor, "mpiexec", 2, RANK, local_cores=2, as_root=False)
    assert ("--allow-run-as-root" in as_root) is (vendor is Vendor.OPEN_MPI)
    assert "--allow-run-as-root" not in as_user


@pytest.mark.parametrize("vendor", list(Vendor))
def test_the_rank_command_comes_last_and_unchanged(vendor):
    tricky = ["python", "-c", "print('a b; $HOME')", "--flag", "-n", "3"]
    argv = build_mpiexec_argv(vendor, "mpiexec", 2, tricky, local_cores=2)
    assert argv[-len(tricky):] == tricky
    assert all(isinstance(part, str) for part in argv)


# --------------------------------------------------------------------------- Python commands

@pytest.mark.parametrize("command, wrapped", [
    (["python", "train.py", "--lr", "1"],
     ["python", "-m", PYTHON_RUNNER_MODULE, "train.py", "--lr", "1"]),
    (["python3.11", "-u", "-X", "dev", "train.py"],
     ["python3.11", "-u", "-X", "dev", "-m", PYTHON_RUNNER_MODULE, "train.py"]),
    (["python", "-Wignore", "-c", "print(1)", "x"],
     ["python", "-W", "ignore", "-m", PYTHON_RUNNER_MODULE, "-c", "print(1)", "x"]),
    (["python", "-uc", "print(1)"],
     ["python", "-u", "-m", PYTHON_RUNNER_MODULE, "-c", "print(1)"]),
    (["python", "-m", "pkg.train", "-m", "x"],
     ["python", "-m", PYTHON_RUNNER_MODULE, "-m", "pkg.train", "-m", "x"]),
    (["python", "-mpkg"], ["python", "-m", PYTHON_RUNNER_MODULE, "-m", "pkg"]),
    (["python", "--check-hash-based-pycs", "never", "t.py"],
     ["python", "--check-hash-based-pycs", "never", "-m", PYTHON_RUNNER_MODULE, "t.py"]),
    (["/usr/bin/python3", "--", "t.py"], ["/usr/bin/python3", "-m", PYTHON_RUNNER_MODULE, "t.py"]),
])
def test_python_commands_run_under_the_runner(command, wrapped):
    assert wrap_python_command(command) == wrapped


@pytest.mark.parametrize("command", [
    ["./train.sh", "a"], ["bash", "-c", "python x.py"], ["python"], ["python", "-"],
    ["python", "-V"], ["python", "-i"], ["python", "--unknown-option", "x.py"],
    ["python", "-c"], ["pythonista", "x.py"],
])
def test_other_commands_are_left_as_they_are(command):
    assert wrap_python_command(command) == command


def test_this_interpreter_by_path_counts_as_python():
    assert wrap_python_command([sys.executable, "t.py"])[1:3] == ["-m", PYTHON_RUNNER_MODULE]


def test_python_target():
    assert python_target(["python", "-u", "t.py", "a"]) == ["t.py", "a"]
    assert python_target(["python", "-c", "x"]) == ["-c", "x"]
    assert python_target(["./t.sh"]) is None


def test_every_rank_runs_the_supervisor():
    assert rank_command(["python", "t.py"], python="/venv/bin/python") == [
        "/venv/bin/python", "-m", SUPERVISOR_MODULE, "--",
        "python", "-m", PYTHON_RUNNER_MODULE, "t.py"]


# --------------------------------------------------------------------------- hosts

def test_host_list():
    assert parse_host_list("node1:2,node2:4") == [Host("node1", 2), Host("node2", 4)]
    assert parse_host_list("node1, 10.0.0.2") == [Host("node1", 1), Host("10.0.0.2", 1)]


@pytest.mark.parametrize("text", ["", ",", "a,,b", "a:", "a:0", "a:-1", "a:two", "a:1:2",
                                  "a b", "-a", "a;b"])
def test_malformed_host_lists(text):
    with pytest.raises(HostListError, match="malformed host list"):
        parse_host_list(text)


def test_hostfile_formats(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\nnode1\nnode2:4\n\nnode3 slots=8  # fast ones\n"
                    "node4 slots=2 max_slots=4\n")
    assert read_hostfile(str(path)) == [Host("node1", 1), Host("node2", 4), Host("node3", 8),
                                        Host("node4", 2)]


@pytest.mark.parametrize("text, problem", [
    ("node1 cores=4\n", "line 1"), ("node1\nnode2:x\n", "line 2"), ("# nothing\n", "no host"),
    ("node1 slots=0\n", "positive integer"),
])
def test_malformed_hostfiles(tmp_path, text, problem):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(HostListError, match=problem):
        read_hostfile(str(path))


def test_missing_hostfile():
    with pytest.raises(HostListError, match="cannot read host file"):
        read_hostfile("/nonexistent/hosts")


# --------------------------------------------------------------------------- --env

def test_environment_assignments(monkeypatch):
    monkeypatch.setenv("RINGTRAIN_LAUNCHER_TEST", "from here")
    assert parse_environment(["A=1", "B=x=y", "C=", "RINGTRAIN_LAUNCHER_TEST"]) == {
        "A": "1", "B": "x=y", "C": "", "RINGTRAIN_LAUNCHER_TEST": "from here"}


@pytest.mark.parametrize("assignment", ["1A=2", "=x", "A-B=1", "RINGTRAIN_SURELY_UNSET_VAR"])
def test_bad_environment_assignments(assignment, monkeypatch):
    monkeypatch.delenv("RINGTRAIN_SURELY_UNSET_VAR", raising=False)
    with pytest.raises(CommandLineError):
        parse_environment([assignment])


def test_servers_set_the_variable_the_kvstore_reads():
    environment: dict[str, str] = {}
    kvstore_servers(2, 5, environment)
    assert environment == {"RINGTRAIN_KV_SERVERS": "2"}
    kvstore_servers(None, 5, environment := {})
    assert environment == {}


@pytest.mark.parametrize("servers,nprocs", [(0, 4), (4, 4), (-1, None)])
def test_bad_server_counts(servers, nprocs):
    with pytest.raises(CommandLineError, match="--servers"):
        kvstore_servers(servers, nprocs, {})


# --------------------------------------------------------------------------- per-rank defaults

def test_rank_identity_from_hydra_and_open_mpi():
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert rank_identity(hydra) == RankIdentity(3, 4, 1, 2)
    open_mpi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert rank_identity(open_mpi) == RankIdentity(5, 8, 1, 4)
    unknown = rank_identity({})
    assert unknown == RankIdentity(None, None, 0, 1) and unknown.label == "?"


@pytest.mark.parametrize("cores, local_size, threads",
                         [(16, 4, "4"), (16, 3, "5"), (2, 4, "1"), (1, 1, "1")])
def test_omp_num_threads_shares_the_cores(cores, local_size, threads):
    defaults = rank_defaults({}, RankIdentity(0, local_size, 0, local_size), cores, 0)
    assert defaults["OMP_NUM_THREADS"] == threads


def test_variables_the_user_set_are_kept():
    environ = {"OMP_NUM_THREADS": "7", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "",
               "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert rank_defaults(environ, RankIdentity(1, 2, 1, 2), 16, 4) == {}


def test_torchruns_variables_from_the_mpis():
    defaults = rank_defaults({}, RankIdentity(5, 8, 1, 4), 16, 0)
    assert {name: defaults[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                              "LOCAL_WORLD_SIZE")} == \
        {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert "RANK" not in rank_defaults({}, RankIdentity(None, None), 16, 0)


def test_torchruns_rendezvous_address_and_port():
    here = rank_env.torch_rendezvous(None, {})
    assert here["MASTER_ADDR"] == "127.0.0.1" and 0 < int(here["MASTER_PORT"]) < 65536
    elsewhere = rank_env.torch_rendezvous("node7", {})
    assert elsewhere == {"MASTER_ADDR": "node7",
                         "MASTER_PORT": str(rank_env.TORCHRUN_DEFAULT_PORT)}
    assert rank_env.torch_rendezvous("node7", {"MASTER_PORT": "1234"}) == \
        {"MASTER_ADDR": "node7"}
    assert rank_env.torch_rendezvous(None, {"MASTER_ADDR": "a", "MASTER_PORT": "1"}) == {}


def test_one_gpu_per_rank_by_local_rank():
    gpus = [rank_defaults({}, RankIdentity(rank, 8, rank % 4, 4), 32, 4)["CUDA_VISIBLE_DEVICES"]
            for rank in range(8)]
    assert gpus == ["0", "1", "2", "3", "0", "1", "2", "3"]
    more_ranks_than_gpus = rank_defaults({}, RankIdentity(3, 4, 3, 4), 32, 2)
    assert more_ranks_than_gpus["CUDA_VISIBLE_DEVICES"] == "1"


def test_no_gpu_no_cuda_visible_devices():
    assert "CUDA_VISIBLE_DEVICES" not in rank_defaults({}, RankIdentity(0, 2, 0, 2), 8, 0)


def test_gpus_are_found_in_the_driver_folder(tmp_path, monkeypatch):
    for index, model in enumerate(["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"]):
        folder = tmp_path / f"0000:0{index}:00.0"
        folder.mkdir()
        (folder / "information").write_text(f"Model: \t\t {model}\nIRQ:   42\n")
    monkeypatch.setattr(rank_env, "NVIDIA_GPUS_DIRECTORY", str(tmp_path))
    assert rank_env.nvidia_gpus() == ["NVIDIA H100 80GB HBM3"] * 2


def test_no_driver_and_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_env, "NVIDIA_GPUS_DIRECTORY", str(tmp_path / "absent"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert rank_env.nvidia_gpus() == []


@pytest.mark.processes
def test_nvidia_smi_is_asked_when_the_driver_folder_is_missing(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-1234)'\n"
                   "echo 'GPU 1: NVIDIA H200 (UUID: GPU-5678)'\n")
    smi.chmod(0o755)
    monkeypatch.setattr(rank_env, "NVIDIA_GPUS_DIRECTORY", str(tmp_path / "absent"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert rank_env.nvidia_gpus() == ["NVIDIA H200", "NVIDIA H200"]


# --------------------------------------------------------------------------- streams, records

def test_line_prefixer_passes_whole_lines_with_the_prefix():
    prefixer = LinePrefixer(b"[1] ")
    chunks = [b"one\ntw", b"o\n", b"\n", b"50%\r100%\r\n", b"crlf split\r", b"\n", b"tail"]
    assert [prefixer.feed(chunk) for chunk in chunks] == [
        b"[1] one\n", b"[1] two\n", b"[1] \n", b"[1] 50%\r[1] 100%\r\n", b"[1] crlf split\r",
        b"\n", b""]
    assert not prefixer.at_line_start
    assert prefixer.flush() == b"[1] tail" and prefixer.flush() == b""


def test_a_line_written_in_parts_comes_out_whole():
    prefixer = LinePrefixer(b"[0] ")
    assert [prefixer.feed(part) for part in [b"sum", b" ", b"0", b"\n"]] == [
        b"", b"", b"", b"[0] sum 0\n"]
    assert prefixer.at_line_start


def test_a_flushed_prompt_is_continued_without_a_second_prefix():
    prefixer = LinePrefixer(b"[0] ")
    assert prefixer.feed(b"Continue? ") == b""
    assert prefixer.flush() == b"[0] Continue? "
    assert not prefixer.at_line_start
    assert prefixer.feed(b"yes\nnext\n") == b"yes\n[0] next\n"
    assert prefixer.at_line_start


def test_records_are_taken_out_of_the_stream_even_when_split():
    record = RankExit(1, -9)
    stream = b"[0] hello\n" + encode(record) + b"[1] bye\npartial"
    for cut in range(len(stream) + 1):
        records = RecordFilter()
        shown_first, found_first = records.feed(stream[:cut])
        shown_rest, found_rest = records.feed(stream[cut:])
        assert shown_first + shown_rest + records.finish() == b"[0] hello\n[1] bye\npartial"
        assert found_first + found_rest == [record]


def test_a_record_tag_inside_a_line_is_text():
    line = b"[0] user printed " + encode(RankExit(0, 0))
    shown, found = RecordFilter().feed(line)
    assert shown == line and found == []


def test_record_round_trip_and_words():
    for record in [RankExit(1, -9), RankExit(0, 3), RankExit(2, 1, "ValueError: bad"),
                   RankExit(None, 0)]:
        assert decode(encode(record)) == record
    assert describe(RankExit(1, -9)) == "rank 1 was killed by signal 9 (SIGKILL)"
    assert RankExit(1, -9).exit_code == 137
    assert describe(RankExit(0, 3)) == "rank 0 exited with code 3"
    assert "raised ValueError: bad" in describe(RankExit(2, 1, "ValueError: bad"))
    assert decode(b"@ringtrain-rank-exit {not json}\n") is None


# --------------------------------------------------------------------------- bad input

# Runs the CLI in a fresh interpreter with process creation recorded: bad input must
# neither import mpi4py nor start any process (mpiexec included).
CLI_PROBE = """
import json, subprocess, sys
started = []
original = subprocess.Popen.__init__
def record(self, args, *rest, **kwargs):
    started.append(list(map(str, args)) if not isinstance(args, str) else [args])
    return original(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = record
from ringtrain.launcher.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exit_request:
    code = exit_request.code
sys.stdout.flush()
print(json.dumps({"code": code, "started": started,
                  "modules": sorted(m for m in sys.modules if m.startswith(
                      ("mpi4py", "ringtrain.collectives", "ringtrain.kernels", "numba")))}),
      file=sys.stderr)
"""


def run_cli(arguments: list[str], cwd: Path) -> tuple[dict, list[str], str]:
    """(probe result, stderr lines before it, stdout) of ``ringtrain-run ARGUMENTS``."""
    result = subprocess.run([sys.executable, "-c", CLI_PROBE, json.dumps(arguments)],
                            cwd=cwd, capture_output=True, text=True, timeout=60)
    lines = result.stderr.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1], result.stdout


BAD_INPUT = [
    (["-np", "2", "--bogus", "python", "t.py"], "unrecognized arguments: --bogus"),
    (["-np", "0", "python", "t.py"], "-np must be a positive number of ranks, got 0"),
    (["-np", "-3", "python", "t.py"], "-np must be a positive number of ranks, got -3"),
    (["-np", "two", "python", "t.py"], "invalid int value: 'two'"),
    (["python", "t.py"], "-np N is required"),
    (["-np", "2"], "no command to run"),
    (["-np", "2", "--"], "no command to run"),
    (["-np", "2", "python", "missing.py"], "python script 'missing.py' not found"),
    (["-np", "2", "no-such-program-anywhere"], "command 'no-such-program-anywhere' not found"),
    (["-np", "2", "-H", "node1:x", "python", "t.py"], "malformed host list 'node1:x'"),
    (["-np", "2", "-H", "a,,b", "python", "t.py"], "malformed host list"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "python", "t.py"],
     "cannot read host file /nonexistent/hosts"),
    (["-np", "2", "-H", "a", "--hostfile", "h", "python", "t.py"], "not allowed with"),
    (["-np", "2", "--env", "1A=2", "python", "t.py"], "expected NAME=VALUE"),
]


@pytest.mark.processes
@pytest.mark.parametrize("arguments, message", BAD_INPUT,
                         ids=[" ".join(arguments) for arguments, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_code_2_without_mpi(arguments, message, tmp_path):
    (tmp_path / "t.py").write_text("print('should not run')\n")
    probe, errors, output = run_cli(arguments, tmp_path)
    assert probe["code"] == 2
    assert len(errors) == 1 and errors[0].startswith("ringtrain-run: error: "), errors
    assert message in errors[0]
    assert probe["started"] == [] and probe["modules"] == []
    assert output == ""


@pytest.mark.processes
def test_help_imports_neither_mpi4py_nor_the_collectives(tmp_path):
    probe, errors, output = run_cli(["--help"], tmp_path)
    assert probe["code"] == 0 and errors == []
    assert "-np N" in output and "--hostfile" in output and "--check-build" in output
    assert probe["started"] == [] and probe["modules"] == []


@pytest.mark.processes
def test_the_console_script_refuses_bad_input():
    script = Path(sys.executable).parent / "ringtrain-run"
    if not script.is_file():
        pytest.skip("the ringtrain-run console script is not installed (pip install -e .)")
    result = subprocess.run([str(script), "-np", "0", "python", "t.py"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "ringtrain-run: error: -np must be a positive number of ranks, got 0\n"


@pytest.mark.processes
def test_python_dash_m_ringtrain_launcher_is_the_same_command():
    result = subprocess.run([sys.executable, "-m", "ringtrain.launcher", "-np", "1"],
                            capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 2
    assert result.stderr.startswith("ringtrain-run: error: no command to run")


@pytest.mark.processes
def test_the_module_reads_the_python_options_of_this_interpreter():
    """Every one-letter option CPython documents is either known or refused (never
    mistaken for a program)."""
    help_text = subprocess.run([sys.executable, "-h"], capture_output=True, text=True,
                               timeout=60).stdout
    letters = {line.split()[0][1] for line in help_text.splitlines()
               if line.startswith("-") and len(line.split()[0]) == 2}
    known = command_module._PYTHON_FLAGS | command_module._PYTHON_OPTIONS_WITH_VALUE | set("cm")
    assert letters - known <= set("hV?"), letters - known


@pytest.mark.processes
def test_no_launcher_module_but_the_probe_imports_mpi4py_or_the_collectives(tmp_path):
    modules = sorted(path.stem for path in (Path(command_module.__file__).parent).glob("*.py")
                     if path.stem not in ("__main__", "build_probe"))
    probe = ("import importlib, json, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module('ringtrain.launcher.' + name)\n"
             "importlib.import_module('ringtrain.common.excepthook')\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith("
             "('mpi4py', 'ringtrain.collectives', 'ringtrain.kernels')))))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
    assert "rank" in modules and "job" in modules and "run_python" in modules


def test_init_keeps_a_hook_the_program_set(monkeypatch):
    """ringtrain.init installs the hook only over Python's own (the runner's, a
    debugger's or the program's stays)."""
    def own_hook(*_):
        pass

    monkeypatch.setattr(sys, "excepthook", own_hook)
    excepthook.install_unless_replaced()
    assert sys.excepthook is own_hook
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    excepthook.install_unless_replaced()
    assert sys.excepthook is excepthook.report_and_stop


def test_an_aborting_rank_waits_until_its_output_in_a_pipe_is_read(tmp_path):
    """Under plain mpiexec a rank's output goes through pipes its proxy reads; the rank
    aborts only once they are read, or the traceback could be lost with the job."""
    reading, writing = os.pipe()
    try:
        os.write(writing, b"the traceback")
        assert excepthook.unread_bytes(writing) == len(b"the traceback")
        reader = threading.Timer(0.2, os.read, (reading, 100))
        reader.start()
        excepthook.wait_until_read((writing,), seconds=30.0)
        assert excepthook.unread_bytes(writing) == 0
        reader.join()
        os.write(writing, b"never read")
        excepthook.wait_until_read((writing,), seconds=0.05)  # gives up, does not hang
        assert excepthook.unread_bytes(writing) == len(b"never read")
    finally:
        os.close(reading)
        os.close(writing)
    with open(tmp_path / "log", "w") as file:
        file.write("not a pipe")
        file.flush()
        assert excepthook.unread_bytes(file.fileno()) == 0
