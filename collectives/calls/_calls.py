"""What every collective does around its algorithm: order the call, trace it, wrap errors."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from .. import timeline
from ..agreement._agreement import agree
from ..agreement._call import Call
from ..base._activity import ACTIVITY, entry
from ..base._buffers import Restore
from ..base._executor import Handle
from ..base._tracing import call_span
from ..errors import (CommunicationError, InvalidArgumentError, RingtrainError,
                      UnsupportedDtypeError, subject)
from ..logs import LOGGER, log_call
from ..world._process_sets import ProcessSet, resolve_group
from ..world._world import mpi_thread_serialized, world

LOCAL_REFUSALS = (InvalidArgumentError, UnsupportedDtypeError)
"""What a rank refuses on its own, before communicating: bad arguments, a bad dtype."""


def execute(collective: str, name: str | None, body: Callable[[], Any],
            asynchronous: bool = False, restore: Restore | None = None,
            process_set: ProcessSet | None = None) -> Any:
    """Run ``body`` in program order; return its result, or a :class:`Handle` if asynchronous.

    ``restore`` turns the result into what the caller gets (see :mod:`._buffers`). A
    named call on ``process_set`` that waits for its turn behind another thread's can be
    matched by name (see :mod:`._name_matching`).
    """
    if restore is not None:
        body = _restored(body, restore)
    if not asynchronous:
        return run_validated(collective, name, process_set, body)
    if not mpi_thread_serialized():
        raise RingtrainError(
            f"{subject(collective + '_async', name)}: MPI was initialized without "
            f"thread support (MPI_THREAD_SERIALIZED or better is needed); leave "
            f"mpi4py.rc.thread_level at its default 'multiple'")
    return world().executor.submit(_guarded, (collective, name, body), collective, name,
                                   None if name is None else (name, process_set))


def collective_call(collective: str, name: str | None, process_set: ProcessSet | None,
                    prepare: Callable[[], Callable[[], Any]], asynchronous: bool = False,
                    restore: Restore | None = None) -> Any:
    """Validate a collective with ``prepare()`` and run the body it returns, as
    :func:`execute` does.

    A call this rank refuses (``prepare`` raises one of :data:`LOCAL_REFUSALS`) still
    takes part in the agreement, carrying the reason, so that the other ranks, whose
    calls were valid, raise a :class:`~ringtrain.MismatchError` naming this rank and why
    in the same round trip instead of waiting for it; this rank raises its own error.
    Nothing more is sent when every rank's call is valid.
    """
    try:
        body = prepare()
    except LOCAL_REFUSALS as error:
        refusal = _refusal(collective, name, process_set, error)
        if refusal is None:
            raise
        if asynchronous:
            execute(collective, name, refusal, asynchronous=True, process_set=process_set)
            raise
        return execute(collective, name, refusal, process_set=process_set)
    return execute(collective, name, body, asynchronous, restore, process_set)


def _refusal(collective: str, name: str | None, process_set: ProcessSet | None,
             error: RingtrainError) -> Callable[[], Any] | None:
    """The body that tells the other ranks of ``error`` through the agreement, then
    raises it; None where there is no one to tell."""
    try:
        group = resolve_group(process_set, collective, name)
    except RingtrainError:
        return None
    if group.size == 1:
        return None
    call = Call(collective=collective.rstrip("_"), name=name, refused=str(error))

    def refuse() -> Any:
        try:
            agree(group, call)
        except RingtrainError:  # the others' calls differ: they raise, this rank says why
            pass
        raise error

    return refuse


def run_validated(collective: str, name: str | None, process_set: ProcessSet | None,
                  body: Callable[..., Any], *args: Any) -> Any:
    """Run ``body(*args)``, a blocking call already validated, in program order (as
    :func:`execute` runs a blocking call's body); return its result."""
    executor = world().executor
    match_key = None if name is None else (name, process_set)
    if timeline.ACTIVE is None and not LOGGER.isEnabledFor(logging.DEBUG):
        try:
            return executor.run(body, args, collective, name, match_key)
        except MPI.Exception as error:
            raise _failed(collective, name, error) from error
    return executor.run(_guarded, (collective, name, body, *args), collective, name,
                        match_key)


def _restored(body: Callable[[], Any], restore: Restore) -> Callable[[], Any]:
    return lambda: restore(body())


def _guarded(collective: str, name: str | None, body: Callable[..., Any], *args: Any) -> Any:
    """``body(*args)``, traced on the timeline and logged where they are on, its MPI
    errors named."""
    line = timeline.ACTIVE
    if line is None:
        return _named(collective, name, body, args)
    with call_span(line, collective, name):
        return _named(collective, name, body, args)


def _named(collective: str, name: str | None, body: Callable[..., Any], args: tuple) -> Any:
    """``body(*args)``, its MPI errors named; logged where debug logging is on."""
    if not LOGGER.isEnabledFor(logging.DEBUG):
        try:
            return body(*args)
        except MPI.Exception as error:
            raise _failed(collective, name, error) from error
    before, start = ACTIVITY.last, time.perf_counter()
    try:
        return body(*args)
    except MPI.Exception as error:
        raise _failed(collective, name, error) from error
    finally:
        if ACTIVITY.last is not before and LOGGER.isEnabledFor(logging.DEBUG):
            log_call(entry(ACTIVITY.last), world().group.world_rank,
                     time.perf_counter() - start)


def _failed(collective: str, name: str | None, error: MPI.Exception) -> CommunicationError:
    return CommunicationError(f"{subject(collective, name)}: MPI failed: {error}")


def poll(handle: Handle) -> bool:
    """Whether the asynchronous collective behind ``handle`` has finished (from any thread).

    Args:
        handle: returned by one of the ``*_async`` functions.
    """
    return handle.done()


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous collective and return its result (from any thread).

    Args:
        handle: returned by one of the ``*_async`` functions.

    Returns:
        What the blocking form of the collective returns.

    Raises:
        Whatever the collective raised (e.g. :class:`~ringtrain.MismatchError`).
    """
    return handle.wait()
