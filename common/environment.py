"""Every ``RINGTRAIN_*`` environment variable of ringtrain, declared once.

Each :class:`Variable` has its name, a parser, its default, a one-line description and
its policy on a malformed value (as ``mpi4py.rc`` declares mpi4py's options). Modules
read a variable through it (``SEGMENT_BYTES.read()``), never from ``os.environ``
themselves, so every variable is parsed, defaulted and refused the same way.

**One policy on a malformed value** (``WARN``): a :class:`RuntimeWarning` that names the
variable and the value, then the default::

    RuntimeWarning: ignoring RINGTRAIN_SEGMENT_BYTES='12x': not a size: '12x'

**Two variables raise** a :class:`ValueError` instead (``RAISE``), because guessing there
is unsafe; the caller decides what to do (``ringtrain.init`` logs the error and takes
the safe choice):

* ``RINGTRAIN_CUDA_AWARE_MPI``: a device pointer handed to an MPI that cannot read it
  crashes the process with no Python error. Whoever sets the variable overrides what the
  MPI library says, so a value that is neither on nor off must be seen, not replaced by
  a default that may be the opposite of what was meant.
* ``RINGTRAIN_GPU_BY_LOCAL_RANK``: it decides on which device the process's CUDA
  context is made current, which cannot be undone; a value that is neither on nor off
  is refused rather than read as either.

A variable that is unset is read from its ``HOROVOD_*`` twin where Horovod has one with
the same meaning (``HOROVOD_FUSION_THRESHOLD`` for ``RINGTRAIN_FUSION_THRESHOLD``, ...;
see :attr:`Variable.horovod`): the ``RINGTRAIN_*`` variable wins, and ``init`` logs each
twin read at INFO (:func:`horovod_lines`). :data:`HOROVOD_WITHOUT_EFFECT` lists the
Horovod variables that mean nothing here.

The variables fall in four groups: the settings of :func:`ringtrain.configure` (the
``setting`` of their :class:`Variable`; :class:`ringtrain.Settings` takes its defaults
from here); the log level, the CUDA-aware override and the GPU choice, read once at
``ringtrain.init``; those that ``ringtrain-run`` sets for the ranks
(``set_by_launcher``); and one test hook of ``ringtrain-bench``.

Standard library only: the launcher imports this module, and it must import neither
MPI nor the collectives.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

WARN = "warn"
"""Policy: a malformed value is ignored with a RuntimeWarning; the default is used."""
RAISE = "raise"
"""Policy: a malformed value raises ValueError (where a guess would be unsafe)."""

PREFIX = "RINGTRAIN_"


@dataclasses.dataclass(frozen=True)
class Variable(Generic[T]):
    """One ``RINGTRAIN_*`` variable.

    Attributes:
        name: the variable, e.g. ``"RINGTRAIN_SEGMENT_BYTES"``.
        parse: turns its text into a value; raises ValueError on a malformed one.
        default: the value when it is unset (or malformed, under ``WARN``).
        description: one line saying what it does.
        policy: ``WARN`` or ``RAISE``: what a malformed value does.
        check: validates a parsed value further, raising ValueError (the rules of a
            setting, shared with :class:`ringtrain.Settings`); None: none.
        setting: the field of :class:`ringtrain.Settings` (and name for
            :func:`ringtrain.configure`) that it sets; None for the other variables.
        blank_is_unset: an empty or blank value counts as unset (else it is malformed).
        set_by_launcher: ``ringtrain-run`` sets it for the ranks.
        horovod: the ``HOROVOD_*`` variables read in its place when it is unset, each
            with what turns its text into this variable's (None: that text has no
            meaning here, the variable stays unset).
    """

    name: str
    parse: Callable[[str], T]
    default: T
    description: str
    policy: str = WARN
    check: Callable[[Any], None] | None = None
    setting: str | None = None
    blank_is_unset: bool = False
    set_by_launcher: bool = False
    horovod: tuple[tuple[str, Callable[[str], str | None]], ...] = ()

    def text(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text in ``environ`` (default ``os.environ``); None when it is
        unset (or blank, where blank counts as unset). When it is unset, its ``HOROVOD_*``
        twin's text, translated (:func:`horovod_lines` says so)."""
        environ = os.environ if environ is None else environ
        text = self._given(environ.get(self.name))
        if text is None:
            for twin, translate in self.horovod:
                given = environ.get(twin)
                translated = None if given is None else translate(given)
                if translated is not None:
                    _say_once(f"{twin}={given!r} read as {self.name}={translated!r}")
                    return self._given(translated)
        return text

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The variable's value in ``environ`` (default ``os.environ``).

        Returns:
            The parsed value; the default when the variable is unset, or malformed
            under the ``WARN`` policy (after a RuntimeWarning naming variable and value).

        Raises:
            ValueError: a malformed value under the ``RAISE`` policy; the message names
                the variable and the value.
        """
        return self._value(self.text(environ))

    def pop(self, environ: MutableMapping[str, str] | None = None) -> T:
        """Like :meth:`read`, and remove the variable from ``environ`` (default
        ``os.environ``), so that programs this process starts do not inherit it."""
        text = (os.environ if environ is None else environ).pop(self.name, None)
        return self._value(self._given(text))

    def validate(self, value: Any) -> T:
        """``value`` if :attr:`check` accepts it.

        Raises:
            ValueError: it does not; the message names the setting.
        """
        if self.check is not None:
            self.check(value)
        return value

    def _given(self, text: str | None) -> str | None:
        if text is not None and self.blank_is_unset and not text.strip():
            return None
        return text

    def _value(self, text: str | None) -> T:
        if text is None:
            return self.default
        try:
            return self.validate(self.parse(text))
        except ValueError as error:
            if self.policy == RAISE:
                raise ValueError(f"{self.name}={text!r}: {error}") from None
            warnings.warn(f"ignoring {self.name}={text!r}: {error}", RuntimeWarning,
                          stacklevel=3)  # the caller of read() or pop()
            return self.default


VARIABLES: dict[str, Variable[Any]] = {}
"""Every variable by name, in the order declared."""

_horovod_readings: dict[str, None] = {}


def _say_once(message: str) -> None:
    _horovod_readings[message] = None


def horovod_lines(environ: Mapping[str, str] | None = None) -> list[str]:
    """What this process takes from ``HOROVOD_*`` variables: one line for each twin read
    in place of its ``RINGTRAIN_*`` variable, and for each one without effect
    (:data:`HOROVOD_WITHOUT_EFFECT`). ``ringtrain.init`` logs them at INFO."""
    for variable in VARIABLES.values():
        variable.text(environ)
    return list(_horovod_readings) + horovod_variables_without_effect(environ)


def _declare(variable: Variable[T]) -> Variable[T]:
    if not variable.name.startswith(PREFIX) or variable.name in VARIABLES:
        raise ValueError(f"{variable.name} declared twice or not a {PREFIX}* name")
    if variable.policy not in (WARN, RAISE):
        raise ValueError(f"{variable.name}: unknown policy {variable.policy!r}")
    VARIABLES[variable.name] = variable
    return variable


def environment_variable(field: str) -> str:
    """The variable overriding a setting: ``segment_bytes`` -> ``RINGTRAIN_SEGMENT_BYTES``."""
    return PREFIX + field.upper()


def setting_variable(field: str) -> Variable[Any]:
    """The variable of the setting ``field`` (a field of :class:`ringtrain.Settings`).

    Raises:
        KeyError: no variable sets ``field``.
    """
    variable = VARIABLES.get(environment_variable(field))
    if variable is None or variable.setting != field:
        raise KeyError(f"no variable sets {field!r}")
    return variable


# --------------------------------------------------------------------------- parsers

_SIZE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """Parse ``"65536"``, ``"64K"``, ``"64KiB"`` or ``"1M"`` (binary units) into bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


