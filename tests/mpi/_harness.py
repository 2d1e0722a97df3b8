"""Runner and reference helpers shared by the multi-rank ringtrain test programs.

A program registers check functions with :func:`check` and calls :func:`main`. Every
rank runs the checks in the same order. After each check the ranks exchange a pass/fail
flag over ``MPI.COMM_WORLD`` (not ringtrain's communicator), so:

* a check that fails on some ranks is reported by each failing rank ("rank R: FAIL
  name" and a traceback) and by rank 0 (which ranks failed), and the program goes on
  with the next check when every rank got through the failing one;
* a rank whose check failed while other ranks are still blocked inside a collective
  aborts the whole job after ``FAIL_WAIT`` seconds instead of hanging;
* a check that does not finish within ``CHECK_TIMEOUT`` seconds prints the check's name
  and the stack of every thread, then ends the job.

The program exits with status 1 when any check failed. ``--only SUBSTRING`` runs the
checks whose names contain SUBSTRING (for debugging a single check). Several programs
may run in one launch (tests/mpi/bundle.py imports them): each check belongs to the
module that registered it, the checks run program after program, reports name them
``program: check``, and each program's summary line comes when its last check is done.

Inputs are deterministic functions of (rank, key), so every rank can compute every
other rank's input and therefore a numpy reference for every collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import hashlib
import os
import signal
import sys
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from mpi4py import MPI

import ringtrain as rt

WORLD = MPI.COMM_WORLD
CHECK_TIMEOUT = float(os.environ.get("RINGTRAIN_TEST_CHECK_TIMEOUT", "60"))
FAIL_WAIT = float(os.environ.get("RINGTRAIN_TEST_FAIL_WAIT", "15"))
SEED = 20240607

REDUCE_DTYPES = [np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.uint8,
                                       np.int16, np.int32, np.int64)]
COPY_DTYPES = REDUCE_DTYPES + [np.dtype(np.bool_)]
FLOAT_DTYPES = [d for d in REDUCE_DTYPES if d.kind == "f"]
INT_DTYPES = [d for d in REDUCE_DTYPES if d.kind in "iu"]
OPS = [rt.Average, rt.Sum, rt.Min, rt.Max, rt.Product]


# --------------------------------------------------------------------------- checks

@dataclasses.dataclass
class Check:
    name: str
    function: Callable[[], None]
    min_size: int = 1
    program: str = ""
    """The program (module) that registered it: its summary line names it."""

    @property
    def label(self) -> str:
        """How reports name the check: ``program: name`` when several programs run."""
        several = len({c.program for c in _CHECKS}) > 1
        return f"{self.program}: {self.name}" if several else self.name


_CHECKS: list[Check] = []


def check(function: Callable[[], None] | None = None, *, min_size: int = 1,
          name: str | None = None):
    """Register a check (a function of no arguments) to run in definition order.

    Args:
        min_size: skip the check when the world has fewer ranks.
        name: the name shown in reports (default: the function's name).
    """
    def register(f: Callable[[], None]) -> Callable[[], None]:
        program = f.__module__ if f.__module__ != "__main__" else \
            os.path.splitext(os.path.basename(sys.argv[0]))[0]
        _CHECKS.append(Check(name or f.__name__, f, min_size, program))
        return f

    return register(function) if function is not None else register


def log(message: str) -> None:
    print(message, flush=True)


def _on_hang(name: str) -> None:
    rank = WORLD.Get_rank()
    sys.stderr.write(f"rank {rank}: HANG check {name} did not finish within {CHECK_TIMEOUT:.0f} s;"
                     f" stacks of every thread follow\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(3)  # mpiexec then ends the other ranks


def _exchange_flags(ok: bool, name: str) -> list[bool]:
    """Every rank's pass flag for check ``name``; aborts if some rank never arrives."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    mine = np.array([1 if ok else 0], np.int8)
    everyone = np.zeros(size, np.int8)
    request = WORLD.Iallgather(mine, everyone)
    deadline = time.monotonic() + (CHECK_TIMEOUT + 5 if ok else FAIL_WAIT)
    while not request.Test():
        if time.monotonic() > deadline:
            log(f"rank {rank}: ABORT after check {name}: "
                + ("it failed here and " if not ok else "")
                + "other ranks did not finish it (they are probably blocked in a collective)")
            # MPI_Abort can end the launcher before it forwards the line just printed.
            time.sleep(0.5)
            WORLD.Abort(1)
        time.sleep(0.0005)
    return [bool(flag) for flag in everyone]


def _run_checks(checks: Sequence[Check]) -> list[Check]:
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    failed = []
    for item in checks:
        if size < item.min_size:
            if rank == 0:
                log(f"rank 0: SKIP {item.label} (needs {item.min_size} ranks)")
            continue
        watchdog = threading.Timer(CHECK_TIMEOUT, _on_hang, (item.label,))
        watchdog.daemon = True
        watchdog.start()
        start = time.perf_counter()
        try:
            item.function()
            ok = True
        except Exception:  # reported, then the ranks decide together whether to go on
            ok = False
            log(f"rank {rank}: FAIL {item.label}\n{traceback.format_exc()}")
        finally:
            watchdog.cancel()
        elapsed = time.perf_counter() - start
        flags = _exchange_flags(ok, item.label)
        if all(flags):
            if rank == 0:
                log(f"rank 0: PASS {item.label} ({elapsed:.2f} s)")
        else:
            failed.append(item)
            if rank == 0:
                bad = ",".join(str(r) for r, flag in enumerate(flags) if not flag)
                log(f"rank 0: FAIL {item.label} (failed on ranks {bad})")
    return failed


def main() -> None:
    """Initialize ringtrain, run the registered checks, shut down, exit 1 on failure."""
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks on a hang
    only = None
    if "--only" in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1]
    checks = [c for c in _CHECKS if only is None or only in c.label]
    # faulthandler's stack dumps name threads by id: this line maps them to ranks
    log(f"rank {WORLD.Get_rank()}: pid {os.getpid()}, main thread "
        f"0x{threading.main_thread().ident:016x}")
    rt.init()
    failed = []
    for program in dict.fromkeys(c.program for c in _CHECKS):  # each summed up at its end
        ran = [c for c in checks if c.program == program]
        bad = [c.name for c in _run_checks(ran)]
        failed += bad
        if WORLD.Get_rank() == 0:
            if bad:
                log(f"{program}.py np={WORLD.Get_size()}: {len(bad)} of {len(ran)} checks "
                    f"FAILED: {', '.join(bad)}")
            else:
                log(f"{program}.py np={WORLD.Get_size()}: all {len(ran)} checks passed")
    if rt.is_initialized():
        rt.shutdown()
    sys.stdout.flush()
    sys.exit(1 if failed else 0)


