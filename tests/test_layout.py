"""The package layout: one import package ``ringtrain`` with its subpackages, and none of
the source folders importable under its own top-level name."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ringtrain

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ["collectives", "kernels", "trainer", "launcher"]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_subpackages_import(name):
    module = importlib.import_module(f"ringtrain.{name}")
    assert module.__name__ == f"ringtrain.{name}"
    assert Path(module.__file__).resolve().parent == ROOT / name


def test_public_api_is_complete():
    for name in ringtrain.__all__:
        assert hasattr(ringtrain, name), name
    for name in ["init", "shutdown", "allreduce", "allreduce_", "allreduce_async",
                 "allreduce_async_", "grouped_allreduce", "broadcast", "broadcast_",
                 "allgather", "reducescatter", "alltoall", "barrier", "broadcast_object",
                 "allgather_object", "synchronize", "poll", "ProcessSet", "add_process_set",
                 "remove_process_set", "global_process_set", "configure", "current_settings",
                 "MismatchError", "Average", "Sum", "Min", "Max", "Product", "ReduceOp"]:
        assert name in ringtrain.__all__, name
    assert isinstance(ringtrain.__version__, str) and ringtrain.__version__


def test_reduce_op_names():
    ops = ringtrain.ReduceOp
    assert [ringtrain.Average, ringtrain.Sum, ringtrain.Min, ringtrain.Max, ringtrain.Product] \
        == [ops.Average, ops.Sum, ops.Min, ops.Max, ops.Product]
    assert repr(ringtrain.Sum) == "ringtrain.Sum"


@pytest.mark.processes
def test_no_top_level_modules_from_the_source_folders(tmp_path):
    """Run from an empty directory, so the repository root is not on sys.path: only the
    installed distribution decides what is importable."""
    probe = (
        "import importlib.util, json, sys\n"
        "names = %r\n"
        "found = {n: importlib.util.find_spec(n) is not None for n in names}\n"
        "import ringtrain.collectives, ringtrain.kernels, ringtrain.trainer, ringtrain.launcher\n"
        "found['ringtrain.path'] = ringtrain.__path__[0]\n"
        "print(json.dumps(found))\n"
    ) % (SUBPACKAGES + [f"ringtrain.{name}" for name in SUBPACKAGES],)
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for name in SUBPACKAGES:
        assert found[name] is False, f"a top-level module {name!r} is importable"
        assert found[f"ringtrain.{name}"] is True, f"ringtrain.{name} is not importable"
    assert Path(found["ringtrain.path"]).resolve() == ROOT / "ringtrain"


@pytest.mark.processes
def test_importing_ringtrain_or_its_launcher_does_not_start_mpi(tmp_path):
    """``ringtrain.launcher`` must start without mpi4py (importing mpi4py.MPI starts MPI)."""
    probe = ("import sys, ringtrain, ringtrain.launcher\n"
             "from ringtrain import launcher\n"
             "print(sorted(m for m in sys.modules if m.startswith('mpi4py')))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.processes
def test_kernels_import_neither_mpi_nor_cuda(tmp_path):
    """``ringtrain.kernels`` is pure array code; ``numba.cuda`` waits for a device array."""
    probe = ("import sys, numpy as np, ringtrain.kernels as k\n"
             "k.reduce_into('sum', np.ones(3, np.float16), np.ones(3, np.float16),"
             " np.empty(3, np.float16))\n"
             "print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'numba.cuda'))))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.processes
def test_the_torch_backend_installs_as_ringtrain_torch_and_imports_without_mpi(tmp_path):
    """``import ringtrain.torch`` registers the backend; MPI starts at
    ``init_process_group``. Its folder is no top-level module (``torch_backend``)."""
    pytest.importorskip("torch")
    probe = ("import importlib.util, sys, ringtrain.torch, torch.distributed as dist\n"
             "print(ringtrain.torch.__file__)\n"
             "print(importlib.util.find_spec('torch_backend') is None)\n"
             "print('ringtrain' in dist.Backend.backend_list)\n"
             "print(sorted(m for m in sys.modules if m.startswith('mpi4py')))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path, no_top_level, registered, mpi = result.stdout.strip().splitlines()[-4:]
    assert Path(path).resolve() == ROOT / "torch_backend" / "__init__.py"
    assert (no_top_level, registered, mpi) == ("True", "True", "[]"), result.stdout


def test_numba_cuda_is_imported_by_one_module_only():
    statement = re.compile(r"^\s*(import numba\.cuda|from numba\.cuda\b"
                           r"|from numba import .*\bcuda\b)", re.MULTILINE)
    importing = [path.relative_to(ROOT).as_posix()
                 for folder in SUBPACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
                 if statement.search(path.read_text())]
    assert importing == ["kernels/device.py"], importing


@pytest.mark.processes
def test_host_collectives_and_the_trainer_leave_cuda_unimported(tmp_path):
    """The device path (and ``numba.cuda`` with it) loads when a device tensor is seen."""
    probe = ("import sys, numpy as np, ringtrain as rt, ringtrain.trainer\n"
             "rt.init()\n"
             "rt.allreduce(np.ones(3)); rt.grouped_allreduce([np.ones(2)])\n"
             "rt.broadcast(np.ones(2), 0); rt.allgather(np.ones(2)); rt.alltoall(np.ones(2))\n"
             "rt.reducescatter(np.ones(2))\n"
             "print(sorted(m for m in sys.modules if m.startswith('numba.cuda')))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