def parse_seconds(text: str) -> float:
    """Parse a number of seconds, e.g. ``"60"`` or ``"0.5"``."""
    return float(text)


def parse_count(text: str) -> int:
    """Parse a whole number >= 0, e.g. ``"3"``."""
    if not text.strip().isdigit():
        raise ValueError(f"not a whole number >= 0: {text!r}")
    return int(text)


def parse_text(text: str) -> str:
    """The text as it is (a path)."""
    return text


def parse_word(text: str) -> str:
    """The text trimmed and in lower case (a choice such as an algorithm's name)."""
    return text.strip().lower()


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The level names of ringtrain's log."""


def parse_log_level(text: str) -> str:
    """A level name of ringtrain's log, in upper case (``"debug"`` -> ``"DEBUG"``)."""
    name = text.strip().upper()
    if name not in LOG_LEVELS:
        raise ValueError(f"unknown log level {text!r}; one of {', '.join(LOG_LEVELS)}")
    return name


SWITCH_VALUES = {"1": True, "yes": True, "true": True, "0": False, "no": False, "false": False}
"""What an on/off variable may hold (lower case, trimmed), and what it means."""


def switch(on: str, off: str) -> Callable[[str], bool]:
    """A parser of an on/off variable; ``on`` and ``off`` say what 1 and 0 do (for the
    message on a malformed value)."""

    def parse(text: str) -> bool:
        value = SWITCH_VALUES.get(text.strip().lower())
        if value is None:
            raise ValueError(f"use 1 ({on}) or 0 ({off})")
        return value

    return parse