# --------------------------------------------------------------------------- inputs

def rng(rank: int, *key: object) -> np.random.Generator:
    """A generator that depends only on (rank, key): the same in every process."""
    words = [SEED, rank] + [zlib.crc32(repr(k).encode()) for k in key]
    return np.random.default_rng(words)


def make_input(rank: int, shape: tuple[int, ...], dtype: np.dtype, op: rt.ReduceOp | None,
               *key: object) -> np.ndarray:
    """Rank ``rank``'s input: small integers (no overflow for Sum or Product over 4 ranks),
    floats in [-1, 1] or, for Product, in [0.5, 1.5]; random bits for bool."""
    dtype = np.dtype(dtype)
    g = rng(rank, tuple(shape), dtype.str, getattr(op, "name", op), *key)
    if dtype.kind == "b":
        return g.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        if op is rt.Product:
            low, high = (0, 4) if dtype.kind == "u" else (-2, 3)
        elif op is rt.Sum:
            low, high = (0, 30) if dtype.kind == "u" else (-15, 16)
        else:
            info = np.iinfo(dtype)
            low, high = max(int(info.min), -100), min(int(info.max), 100) + 1
        return g.integers(low, high, size=shape).astype(dtype)
    if op is rt.Product:
        return g.uniform(0.5, 1.5, size=shape).astype(dtype)
    return g.uniform(-1.0, 1.0, size=shape).astype(dtype)


def all_inputs(ranks: Iterable[int], shape, dtype, op, *key) -> list[np.ndarray]:
    return [make_input(r, shape, dtype, op, *key) for r in ranks]


# --------------------------------------------------------------------------- references

