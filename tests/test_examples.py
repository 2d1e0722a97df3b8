"""The examples run under mpiexec, with tiny sizes, so they never rot."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from mpi_launch import ROOT, run_mpi

# Files starting with "_" are helpers the examples import, not examples. The
# torch.distributed scripts (torch_*.py) run in tests/test_torch_backend.py, each on gloo
# and on ringtrain in one launch, their weights compared.
EXAMPLES = sorted(path.stem for path in (ROOT / "examples").glob("*.py")
                  if not path.name.startswith(("_", "torch_")))

# A few seconds of training at np=3 on two cores; most of a run is starting Python.
TINY = ["--epochs", "3", "--samples", "2048", "--batch-size", "32"]
ARGUMENTS = {"pytorch_mlp": TINY, "numpy_mlp": TINY}

# The most frequent class holds about a fifth of the held-out set; these tiny runs reach
# 0.7 to 0.8, so the thresholds leave room for other seeds, BLAS and rounding.
MIN_ACCURACY = {"pytorch_mlp": 0.5, "numpy_mlp": 0.5}

REQUIRES = {"pytorch_mlp": "torch"}

# Pruned to 80% in the first two of three short epochs (reaches 0.7 to 0.8 here).
ARGUMENTS["pruning"] = TINY
MIN_ACCURACY["pruning"] = 0.5
REQUIRES["pruning"] = "torch"

# A Horovod script whose only change is its import line (reaches 0.7 to 0.8 here too).
ARGUMENTS["horovod_style"] = TINY
MIN_ACCURACY["horovod_style"] = 0.5
REQUIRES["horovod_style"] = "torch"

# Parameter servers: 1 worker + 1 server at np=2, 2 workers + 1 server at np=3.
ARGUMENTS["kvstore_async"] = ["--steps", "40", "--slow-sleep", "0.005"]

# Stages and replicas: 1 × 1, 2 × 1 and 3 × 1 by default, 2 × 2 below (reaches about 0.7).
ARGUMENTS["pipeline_parallel"] = ["--epochs", "2", "--samples", "1024", "--batch-size", "32"]
MIN_ACCURACY["pipeline_parallel"] = 0.5
REQUIRES["pipeline_parallel"] = "torch"


# One rank twice as slow per sample, trained with even shares, then balanced ones.
ARGUMENTS["load_balance"] = TINY + ["--hidden", "64", "--interval", "4"]
MIN_ACCURACY["load_balance"] = 0.5
REQUIRES["load_balance"] = "torch"


# The examples of features whose own test programs run at 1 to 4 ranks: an even and an
# odd number of ranks here (the suite's time matters more than a third run).
NPROCS = {"kvstore_async": [2, 3], "pipeline_parallel": [2, 3], "pruning": [2, 3],
          "load_balance": [2, 3]}

DEFAULT_RUNS = [(example, nprocs, ()) for example in EXAMPLES
                for nprocs in NPROCS.get(example, [1, 2, 3])]
OPTION_RUNS = [
    # One allreduce per gradient, started by mark_ready while backward runs; fp16 on the wire.
    ("numpy_mlp", 3, ("--compression", "fp16", "--fusion-threshold", "0")),
    ("pytorch_mlp", 2, ("--compression", "bf16", "--fusion-threshold", "4096")),
    ("numpy_mlp", 2, ("--progress", "always")),
    ("pipeline_parallel", 4, ("--stages", "2", "--schedule", "gpipe")),
]
HOROVOD_RUNS = [("horovod_style", 2, ("--fp16-allreduce",)),
                ("horovod_style", 3, ("--batches-per-allreduce", "2"))]
KVSTORE_RUNS = [("kvstore_async", 3, ("--mode", "dist_async")),
                ("kvstore_async", 2, ("--mode", "dist_sync"))]
RUNS = DEFAULT_RUNS + OPTION_RUNS + HOROVOD_RUNS + KVSTORE_RUNS
"""Every run of an example the tests make: those of one number of ranks share a launch
(tests/mpi/examples.py), most of a run being the start of its processes."""

_LAUNCHES: dict[int, str] = {}


def _runnable(example: str) -> bool:
    module = REQUIRES.get(example)
    return module is None or importlib.util.find_spec(module) is not None


def _section(output: str, index: int) -> str | None:
    """What run ``index`` of a launch printed, or None where it did not finish."""
    found = re.search(rf"(?s)##### example {index}: [^\n]*#####\n(.*?)"
                      rf"##### end of example {index} #####", output)
    return None if found is None else found.group(1)


def run_example(example: str, nprocs: int, *extra: str) -> str:
    """The output of ``example`` with its tiny ``ARGUMENTS`` and ``extra`` at ``nprocs``
    ranks, run in the launch of every run of :data:`RUNS` at ``nprocs`` ranks."""
    if not _runnable(example):
        pytest.skip(f"{example} needs {REQUIRES[example]}")
    runs = [(name, [*ARGUMENTS.get(name, []), *options])
            for name, ranks, options in RUNS if ranks == nprocs and _runnable(name)]
    if nprocs not in _LAUNCHES:
        _LAUNCHES[nprocs] = run_mpi("examples", nprocs, json.dumps(runs),
                                    timeout=120 * len(runs))
    output = _LAUNCHES[nprocs]
    section = _section(output, runs.index((example, [*ARGUMENTS.get(example, []), *extra])))
    assert section is not None, f"{example} {' '.join(extra)} did not finish:\n{output}"
    assert f"{nprocs} ranks:" in section, section
    if example in MIN_ACCURACY:
        found = re.search(rf"(?<!\d){nprocs} ranks: final accuracy (\d+\.\d+)", section)
        assert found, f"no final accuracy in the output:\n{section}"
        accuracy = float(found.group(1))
        assert accuracy > MIN_ACCURACY[example], \
            f"{example} did not learn: accuracy {accuracy} <= {MIN_ACCURACY[example]}\n{section}"
    return section


@pytest.mark.processes
@pytest.mark.parametrize("example, nprocs", [(e, n) for e, n, _ in DEFAULT_RUNS])
def test_example_runs(example, nprocs):
    run_example(example, nprocs)


@pytest.mark.processes
@pytest.mark.parametrize("example, nprocs, options", OPTION_RUNS)
def test_training_example_options(example, nprocs, options):
    output = run_example(example, nprocs, *options)
    if "--compression" in options:
        assert f"compression {options[options.index('--compression') + 1]}" in output, output
    if "--progress" in options:
        assert "\r" in output and "] " in output, output  # the bar, redrawn in place


@pytest.mark.processes
@pytest.mark.parametrize("nprocs, options", [(n, o) for _, n, o in HOROVOD_RUNS])
def test_horovod_style_example_options(nprocs, options):
    output = run_example("horovod_style", nprocs, *options)
    if "--fp16-allreduce" in options:
        assert "compression fp16" in output, output


@pytest.mark.processes
@pytest.mark.parametrize("nprocs, mode", [(n, o[1]) for _, n, o in KVSTORE_RUNS])
def test_kvstore_example_learns_and_reports_each_worker(nprocs, mode):
    """The loss starts near 64 (the teacher's squared norm); the noise alone gives 0.01."""
    output = run_example("kvstore_async", nprocs, "--mode", mode)
    workers = nprocs - 1 if mode == "dist_async" else nprocs
    for worker in range(workers):
        assert re.search(rf"worker {worker}( \(slow\))?: 40 steps in .* steps/s", output), output
    found = re.search(rf"{nprocs} ranks: final loss (\d+\.\d+) \({mode}", output)
    assert found and float(found.group(1)) < 0.5, output


def test_horovod_style_example_changes_only_the_import():
    source = (ROOT / "examples" / "horovod_style.py").read_text()
    code = source.split('"""', 2)[2]  # after the module docstring
    assert [line for line in code.splitlines() if "ringtrain" in line] == [
        "import ringtrain.horovod as hvd  # was: import horovod.torch as hvd"]


def test_there_are_examples():
    assert EXAMPLES
    assert {"pytorch_mlp", "numpy_mlp"} <= set(EXAMPLES)
    assert set(ARGUMENTS) <= set(EXAMPLES) and set(MIN_ACCURACY) <= set(EXAMPLES)