# --------------------------------------------------------------------------- checks

def _one_of(field: str, choices: tuple[str, ...]) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{field}={value!r} is not one of {', '.join(choices)}")
    return check


def _at_least(field: str, minimum: int) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not value >= minimum:  # also refuses NaN
            raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return check


def _setting(field: str, parse: Callable[[str], T], default: T, description: str,
             check: Callable[[Any], None],
             horovod: tuple[tuple[str, Callable[[str], str | None]], ...] = ()
             ) -> Variable[T]:
    return _declare(Variable(environment_variable(field), parse, default, description,
                             check=check, setting=field, horovod=horovod))


# --------------------------------------------------------------------------- Horovod's

def _same(text: str) -> str:
    return text


def _when_on(value: str) -> Callable[[str], str | None]:
    """A ``HOROVOD_*`` switch that means ``value`` when on (1, true, yes)."""
    def translate(text: str) -> str | None:
        return value if SWITCH_VALUES.get(text.strip().lower()) else None
    return translate


_HOROVOD_LOG_LEVELS = {"TRACE": "DEBUG", "FATAL": "CRITICAL"}

HOROVOD_WITHOUT_EFFECT: dict[str, str] = {
    "HOROVOD_CYCLE_TIME": "calls start when they are made: there is no cycle",
    "HOROVOD_TIMELINE_MARK_CYCLES": "there are no cycles to mark",
    "HOROVOD_CACHE_CAPACITY": "calls are planned once and kept; there is no response cache",
    "HOROVOD_NUM_NCCL_STREAMS": "ringtrain does not use NCCL",
    "HOROVOD_MPI_THREADS_DISABLE": "ringtrain asks MPI for MPI_THREAD_MULTIPLE",
    "HOROVOD_THREAD_AFFINITY": "ringtrain's collectives run on the caller's threads",
    "HOROVOD_AUTOTUNE": "settings are not tuned at run time",
}
"""``HOROVOD_*`` variables ringtrain accepts without effect, and why (``init`` logs each
one set at INFO)."""


def horovod_variables_without_effect(environ: Mapping[str, str] | None = None
                                     ) -> list[str]:
    """One line for each :data:`HOROVOD_WITHOUT_EFFECT` variable set in ``environ``."""
    environ = os.environ if environ is None else environ
    return [f"{name} has no effect: {why}" for name, why in HOROVOD_WITHOUT_EFFECT.items()
            if name in environ]