def reduce_reference(inputs: Sequence[np.ndarray], op: rt.ReduceOp, prescale: float = 1.0,
                     postscale: float = 1.0) -> np.ndarray:
    """The exact reduction (float64 for floats, int64 for integers), as float64/int64."""
    dtype = inputs[0].dtype
    wide = np.float64 if dtype.kind == "f" else np.int64
    values = [np.asarray(x, wide) for x in inputs]
    if prescale != 1.0:
        # the collective scales in the input's dtype before reducing
        values = [np.asarray((x * prescale).astype(dtype), np.float64) for x in inputs]
    if op in (rt.Sum, rt.Average):
        out = np.sum(values, axis=0, dtype=wide)
    elif op is rt.Min:
        out = np.min(values, axis=0)
    elif op is rt.Max:
        out = np.max(values, axis=0)
    elif op is rt.Product:
        out = np.prod(values, axis=0, dtype=wide)
    else:
        raise AssertionError(op)
    if op is rt.Average:
        out = out / len(inputs)
    if postscale != 1.0:
        out = out * postscale
    return np.asarray(out, wide).reshape(inputs[0].shape)


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Horovod's Adasum of two float64 vectors: ``(1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b``,
    a coefficient 1 when its vector's squared norm is below 1e-8."""
    dot, norm_a, norm_b = float(a @ b), float(a @ a), float(b @ b)
    coefficient_a = 1.0 if norm_a < 1e-8 else 1.0 - dot / (2.0 * norm_a)
    coefficient_b = 1.0 if norm_b < 1e-8 else 1.0 - dot / (2.0 * norm_b)
    return coefficient_a * a + coefficient_b * b


