"""horovodrun's flags and HOROVOD_* variables on ringtrain: each one mapped, accepted
without effect, or refused, as docs/horovod.md's table says; no MPI is started."""

from __future__ import annotations

import sys

import pytest

from ringtrain.common import environment
from ringtrain.launcher.cli import CommandLineError, build_parser, horovodrun_flags
from ringtrain.launcher.command import build_mpiexec_argv
from ringtrain.launcher.horovodrun import REFUSED, TAKING_A_VALUE, WITHOUT_EFFECT
from ringtrain.launcher.mpi_vendor import Vendor
from test_launcher_runs import launch, needs_mpi


def flags(*argv: str):
    options = build_parser().parse_args([*argv, "python", "train.py"])
    return options, horovodrun_flags(options)


def test_horovodrun_spellings_of_ringtrain_run_options():
    options, _ = flags("--num-proc", "3", "-hostfile", "hosts.txt",
                       "--timeline-filename", "t.json", "--reset-limit", "2")
    assert (options.nprocs, options.hostfile, options.timeline, options.max_restarts) == \
        (3, "hosts.txt", "t.json", 2)
    with pytest.raises(CommandLineError, match="--reset-limit and --max-restarts"):
        flags("-np", "2", "--reset-limit", "2", "--max-restarts", "1")


def test_flags_that_set_ringtrain_variables_for_the_ranks():
    _, translation = flags("-np", "2", "--fusion-threshold-mb", "32", "--log-level", "trace",
                           "--stall-check-warning-time-seconds", "30",
                           "--stall-check-shutdown-time-seconds", "90",
                           "--hierarchical-allreduce", "--hierarchical-allgather")
    assert translation.environment == {
        "RINGTRAIN_FUSION_THRESHOLD": str(32 << 20), "RINGTRAIN_LOG_LEVEL": "DEBUG",
        "RINGTRAIN_STALL_CHECK_SECONDS": "30.0", "RINGTRAIN_STALL_SHUTDOWN_SECONDS": "90.0",
        "RINGTRAIN_ALLREDUCE_ALGORITHM": "hierarchical",
        "RINGTRAIN_ALLGATHER_ALGORITHM": "hierarchical"}
    _, translation = flags("-np", "2", "--no-stall-check", "--log-level", "FATAL")
    assert translation.environment == {"RINGTRAIN_STALL_CHECK_SECONDS": "0",
                                       "RINGTRAIN_LOG_LEVEL": "CRITICAL"}
    with pytest.raises(CommandLineError, match="--log-level 'loud'"):
        flags("-np", "2", "--log-level", "loud")


@pytest.mark.parametrize("vendor, expected", [
    (Vendor.MPICH, ["-iface", "eth1"]),
    (Vendor.INTEL_MPI, ["-iface", "eth1"]),
    (Vendor.OPEN_MPI, ["--mca", "btl_tcp_if_include", "eth1", "--mca", "oob_tcp_if_include",
                       "eth1"]),
])
def test_network_interface_and_mpi_args_reach_mpiexec(vendor, expected):
    _, translation = flags("-np", "2", "--network-interface", "eth1",
                           "--mpi-args", "-verbose --foo 'a b'")
    argv = build_mpiexec_argv(vendor, "mpiexec", 2, ["python", "train.py"],
                              network_interface=translation.network_interface,
                              extra_options=translation.mpiexec_args)
    assert argv[-5:] == ["-verbose", "--foo", "a b", "python", "train.py"]
    start = argv.index(expected[0])
    assert argv[start:start + len(expected)] == expected


def test_flags_without_effect_are_accepted_and_said_once_each(capsys):
    argv = []
    for flag in WITHOUT_EFFECT:
        argv += [flag, "5"] if flag in TAKING_A_VALUE else [flag]
    _, translation = flags("-np", "2", *argv)
    assert translation.environment == {}
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"ringtrain-run: {flag} has no effect: {why}"
                     for flag, why in WITHOUT_EFFECT.items()]


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_flags_say_why(flag):
    with pytest.raises(CommandLineError, match=f"{flag} is not supported: {REFUSED[flag]}"):
        flags("-np", "2", flag)


def test_short_ssh_flags_are_refused_too():
    with pytest.raises(CommandLineError, match="--ssh-port is not supported"):
        flags("-np", "2", "-p", "2222")