# --------------------------------------------------------------------------- the table

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "allreduce": ("auto", "ring", "recursive_doubling", "hierarchical", "node_leader",
                  "native", "ipc"),
    "broadcast": ("auto", "pipeline", "binomial", "recursive_doubling", "hierarchical",
                  "native"),
    "allgather": ("auto", "ring", "recursive_doubling", "pairwise", "hierarchical",
                  "native"),
    "reducescatter": ("auto", "ring", "recursive_doubling", "hierarchical", "native"),
    "alltoall": ("auto", "recursive_doubling", "pairwise", "native"),
}
"""The algorithms each collective offers; ``auto`` picks by message and world size."""

# Settings of ringtrain.configure(). All but the last four decide which messages are
# sent and reach every collective's signature through the algorithm, segment size and
# node layout they choose; fusion_threshold and the stall seconds are each rank's own,
# and the lowest rank's name_match_seconds decides for all.
ALLREDUCE_ALGORITHM = _setting(
    "allreduce_algorithm", parse_word, "auto",
    "the allreduce algorithm: auto or one of ALGORITHMS['allreduce']",
    _one_of("allreduce_algorithm", ALGORITHMS["allreduce"]),
    horovod=(("HOROVOD_HIERARCHICAL_ALLREDUCE", _when_on("hierarchical")),))
BROADCAST_ALGORITHM = _setting(
    "broadcast_algorithm", parse_word, "auto",
    "the broadcast algorithm: auto or one of ALGORITHMS['broadcast']",
    _one_of("broadcast_algorithm", ALGORITHMS["broadcast"]))
ALLGATHER_ALGORITHM = _setting(
    "allgather_algorithm", parse_word, "auto",
    "the allgather algorithm: auto or one of ALGORITHMS['allgather']",
    _one_of("allgather_algorithm", ALGORITHMS["allgather"]),
    horovod=(("HOROVOD_HIERARCHICAL_ALLGATHER", _when_on("hierarchical")),))
REDUCESCATTER_ALGORITHM = _setting(
    "reducescatter_algorithm", parse_word, "auto",
    "the reducescatter algorithm: auto or one of ALGORITHMS['reducescatter']",
    _one_of("reducescatter_algorithm", ALGORITHMS["reducescatter"]))
ALLTOALL_ALGORITHM = _setting(
    "alltoall_algorithm", parse_word, "auto",
    "the alltoall algorithm: auto or one of ALGORITHMS['alltoall']",
    _one_of("alltoall_algorithm", ALGORITHMS["alltoall"]))
RECURSIVE_DOUBLING_MAX_BYTES = _setting(
    "recursive_doubling_max_bytes", parse_size, 128 * 1024,
    "without a tuned table, auto allreduce uses recursive doubling up to this size",
    _at_least("recursive_doubling_max_bytes", 0))
SEGMENT_BYTES = _setting(
    "segment_bytes", parse_size, 256 * 1024,
    "the ring and the pipelined broadcast move data in pieces of at most this size",
    _at_least("segment_bytes", 64))
BROADCAST_PIPELINE_MIN_BYTES = _setting(
    "broadcast_pipeline_min_bytes", parse_size, 512 * 1024,
    "without a tuned table, auto broadcast of up to 4 KiB is pipelined from this size on",
    _at_least("broadcast_pipeline_min_bytes", 0))
HIERARCHICAL_MIN_BYTES = _setting(
    "hierarchical_min_bytes", parse_size, 256 * 1024,
    "on several nodes, auto allreduce and broadcast are hierarchical from this size on",
    _at_least("hierarchical_min_bytes", 0))
IPC_MIN_BYTES = _setting(
    "ipc_min_bytes", parse_size, 0,
    "on one node, auto allreduce of device tensors runs on the GPUs through CUDA IPC "
    "from this size on",
    _at_least("ipc_min_bytes", 0))
