"""ringtrain.common.environment: every RINGTRAIN_* variable declared once, read through
the table, with one policy on malformed values (two variables raise)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ringtrain.common import environment
from ringtrain.collectives import config
from ringtrain.collectives.config import Settings, configure, reset_settings
from ringtrain.trainer._buckets import DEFAULT_FUSION_THRESHOLD, fusion_threshold
from ringtrain.common.environment import RAISE, VARIABLES, WARN, Variable

from test_architecture import MODULES

MALFORMED = {
    "RINGTRAIN_ALLREDUCE_ALGORITHM": "tree",
    "RINGTRAIN_BROADCAST_ALGORITHM": "ring",
    "RINGTRAIN_ALLGATHER_ALGORITHM": "pipeline",
    "RINGTRAIN_REDUCESCATTER_ALGORITHM": "binomial",
    "RINGTRAIN_ALLTOALL_ALGORITHM": "ring",
    "RINGTRAIN_RECURSIVE_DOUBLING_MAX_BYTES": "1.5M",
    "RINGTRAIN_SEGMENT_BYTES": "12x",
    "RINGTRAIN_BROADCAST_PIPELINE_MIN_BYTES": "",
    "RINGTRAIN_HIERARCHICAL_MIN_BYTES": "-1",
    "RINGTRAIN_IPC_MIN_BYTES": "a lot",
    "RINGTRAIN_NODE_SIZE": "two",
    "RINGTRAIN_FUSION_THRESHOLD": "lots",
    "RINGTRAIN_STALL_CHECK_SECONDS": "a minute",
    "RINGTRAIN_STALL_SHUTDOWN_SECONDS": "-5",
    "RINGTRAIN_NAME_MATCH_SECONDS": "forever",
    "RINGTRAIN_LOG_LEVEL": "LOUD",
    "RINGTRAIN_CUDA_AWARE_MPI": "maybe",
    "RINGTRAIN_GPU_BY_LOCAL_RANK": "maybe",
    "RINGTRAIN_STOP_JOB_ON_EXCEPTION": "maybe",
    "RINGTRAIN_RESTART_COUNT": "first",
    "RINGTRAIN_TIMELINE_MERGED_BY_LAUNCHER": "maybe",
    "RINGTRAIN_REPORT_FD": "pipe",
    "RINGTRAIN_BENCH_INJECT_WRONG": "sometimes",
    "RINGTRAIN_KV_SERVERS": "0",
    "RINGTRAIN_KV_BIGARRAY_BOUND": "1M",
    "RINGTRAIN_RESULT_POOL_BYTES": "plenty",
    "RINGTRAIN_COMPILED_EXCHANGE": "fast",
    "RINGTRAIN_AGREEMENT_SHARED_MEMORY": "shared",
}
"""A malformed value of every variable that has one (a path cannot be malformed)."""

WELL_FORMED = {
    "RINGTRAIN_ALLREDUCE_ALGORITHM": (" Ring ", "ring"),
    "RINGTRAIN_SEGMENT_BYTES": ("64K", 64 << 10),
    "RINGTRAIN_FUSION_THRESHOLD": ("4MiB", 4 << 20),
    "RINGTRAIN_STALL_CHECK_SECONDS": ("0.5", 0.5),
    "RINGTRAIN_NAME_MATCH_SECONDS": ("2", 2.0),
    "RINGTRAIN_LOG_LEVEL": ("debug", "DEBUG"),
    "RINGTRAIN_CUDA_AWARE_MPI": (" yes ", True),
    "RINGTRAIN_GPU_BY_LOCAL_RANK": ("0", False),
    "RINGTRAIN_STOP_JOB_ON_EXCEPTION": ("0", False),
    "RINGTRAIN_TIMELINE": ("/runs/t.json", "/runs/t.json"),
    "RINGTRAIN_ELASTIC_DIR": ("/runs/state", "/runs/state"),
    "RINGTRAIN_RESTART_COUNT": ("2", 2),
    "RINGTRAIN_TIMELINE_MERGED_BY_LAUNCHER": ("1", True),
    "RINGTRAIN_REPORT_FD": ("7", 7),
    "RINGTRAIN_BENCH_INJECT_WRONG": ("1", True),
    "RINGTRAIN_KV_SERVERS": ("2", 2),
    "RINGTRAIN_KV_BIGARRAY_BOUND": ("1000", 1000),
    "RINGTRAIN_RESULT_POOL_BYTES": ("256M", 256 << 20),
    "RINGTRAIN_COMPILED_EXCHANGE": ("0", False),
    "RINGTRAIN_AGREEMENT_SHARED_MEMORY": ("0", False),
}


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch):
    """No RINGTRAIN_* variable from the caller's environment; no override left behind."""
    for name in list(os.environ):
        if name.startswith("RINGTRAIN_"):
            monkeypatch.delenv(name)
    reset_settings()
    yield
    reset_settings()