HOROVOD_TWINS = [
    ("HOROVOD_FUSION_THRESHOLD", "1048576", environment.FUSION_THRESHOLD, 1 << 20),
    ("HOROVOD_TIMELINE", "/tmp/t.json", environment.TIMELINE, "/tmp/t.json"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "12", environment.STALL_CHECK_SECONDS, 12.0),
    ("HOROVOD_STALL_CHECK_DISABLE", "1", environment.STALL_CHECK_SECONDS, 0.0),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "40", environment.STALL_SHUTDOWN_SECONDS, 40.0),
    ("HOROVOD_LOG_LEVEL", "trace", environment.LOG_LEVEL, "DEBUG"),
    ("HOROVOD_LOG_LEVEL", "warning", environment.LOG_LEVEL, "WARNING"),
    ("HOROVOD_HIERARCHICAL_ALLREDUCE", "1", environment.ALLREDUCE_ALGORITHM, "hierarchical"),
    ("HOROVOD_HIERARCHICAL_ALLGATHER", "1", environment.ALLGATHER_ALGORITHM, "hierarchical"),
]


@pytest.mark.parametrize("twin, text, variable, value", HOROVOD_TWINS,
                         ids=[f"{t[0]}={t[1]}" for t in HOROVOD_TWINS])
def test_horovod_variables_are_read_when_ringtrain_s_are_unset(twin, text, variable, value):
    assert variable.read({twin: text}) == value
    assert f"{twin}={text!r} read as {variable.name}=" in \
        " ".join(environment.horovod_lines({twin: text}))
    own = {"RINGTRAIN_FUSION_THRESHOLD": "2048", "RINGTRAIN_TIMELINE": "/tmp/own.json",
           "RINGTRAIN_STALL_CHECK_SECONDS": "7", "RINGTRAIN_STALL_SHUTDOWN_SECONDS": "8",
           "RINGTRAIN_LOG_LEVEL": "ERROR", "RINGTRAIN_ALLREDUCE_ALGORITHM": "ring",
           "RINGTRAIN_ALLGATHER_ALGORITHM": "ring"}[variable.name]
    assert variable.read({twin: text, variable.name: own}) == variable.parse(own)


def test_horovod_switches_that_are_off_and_variables_without_effect():
    assert environment.ALLREDUCE_ALGORITHM.read({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}) == "auto"
    assert environment.STALL_CHECK_SECONDS.read({"HOROVOD_STALL_CHECK_DISABLE": "0"}) == 60.0
    lines = environment.horovod_variables_without_effect({"HOROVOD_CYCLE_TIME": "5",
                                                         "HOROVOD_CACHE_CAPACITY": "0"})
    assert lines == ["HOROVOD_CYCLE_TIME has no effect: calls start when they are made: "
                     "there is no cycle",
                     "HOROVOD_CACHE_CAPACITY has no effect: calls are planned once and kept; "
                     "there is no response cache"]


@pytest.mark.processes
@needs_mpi
def test_a_horovod_command_line_and_variables_reach_the_ranks():
    program = ("import ringtrain as rt\n"
               "rt.init()\n"
               "settings = rt.current_settings()\n"
               "print(settings.fusion_threshold, settings.stall_shutdown_seconds, flush=True)\n"
               "rt.shutdown()\n")
    run = launch("--num-proc", "2", "--fusion-threshold-mb", "2", "--cycle-time-ms", "5",
                 "--env", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=90",
                 "--env", "HOROVOD_LOG_LEVEL=info", "--env", "HOROVOD_CACHE_CAPACITY=0",
                 sys.executable, "-c", program, timeout=60)
    assert run.returncode == 0, run
    assert sorted(run.stdout.splitlines()) == ["[0] 2097152 90.0", "[1] 2097152 90.0"], run
    assert run.stderr.count("ringtrain-run: --cycle-time-ms has no effect") == 1, run
    for rank in (0, 1):
        assert f"r{rank} | INFO | HOROVOD_STALL_SHUTDOWN_TIME_SECONDS='90' read as " \
               f"RINGTRAIN_STALL_SHUTDOWN_SECONDS='90'" in run.stderr, run
        assert f"r{rank} | INFO | HOROVOD_CACHE_CAPACITY has no effect" in run.stderr, run