NODE_SIZE = _setting(
    "node_size", parse_size, 0,
    "0: nodes from MPI's shared-memory split; k: every k consecutive ranks form a node",
    _at_least("node_size", 0))
FUSION_THRESHOLD = _setting(
    "fusion_threshold", parse_size, 8 << 20,
    "the trainer's fusion bucket size in bytes (0: one gradient per bucket)",
    _at_least("fusion_threshold", 0), horovod=(("HOROVOD_FUSION_THRESHOLD", _same),))
STALL_CHECK_SECONDS = _setting(
    "stall_check_seconds", parse_seconds, 60.0,
    "the stall inspector reports a collective waited in this long (0: off)",
    _at_least("stall_check_seconds", 0),
    horovod=(("HOROVOD_STALL_CHECK_DISABLE", _when_on("0")),
             ("HOROVOD_STALL_CHECK_TIME_SECONDS", _same)))
STALL_SHUTDOWN_SECONDS = _setting(
    "stall_shutdown_seconds", parse_seconds, 0.0,
    "a collective waited in this long aborts the job (0: never)",
    _at_least("stall_shutdown_seconds", 0),
    horovod=(("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", _same),))
NAME_MATCH_SECONDS = _setting(
    "name_match_seconds", parse_seconds, 30.0,
    "how long ranks whose threads made calls in different orders look for a common name",
    _at_least("name_match_seconds", 0))

# Read once by ringtrain.init().
LOG_LEVEL: Variable[str | None] = _declare(Variable(
    "RINGTRAIN_LOG_LEVEL", parse_log_level, None,
    "the level of the ringtrain logger (DEBUG, INFO, WARNING, ERROR); unset: WARNING",
    horovod=(("HOROVOD_LOG_LEVEL",
              lambda text: _HOROVOD_LOG_LEVELS.get(text.strip().upper(), text)),)))
CUDA_AWARE_MPI: Variable[bool | None] = _declare(Variable(
    "RINGTRAIN_CUDA_AWARE_MPI",
    switch("MPI takes device pointers", "stage through host memory"), None,
    "1 or 0 overrides what the MPI library says of device pointers; unset: ask it",
    policy=RAISE, blank_is_unset=True))
GPU_BY_LOCAL_RANK: Variable[bool] = _declare(Variable(
    "RINGTRAIN_GPU_BY_LOCAL_RANK",
    switch("each rank uses the GPU at its local rank", "leave the choice to the application"),
    True, "1: init makes the GPU at the local rank current unless one was chosen; 0: off",
    policy=RAISE, blank_is_unset=True))
STOP_JOB_ON_EXCEPTION: Variable[bool] = _declare(Variable(
    "RINGTRAIN_STOP_JOB_ON_EXCEPTION",
    switch("an unhandled exception ends the job", "Python's own exception hook"), True,
    "1: init (in a job of several processes) makes an unhandled exception print the "
    "rank's traceback and end the job, unless the program set its own hook; 0: off",
    blank_is_unset=True))

TUNING_FILE: Variable[str | None] = _declare(Variable(
    "RINGTRAIN_TUNING_FILE", parse_text, None,
    "the tuning table init loads and ringtrain-bench --tune writes; unset: "
    "$XDG_CACHE_HOME/ringtrain/tuning.json (else ~/.cache/...); empty: none"))


def tuning_file(environ: Mapping[str, str] | None = None) -> str | None:
    """The tuning table's path: ``RINGTRAIN_TUNING_FILE``, else ``tuning.json`` under
    the user's cache directory (``$XDG_CACHE_HOME/ringtrain``, else
    ``~/.cache/ringtrain``); None when the variable is set but empty (no table)."""
    environ = os.environ if environ is None else environ
    path = TUNING_FILE.read(environ)
    if path is not None:
        return path.strip() or None
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ringtrain", "tuning.json")