def read(variable: Variable, environ: dict[str, str]) -> tuple[object, list[str]]:
    """``variable.read(environ)`` and the RuntimeWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = variable.read(environ)
    return value, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# --------------------------------------------------------------------------- the table

def test_every_variable_is_declared_once_with_a_parser_and_a_default():
    declared = [value for value in vars(environment).values() if isinstance(value, Variable)]
    assert len(declared) == len(VARIABLES) == len({v.name for v in declared})
    for name, variable in VARIABLES.items():
        assert variable.name == name and re.fullmatch(r"RINGTRAIN_[A-Z0-9_]+", name)
        assert callable(variable.parse)
        assert variable.description and "\n" not in variable.description
        assert variable.policy in (WARN, RAISE)
        assert variable.read({}) == variable.default
    assert set(MALFORMED) | set(WELL_FORMED) | {"RINGTRAIN_TIMELINE", "RINGTRAIN_ELASTIC_DIR",
                                                 "RINGTRAIN_TUNING_FILE"} == set(VARIABLES)


def test_only_the_cuda_aware_override_and_the_gpu_choice_raise():
    assert sorted(name for name, v in VARIABLES.items() if v.policy == RAISE) == \
        ["RINGTRAIN_CUDA_AWARE_MPI", "RINGTRAIN_GPU_BY_LOCAL_RANK"]


def test_every_setting_has_its_variable_and_its_default():
    for field in dataclasses.fields(Settings):
        variable = environment.setting_variable(field.name)
        assert variable.name == config.environment_variable(field.name)
        assert variable.setting == field.name
        assert getattr(Settings(), field.name) == variable.default
    settings = {v.setting for v in VARIABLES.values() if v.setting is not None}
    assert settings == {field.name for field in dataclasses.fields(Settings)}


def test_the_launcher_sets_the_variables_it_declares():
    assert sorted(name for name, v in VARIABLES.items() if v.set_by_launcher) == \
        ["RINGTRAIN_ELASTIC_DIR", "RINGTRAIN_KV_SERVERS", "RINGTRAIN_REPORT_FD",
         "RINGTRAIN_RESTART_COUNT",
         "RINGTRAIN_TIMELINE", "RINGTRAIN_TIMELINE_MERGED_BY_LAUNCHER"]


def test_config_re_exports_the_table_s_parsers():
    assert config.parse_size is environment.parse_size
    assert config.environment_variable is environment.environment_variable
    assert config.ALGORITHMS is environment.ALGORITHMS


# --------------------------------------------------------------------------- reading

@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_a_well_formed_value_is_parsed(name):
    text, expected = WELL_FORMED[name]
    assert read(VARIABLES[name], {name: text}) == (expected, [])


@pytest.mark.parametrize("name", sorted(n for n in MALFORMED if VARIABLES[n].policy == WARN))
def test_a_malformed_value_warns_once_naming_variable_and_value_and_gives_the_default(name):
    variable = VARIABLES[name]
    value, warned = read(variable, {name: MALFORMED[name]})
    assert value == variable.default
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"ignoring {name}={MALFORMED[name]!r}: "), warned


def test_the_warning_text():
    _, warned = read(environment.SEGMENT_BYTES, {"RINGTRAIN_SEGMENT_BYTES": "12x"})
    assert warned == ["ignoring RINGTRAIN_SEGMENT_BYTES='12x': not a size: '12x'"]
    _, warned = read(environment.SEGMENT_BYTES, {"RINGTRAIN_SEGMENT_BYTES": "10"})
    assert warned == ["ignoring RINGTRAIN_SEGMENT_BYTES='10': segment_bytes must be >= 64, "
                      "got 10"]


@pytest.mark.parametrize("name", ["RINGTRAIN_CUDA_AWARE_MPI", "RINGTRAIN_GPU_BY_LOCAL_RANK"])
def test_the_two_raising_variables_raise(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=f"^{name}='maybe': use 1 "):
            VARIABLES[name].read({name: "maybe"})


@pytest.mark.parametrize("name", ["RINGTRAIN_CUDA_AWARE_MPI", "RINGTRAIN_GPU_BY_LOCAL_RANK",
                                  "RINGTRAIN_TIMELINE", "RINGTRAIN_ELASTIC_DIR"])
def test_blank_is_unset_where_declared(name):
    assert read(VARIABLES[name], {name: " "}) == (VARIABLES[name].default, [])


def test_read_takes_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("RINGTRAIN_RESTART_COUNT", "3")
    assert environment.RESTART_COUNT.read() == 3


def test_pop_reads_and_removes():
    environ = {"RINGTRAIN_REPORT_FD": "9", "OTHER": "1"}
    assert environment.REPORT_FD.pop(environ) == 9
    assert environ == {"OTHER": "1"}
    assert environment.REPORT_FD.pop(environ) is None


# --------------------------------------------------------------------------- configure

def test_configure_changes_the_trainer_s_fusion_threshold(monkeypatch):
    assert fusion_threshold() == DEFAULT_FUSION_THRESHOLD == 8 << 20
    configure(fusion_threshold=2 << 20)
    assert fusion_threshold() == 2 << 20
    assert fusion_threshold(123) == 123, "an explicit value still wins"
    configure(fusion_threshold=0)
    assert fusion_threshold() == 0
    reset_settings()
    monkeypatch.setenv("RINGTRAIN_FUSION_THRESHOLD", "1M")
    assert fusion_threshold() == 1 << 20
    assert configure(fusion_threshold=3 << 20).fusion_threshold == fusion_threshold()


# --------------------------------------------------------------------------- the sources

def _documentation(tree: ast.AST) -> set[int]:
    """ids of the string constants that stand alone as statements (docstrings)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def _environment_reads(tree: ast.AST) -> list[ast.AST]:
    """The keys given to os.environ / os.getenv reads (get, pop, [], in)."""
    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ" or \
            isinstance(node, ast.Name) and node.id == "environ"

    keys = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            function = node.func
            if (function.attr in ("get", "pop", "setdefault") and is_environ(function.value)) \
                    or (function.attr == "getenv"):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys.append(node.left)
    return keys


