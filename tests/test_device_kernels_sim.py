"""The device kernels' tests (tests/device/), run in pytest processes of their own.

numba chooses its CUDA simulator when it is first imported, so ``NUMBA_ENABLE_CUDASIM=1``
cannot be turned on inside this process. Under the simulator the device twins run their
kernels' Python source on the CPU and must match the host twins; where there is a GPU they
run on it too. Without either the folder skips, unless ``RINGTRAIN_TEST_GPU=1`` demands a
real GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300
SWITCHES = ("NUMBA_ENABLE_CUDASIM", "RINGTRAIN_TEST_GPU", "CUDA_VISIBLE_DEVICES")


def run_device_tests(**environment: str) -> tuple[int, str, dict[str, int]]:
    """Run tests/device with ``environment`` over this one (less the switches above).

    Returns:
        The exit status, the output, and the counts of pytest's closing line.
    """
    env = {name: value for name, value in os.environ.items() if name not in SWITCHES}
    env.update(environment)
    command = [sys.executable, "-m", "pytest", "tests/device", "-q", "-p", "no:cacheprovider",
               "-rfEs"]
    try:
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        output = error.stdout or b""
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        pytest.fail(f"{' '.join(command)} ran past {TIMEOUT_S} s:\n{output}")
    output = result.stdout + result.stderr
    closing = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {word: int(number) for number, word in
              re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", closing)}
    if "error" in counts:
        counts["errors"] = counts.pop("error")
    return result.returncode, output, counts


def test_device_kernels_match_the_host_twins_under_the_simulator():
    status, output, counts = run_device_tests(NUMBA_ENABLE_CUDASIM="1")
    assert status == 0, output
    assert counts.get("passed", 0) >= 50, output
    assert not counts.get("failed") and not counts.get("errors"), output
    skipped = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == counts.get("skipped", 0), output
    assert skipped and all("needs a real GPU: the simulator" in line for line in skipped), \
        output


def test_device_kernels_match_the_host_twins_on_a_gpu():
    status, output, counts = run_device_tests()
    if set(counts) == {"skipped"}:
        reason = re.search(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", output, re.MULTILINE)
        pytest.skip(reason.group(1) if reason else "no CUDA GPU")
    assert status == 0, output
    assert counts.get("passed", 0) >= 50 and set(counts) == {"passed"}, output


def test_without_a_gpu_the_device_tests_skip():
    status, output, counts = run_device_tests(CUDA_VISIBLE_DEVICES="")
    assert status == 0, output
    assert counts.get("skipped", 0) >= 50 and set(counts) == {"skipped"}, output
    assert "no CUDA GPU" in output, output


@pytest.mark.parametrize("simulator", [False, True], ids=["no-gpu", "simulator"])
def test_a_required_gpu_that_is_missing_fails(simulator):
    environment = {"RINGTRAIN_TEST_GPU": "1", "CUDA_VISIBLE_DEVICES": ""}
    if simulator:
        environment["NUMBA_ENABLE_CUDASIM"] = "1"
    status, output, counts = run_device_tests(**environment)
    assert status == 1, output
    assert counts.get("errors", 0) >= 50, output
    assert not counts.get("passed") and not counts.get("skipped"), output
    assert "RINGTRAIN_TEST_GPU=1 requires a real CUDA GPU" in output, output
