"""ringtrain.collectives.config: sizes, RINGTRAIN_* variables, configure(), Settings."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest

import ringtrain as rt
from ringtrain.collectives import config
from ringtrain.collectives.config import (ALGORITHMS, Settings, configure, current_settings,
                                          environment_variable, parse_size, reset_settings,
                                          settings_from_environment)

FIELDS = [field.name for field in dataclasses.fields(Settings)]
SIZE_FIELDS = [f.name for f in dataclasses.fields(Settings) if f.type == "int"]
SECONDS_FIELDS = [f.name for f in dataclasses.fields(Settings) if f.type == "float"]
ALGORITHM_FIELDS = [f for f in FIELDS if f.endswith("_algorithm")]


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch):
    """No RINGTRAIN_* variable from the caller's environment; no override left behind."""
    for variable in list(os.environ):
        if variable.startswith("RINGTRAIN_"):
            monkeypatch.delenv(variable)
    reset_settings()
    yield
    reset_settings()


def read(environ: dict[str, str]) -> tuple[Settings, list[str]]:
    """settings_from_environment(environ) and the RuntimeWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = settings_from_environment(environ)
    return settings, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# --------------------------------------------------------------------------- parse_size

@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("1", 1), ("65536", 65536), ("64K", 64 << 10), ("64k", 64 << 10),
    ("64KiB", 64 << 10), ("64KB", 64 << 10), ("64kib", 64 << 10), ("1M", 1 << 20),
    ("1m", 1 << 20), ("1MiB", 1 << 20), ("3MB", 3 << 20), ("2G", 2 << 30), ("1GiB", 1 << 30),
    (" 8K ", 8 << 10), ("8 K", 8 << 10), ("100B", 100),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", " ", "K", "abc", "1.5M", "-1", "64KX", "1T", "0x10",
                                  "1 000", "64 KiBs"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        parse_size(text)


# --------------------------------------------------------------------------- environment

def test_environment_variable_names():
    assert environment_variable("segment_bytes") == "RINGTRAIN_SEGMENT_BYTES"
    assert environment_variable("allreduce_algorithm") == "RINGTRAIN_ALLREDUCE_ALGORITHM"


def test_no_variables_give_the_defaults():
    settings, warned = read({})
    assert settings == Settings()
    assert warned == []


def test_unrelated_variables_are_ignored():
    settings, warned = read({"RINGTRAIN_NOT_A_SETTING": "1", "SEGMENT_BYTES": "5"})
    assert settings == Settings() and warned == []


@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_every_size_field_is_read_from_its_variable(field):
    settings, warned = read({environment_variable(field): "96K"})
    assert getattr(settings, field) == 96 << 10
    assert warned == []
    assert dataclasses.replace(settings, **{field: getattr(Settings(), field)}) == Settings()


@pytest.mark.parametrize("field", SECONDS_FIELDS)
def test_every_seconds_field_is_read_from_its_variable(field):
    settings, warned = read({environment_variable(field): "2.5"})
    assert getattr(settings, field) == 2.5
    assert warned == []


@pytest.mark.parametrize("field", ALGORITHM_FIELDS)
def test_every_algorithm_field_is_read_from_its_variable(field):
    collective = field[:-len("_algorithm")]
    for choice in ALGORITHMS[collective]:
        settings, warned = read({environment_variable(field): f" {choice.upper()} "})
        assert getattr(settings, field) == choice, "values are trimmed and lower-cased"
        assert warned == []


def test_several_variables_at_once():
    settings, warned = read({"RINGTRAIN_ALLREDUCE_ALGORITHM": "ring",
                             "RINGTRAIN_SEGMENT_BYTES": "1M",
                             "RINGTRAIN_BROADCAST_PIPELINE_MIN_BYTES": "2048"})
    assert warned == []
    assert settings.allreduce_algorithm == "ring"
    assert settings.segment_bytes == 1 << 20
    assert settings.broadcast_pipeline_min_bytes == 2048


@pytest.mark.parametrize("variable, value", [
    ("RINGTRAIN_SEGMENT_BYTES", "lots"),
    ("RINGTRAIN_SEGMENT_BYTES", "10"),  # below the 64-byte minimum
    ("RINGTRAIN_SEGMENT_BYTES", "1.5M"),
    ("RINGTRAIN_RECURSIVE_DOUBLING_MAX_BYTES", "-5"),
    ("RINGTRAIN_BROADCAST_PIPELINE_MIN_BYTES", ""),
    ("RINGTRAIN_ALLREDUCE_ALGORITHM", "tree"),
    ("RINGTRAIN_BROADCAST_ALGORITHM", "ring"),  # an algorithm of another collective
    ("RINGTRAIN_ALLTOALL_ALGORITHM", "ring"),
    ("RINGTRAIN_FUSION_THRESHOLD", "lots"),
    ("RINGTRAIN_STALL_CHECK_SECONDS", "soon"),
    ("RINGTRAIN_STALL_SHUTDOWN_SECONDS", "-1"),
])
def test_a_bad_value_is_ignored_with_a_warning_naming_the_variable(variable, value):
    settings, warned = read({variable: value, "RINGTRAIN_ALLGATHER_ALGORITHM": "native"})
    assert len(warned) == 1, warned
    assert variable in warned[0]
    field = variable[len("RINGTRAIN_"):].lower()
    assert getattr(settings, field) == getattr(Settings(), field), "the bad value was used"
    assert settings.allgather_algorithm == "native", "a good variable next to it was dropped"


def test_current_settings_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv("RINGTRAIN_SEGMENT_BYTES", "128K")
    reset_settings()
    assert current_settings().segment_bytes == 128 << 10
    first = current_settings()
    monkeypatch.setenv("RINGTRAIN_SEGMENT_BYTES", "1M")
    assert current_settings() is first, "read again without reset_settings()"
    reset_settings()
    assert current_settings().segment_bytes == 1 << 20


def test_current_settings_warns_about_a_bad_variable(monkeypatch):
    monkeypatch.setenv("RINGTRAIN_ALLREDUCE_ALGORITHM", "fastest")
    reset_settings()
    with pytest.warns(RuntimeWarning, match="RINGTRAIN_ALLREDUCE_ALGORITHM"):
        settings = current_settings()
    assert settings.allreduce_algorithm == "auto"


# --------------------------------------------------------------------------- configure

def test_configure_overrides_and_keeps_earlier_overrides():
    settings = configure(segment_bytes=4096)
    assert settings.segment_bytes == 4096 and current_settings() is settings
    settings = configure(allreduce_algorithm="ring")
    assert settings.segment_bytes == 4096 and settings.allreduce_algorithm == "ring"
    assert rt.configure is configure and rt.current_settings is current_settings
    assert configure() == settings


def test_configure_beats_the_environment(monkeypatch):
    monkeypatch.setenv("RINGTRAIN_ALLREDUCE_ALGORITHM", "native")
    reset_settings()
    assert current_settings().allreduce_algorithm == "native"
    assert configure(allreduce_algorithm="ring").allreduce_algorithm == "ring"
    reset_settings()
    assert current_settings().allreduce_algorithm == "native"


@pytest.mark.parametrize("names", [{"segment_size": 4}, {"algorithm": "ring"},
                                   {"segment_bytes": 4096, "bogus": 1}])
def test_configure_refuses_unknown_names(names):
    before = current_settings()
    with pytest.raises(rt.InvalidArgumentError) as caught:
        configure(**names)
    unknown = sorted(set(names) - set(FIELDS))
    for name in unknown:
        assert name in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert current_settings() is before, "a refused call changed the settings"


@pytest.mark.parametrize("names", [{"allreduce_algorithm": "tree"},
                                   {"broadcast_algorithm": "ring"},
                                   {"segment_bytes": 63},
                                   {"recursive_doubling_max_bytes": -1},
                                   {"broadcast_pipeline_min_bytes": -1}])
def test_configure_refuses_bad_values(names):
    before = current_settings()
    with pytest.raises(rt.InvalidArgumentError):
        configure(**names)
    assert current_settings() is before


@pytest.mark.parametrize("names", [{"segment_bytes": "1M"},
                                   {"recursive_doubling_max_bytes": None},
                                   {"allreduce_algorithm": 3}])
def test_configure_refuses_values_of_the_wrong_type(names):
    """A value of the wrong type is a bad value: InvalidArgumentError, as documented."""
    before = current_settings()
    with pytest.raises(rt.InvalidArgumentError):
        configure(**names)
    assert current_settings() is before


def test_configure_covers_the_trainer_and_the_stall_inspector():
    assert Settings().fusion_threshold == 8 << 20
    assert (Settings().stall_check_seconds, Settings().stall_shutdown_seconds) == (60.0, 0.0)
    settings = configure(fusion_threshold=1 << 20, stall_check_seconds=5,
                         stall_shutdown_seconds=0.5)
    assert settings.fusion_threshold == 1 << 20
    assert settings.stall_check_seconds == 5.0 and isinstance(settings.stall_check_seconds, float)
    assert settings.stall_shutdown_seconds == 0.5


@pytest.mark.parametrize("names", [{"fusion_threshold": -1}, {"fusion_threshold": 1.5},
                                   {"stall_check_seconds": -1.0},
                                   {"stall_check_seconds": float("nan")},
                                   {"stall_shutdown_seconds": "10"},
                                   {"stall_shutdown_seconds": True}])
def test_configure_refuses_bad_trainer_and_stall_values(names):
    before = current_settings()
    with pytest.raises(rt.InvalidArgumentError, match=next(iter(names))):
        configure(**names)
    assert current_settings() is before


def test_reset_settings_forgets_overrides():
    configure(segment_bytes=1 << 20)
    reset_settings()
    assert current_settings() == Settings()


# --------------------------------------------------------------------------- Settings

def test_settings_defaults_are_valid_and_frozen():
    settings = Settings()
    for field in ALGORITHM_FIELDS:
        assert getattr(settings, field) == "auto"
    assert settings.segment_bytes >= 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.segment_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize("collective", sorted(ALGORITHMS))
def test_settings_accept_each_algorithm_and_refuse_others(collective):
    field = f"{collective}_algorithm"
    for choice in ALGORITHMS[collective]:
        assert getattr(Settings(**{field: choice}), field) == choice
    with pytest.raises(rt.InvalidArgumentError, match=field):
        Settings(**{field: "nonsense"})


def test_algorithm_table():
    assert set(ALGORITHMS) == {"allreduce", "broadcast", "allgather", "reducescatter",
                               "alltoall"}
    assert set(ALGORITHMS["allreduce"]) == {"auto", "ring", "recursive_doubling",
                                            "hierarchical", "node_leader", "native", "ipc"}
    assert set(ALGORITHMS["broadcast"]) == {"auto", "binomial", "pipeline", "recursive_doubling",
                                            "hierarchical", "native"}
    assert set(ALGORITHMS["allgather"]) == {"auto", "ring", "recursive_doubling", "pairwise",
                                            "hierarchical", "native"}
    assert set(ALGORITHMS["reducescatter"]) == {"auto", "ring", "recursive_doubling",
                                                "hierarchical", "native"}
    assert set(ALGORITHMS["alltoall"]) == {"auto", "recursive_doubling", "pairwise", "native"}
    assert rt.ALGORITHMS is ALGORITHMS


@pytest.mark.parametrize("field, bad, good", [
    ("segment_bytes", 63, 64),
    ("recursive_doubling_max_bytes", -1, 0),
    ("broadcast_pipeline_min_bytes", -1, 0),
])
def test_settings_size_limits(field, bad, good):
    with pytest.raises(rt.InvalidArgumentError, match=field):
        Settings(**{field: bad})
    assert getattr(Settings(**{field: good}), field) == good


def test_module_exposes_its_functions():
    for name in ("parse_size", "settings_from_environment", "reset_settings", "configure",
                 "current_settings", "environment_variable"):
        assert callable(getattr(config, name))
