"""``ringtrain-run --check-build``: what this installation can run on, without a job.

Versions of installed packages come from their metadata (none of them is imported);
the MPI library's own version, its CUDA-awareness and ringtrain's collectives come from
:mod:`ringtrain.launcher.build_probe` in a subprocess, so this process never starts MPI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import metadata

from .mpi_vendor import MpiexecError, query_mpiexec
from .rank_env import nvidia_gpus

PROBE_MODULE = "ringtrain.launcher.build_probe"
PROBE_TIMEOUT = 120.0
LABEL_WIDTH = 16
LINE_WIDTH = 100


def package_version(*names: str, prefix: str | None = None) -> str:
    """The installed version of the first of ``names`` found (or of a distribution whose
    name starts with ``prefix``, e.g. ``cupy-cuda12x``), else ``"not installed"``."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if prefix is not None:
        for distribution in metadata.distributions():
            name = (distribution.metadata["Name"] or "").lower()
            if name.startswith(prefix):
                return f"{distribution.version} ({name})"
    return "not installed"


def run_probe() -> tuple[dict[str, object], str | None]:
    """What the probe printed, and why it stopped early (None when it finished)."""
    command = [sys.executable, "-m", PROBE_MODULE]
    try:
        result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, errors="replace", timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired as expired:
        output, problem = expired.stdout or "", f"no answer within {PROBE_TIMEOUT:.0f} s"
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
    else:
        output = result.stdout
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        problem = None if result.returncode == 0 else (
            lines[-1] if lines else f"it exited with code {result.returncode}")
    found: dict[str, object] = {}
    for line in output.splitlines():
        try:
            found.update(json.loads(line))
        except (ValueError, TypeError):
            continue
    return found, problem


def _rows(label: str, value: str) -> list[str]:
    """``label`` and ``value`` aligned, the value wrapped under itself past the width."""
    lines = textwrap.wrap(value, width=LINE_WIDTH - LABEL_WIDTH - 1,
                          break_on_hyphens=False) or [""]
    return [f"{label if index == 0 else '':<{LABEL_WIDTH}} {line}"
            for index, line in enumerate(lines)]


def build_report() -> tuple[list[str], bool]:
    """The lines ``--check-build`` prints, and whether MPI could be found and queried."""
    import ringtrain

    rows = [*_rows("ringtrain", ringtrain.__version__),
            *_rows("Python", f"{sys.version.split()[0]} ({sys.executable})"),
            *_rows("mpi4py", package_version("mpi4py"))]
    healthy = True
    try:
        mpiexec = query_mpiexec()
        rows += [*_rows("mpiexec", mpiexec.path),
                 *_rows("MPI vendor", f"{mpiexec.vendor.value} {mpiexec.version}")]
    except MpiexecError as error:
        rows += _rows("mpiexec", f"unusable: {error}")
        healthy = False
    probe, problem = run_probe()
    healthy = healthy and problem is None
    unknown = f"unknown (the MPI probe failed: {problem})" if problem else "unknown"
    library = str(probe.get("library_version", "")).splitlines()
    rows += _rows("MPI library", " ".join(library[0].split()) if library else unknown)
    if "mpi_standard" in probe:
        rows += _rows("MPI standard", str(probe["mpi_standard"]))
    rows += _rows("CUDA-aware MPI", str(probe.get("cuda_aware", unknown)))
    rows += [*_rows("numba", package_version("numba")),
             *_rows("numba-cuda", package_version("numba-cuda", "numba_cuda")),
             *_rows("CuPy", package_version("cupy", prefix="cupy-")),
             *_rows("torch", package_version("torch"))]
    gpus = nvidia_gpus()
    rows += _rows("GPUs", f"{len(gpus)}: {', '.join(gpus)}" if gpus else "none found")
    collectives = probe.get("collectives")
    rows += _rows("collectives", ", ".join(collectives) if collectives else unknown)
    algorithms = probe.get("algorithms")
    if isinstance(algorithms, dict) and algorithms:
        for index, (collective, choices) in enumerate(algorithms.items()):
            rows += _rows("algorithms" if index == 0 else "",
                          f"{collective}: {', '.join(choices)}")
    else:
        rows += _rows("algorithms", unknown)
    return rows, healthy


def check_build() -> int:
    """Print the report; return 0 when MPI was found and answered, else 1."""
    rows, healthy = build_report()
    print("\n".join(rows), flush=True)
    return 0 if healthy else 1