# Set by ringtrain-run for the ranks.
TIMELINE: Variable[str | None] = _declare(Variable(
    "RINGTRAIN_TIMELINE", parse_text, None,
    "the job's timeline file (ringtrain-run --timeline); each rank writes its own part",
    blank_is_unset=True, set_by_launcher=True, horovod=(("HOROVOD_TIMELINE", _same),)))
ELASTIC_DIR: Variable[str | None] = _declare(Variable(
    "RINGTRAIN_ELASTIC_DIR", parse_text, None,
    "where ringtrain.elastic commits the training state (ringtrain-run --elastic-dir)",
    blank_is_unset=True, set_by_launcher=True))
TIMELINE_MERGED_BY_LAUNCHER: Variable[bool] = _declare(Variable(
    "RINGTRAIN_TIMELINE_MERGED_BY_LAUNCHER",
    switch("ringtrain-run merges the ranks' timelines", "rank 0 merges them at exit"), False,
    "1: ringtrain-run merges the ranks' timeline files; unset: rank 0 does, at exit",
    blank_is_unset=True, set_by_launcher=True))
RESTART_COUNT: Variable[int] = _declare(Variable(
    "RINGTRAIN_RESTART_COUNT", parse_count, 0,
    "how many times ringtrain-run has restarted the job (0 on the first start)",
    set_by_launcher=True))
REPORT_FD: Variable[int | None] = _declare(Variable(
    "RINGTRAIN_REPORT_FD", parse_count, None,
    "the pipe on which a rank's exception hook reports to the ringtrain-run supervisor",
    set_by_launcher=True))

# Read when ringtrain.collectives is imported.
RESULT_POOL_BYTES: Variable[int] = _declare(Variable(
    "RINGTRAIN_RESULT_POOL_BYTES", parse_size, 1 << 30,
    "bytes of freed results of 256 KiB and up kept for the next results (no page faults); "
    "0: every result from numpy"))
COMPILED_EXCHANGE: Variable[bool] = _declare(Variable(
    "RINGTRAIN_COMPILED_EXCHANGE",
    switch("the agreement's exchange runs compiled", "it runs in Python"), True,
    "1: the agreement's exchange (and the small collectives riding in it) and blocking "
    "point-to-point messages run as compiled code calling the MPI library; 0: in Python "
    "through mpi4py"))
AGREEMENT_SHARED_MEMORY: Variable[bool] = _declare(Variable(
    "RINGTRAIN_AGREEMENT_SHARED_MEMORY",
    switch("the agreement's messages within a node go through shared memory",
           "they go through MPI"), True,
    "1: where all ranks of a group share a node, the agreement's exchange (and the small "
    "collectives riding in it) passes its messages through shared memory; 0 (on any "
    "rank): through MPI"))

# Read by ringtrain.kvstore.create (RINGTRAIN_KV_SERVERS also set by ringtrain-run --servers).
KV_SERVERS: Variable[int | None] = _declare(Variable(
    "RINGTRAIN_KV_SERVERS", parse_count, None,
    "kvstore async modes: how many ranks (the last ones) serve the keys; unset: 1",
    check=_at_least("RINGTRAIN_KV_SERVERS", 1), blank_is_unset=True, set_by_launcher=True))
KV_BIGARRAY_BOUND: Variable[int] = _declare(Variable(
    "RINGTRAIN_KV_BIGARRAY_BOUND", parse_count, 1_000_000,
    "kvstore async modes: values of more elements are split across all servers",
    check=_at_least("RINGTRAIN_KV_BIGARRAY_BOUND", 1)))

# A test hook.
BENCH_INJECT_WRONG: Variable[bool] = _declare(Variable(
    "RINGTRAIN_BENCH_INJECT_WRONG",
    switch("rank 0 corrupts one checked element", "results are left as they are"), False,
    "ringtrain-bench: rank 0 corrupts one checked element (tests that errors are caught)",
    blank_is_unset=True))