def _names_a_variable(key: ast.AST) -> bool:
    """Whether a key is a RINGTRAIN_ name or a constant holding one."""
    if isinstance(key, ast.Constant):
        return isinstance(key.value, str) and key.value.startswith("RINGTRAIN_")
    if isinstance(key, ast.Name):
        return key.id.endswith("_VARIABLE") or \
            isinstance(getattr(environment, key.id, None), Variable)
    return isinstance(key, ast.Attribute) and key.attr == "name"


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if m != "ringtrain.common.environment"))
def test_no_module_but_the_table_reads_a_ringtrain_variable(module):
    tree = ast.parse(MODULES[module].read_text())
    documentation = _documentation(tree)
    literals = sorted({node.value for node in ast.walk(tree)
                       if isinstance(node, ast.Constant) and isinstance(node.value, str)
                       and id(node) not in documentation
                       and re.fullmatch(r"RINGTRAIN_[A-Z0-9_]*", node.value)})
    assert not literals, \
        f"{module} names {literals}: take the name from ringtrain.common.environment"
    reads = [ast.unparse(key) for key in _environment_reads(tree) if _names_a_variable(key)]
    assert not reads, \
        f"{module} reads {reads} from the environment: use ringtrain.common.environment"


def test_the_source_scan_finds_reads():
    tree = ast.parse("import os\n"
                     "a = os.environ.get('RINGTRAIN_X')\n"
                     "b = os.environ[SEGMENT_VARIABLE]\n"
                     "c = os.getenv(TIMELINE.name)\n"
                     "d = 'RINGTRAIN_Y' in os.environ\n"
                     "e = os.environ.get('HOME')\n")
    keys = [ast.unparse(key) for key in _environment_reads(tree) if _names_a_variable(key)]
    assert keys == ["'RINGTRAIN_X'", "SEGMENT_VARIABLE", "TIMELINE.name", "'RINGTRAIN_Y'"]


@pytest.mark.processes
@pytest.mark.parametrize("module", ["ringtrain.common.environment",
                                    "ringtrain.common.timeline_format"])
def test_importing_the_table_imports_neither_mpi4py_nor_the_subpackages(tmp_path, module):
    probe = (f"import json, sys\nimport {module}\nfrom ringtrain.common import environment\n"
             "print(json.dumps(sorted(m for m in sys.modules if m.startswith(("
             "'mpi4py', 'numpy', 'ringtrain.collectives', 'ringtrain.trainer', "
             "'ringtrain.kernels', 'ringtrain.launcher')))))\n")
    result = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_the_table_imports_only_the_standard_library():
    tree = ast.parse(Path(environment.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert imported <= set(sys.stdlib_module_names), imported