def adasum_reference(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Horovod's Adasum over the ranks' ``vectors``, in float64, with ``vectors[0]``'s shape.

    For a power of two, Horovod's binary tree: pairs (0, 1), (2, 3), ... then pairs of
    those. Otherwise (p ranks, p2 the largest power of two below, rem = p - p2) the tree
    ringtrain documents: pairs (0, 1), ..., (2 rem - 2, 2 rem - 1) first, their results
    taking the places of those pairs, then Horovod's tree over the p2 vectors; p = 3 gives
    adasum(adasum(v0, v1), v2).
    """
    level = [np.asarray(v, np.float64).reshape(-1) for v in vectors]
    p2 = 1 << (len(level).bit_length() - 1)
    rem = len(level) - p2
    level = [adasum_pair(level[2 * i], level[2 * i + 1]) for i in range(rem)] + level[2 * rem:]
    while len(level) > 1:
        level = [adasum_pair(a, b) for a, b in zip(level[0::2], level[1::2])]
    return level[0].reshape(np.shape(vectors[0]))


TOLERANCE = {
    np.dtype(np.float16): (1e-2, 1e-2),
    np.dtype(np.float32): (2e-5, 1e-5),
    np.dtype(np.float64): (1e-12, 1e-12),
}


def assert_reduced(actual: np.ndarray, expected: np.ndarray, dtype: np.dtype, what: str) -> None:
    """``actual`` has ``expected``'s shape, the given dtype and (nearly) its values."""
    dtype = np.dtype(dtype)
    assert isinstance(actual, np.ndarray), f"{what}: result is a {type(actual).__name__}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, \
        f"{what}: shape {actual.shape}, expected {expected.shape}"
    if dtype.kind == "f":
        rtol, atol = TOLERANCE[dtype]
        if not np.allclose(actual.astype(np.float64), expected, rtol=rtol, atol=atol):
            bad = np.argwhere(~np.isclose(actual.astype(np.float64), expected, rtol=rtol,
                                          atol=atol))
            where = tuple(bad[0]) if bad.size else ()
            raise AssertionError(
                f"{what}: {len(bad)} of {actual.size} values differ beyond rtol={rtol} "
                f"atol={atol}; first at {where}: got {actual[where]!r}, "
                f"expected {expected[where]!r}")
    else:
        wanted = expected.astype(dtype)
        assert np.array_equal(wanted, expected), f"{what}: reference overflowed {dtype}"
        if not np.array_equal(actual, wanted):
            bad = np.argwhere(actual != wanted)
            where = tuple(bad[0])
            raise AssertionError(f"{what}: {len(bad)} of {actual.size} values differ; first at "
                                 f"{where}: got {actual[where]!r}, expected {wanted[where]!r}")


def assert_equal_arrays(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Same dtype, shape and bytes (for data that is only moved, never combined)."""
    assert isinstance(actual, np.ndarray), f"{what}: result is a {type(actual).__name__}"
    assert actual.dtype == expected.dtype, \
        f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, \
        f"{what}: shape {actual.shape}, expected {expected.shape}"
    if not np.array_equal(actual, expected):
        bad = np.argwhere(actual != expected)
        where = tuple(bad[0]) if bad.size else ()
        raise AssertionError(f"{what}: {len(bad)} of {actual.size} values differ; first at "
                             f"{where}: got {actual[where]!r}, expected {expected[where]!r}")


class Digests:
    """Collects digests of results, then checks that every rank got the same bytes.

    ``verify`` makes one exchange over ``comm`` (default ``MPI.COMM_WORLD``) for all the
    results collected, so bit-identity is checked for every call at little cost.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[str, str]] = []

    def add(self, what: str, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array)
        digest = hashlib.blake2b(data.tobytes() + repr((data.dtype.str, data.shape)).encode(),
                                 digest_size=12).hexdigest()
        self.entries.append((what, digest))

    def verify(self, comm: MPI.Comm = WORLD, ranks: Sequence[int] | None = None) -> None:
        everyone = comm.allgather(self.entries)
        ranks = list(range(comm.Get_size())) if ranks is None else list(ranks)
        mine = self.entries
        for r, theirs in zip(ranks, everyone):
            assert len(theirs) == len(mine), "ranks checked different numbers of results"
            for (what, digest), (their_what, their_digest) in zip(mine, theirs):
                assert what == their_what, f"results out of step: {what} vs {their_what}"
                assert digest == their_digest, (
                    f"{what}: result bytes differ between this rank ({WORLD.Get_rank()}) and "
                    f"rank {r}: ringtrain's algorithms must give bit-identical results")
        self.entries = []


def same_on_all_ranks(value: object, what: str, comm: MPI.Comm = WORLD) -> None:
    """Assert every rank of ``comm`` has an equal ``value``."""
    everyone = comm.allgather(value)
    for r, theirs in enumerate(everyone):
        assert theirs == value, f"{what}: rank {r} has {theirs!r}, this rank has {value!r}"


@contextlib.contextmanager
def replaced(owner: object, name: str, value: object):
    """``owner.name`` is ``value`` for the block (a module's function, to refuse a route or
    to take another), then what it was."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def refused(*arguments: object, **keywords: object) -> None:
    """Stands in for a route that must not be taken."""
    raise AssertionError("a route that must not run ran")


def declined(*arguments: object, **keywords: object) -> bool:
    """Stands in for a compiled route that declines (returns False): its fallback runs."""
    return False


@contextlib.contextmanager
def configured(**overrides):
    """Apply ``rt.configure(**overrides)`` for the block, then restore the settings."""
    saved = dataclasses.asdict(rt.current_settings())
    rt.configure(**overrides)
    try:
        yield rt.current_settings()
    finally:
        rt.configure(**saved)


def expect_raises(exception: type[BaseException], function: Callable, *args,
                  match: Sequence[str] = (), **kwargs) -> BaseException:
    """Call ``function``; assert it raises ``exception`` whose message holds every ``match``."""
    try:
        function(*args, **kwargs)
    except exception as error:
        text = str(error)
        for part in match:
            assert part in text, f"{type(error).__name__} message {text!r} lacks {part!r}"
        return error
    except Exception as error:
        raise AssertionError(f"{getattr(function, '__name__', function)} raised "
                             f"{type(error).__name__}: {error}; expected "
                             f"{exception.__name__}") from error
    raise AssertionError(f"{getattr(function, '__name__', function)} did not raise "
                         f"{exception.__name__}")


def noncontiguous_views(dtype, op, rank: int, key: object) -> list[np.ndarray]:
    """Non-contiguous arrays (strided, transposed, sliced) filled with rank's input."""
    views = []
    a = make_input(rank, (26,), dtype, op, key, "strided")
    views.append(a[::2])
    b = make_input(rank, (5, 7), dtype, op, key, "transposed")
    views.append(b.T)
    c = make_input(rank, (4, 9), dtype, op, key, "sliced")
    views.append(c[1:, ::2])
    for v in views:
        assert not v.flags.c_contiguous
    return views
