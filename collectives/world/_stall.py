"""The stall inspector: says which ranks a waiting collective is waiting for.

A collective starts with the agreement, where every rank waits until all ranks of the
set have entered the same call; a point-to-point call waits for its peer's matching
one. When one rank never comes (it is computing, stuck, calling something else, or
dead), the others would wait in silence. The inspector is a
daemon thread on every rank, on a communicator of its own. Every
``stall_check_seconds`` (:func:`ringtrain.configure`, or
``RINGTRAIN_STALL_CHECK_SECONDS``; default 60; 0 turns it off) that this rank has waited
in one agreement, it asks the other ranks of the set what they are doing, and logs a
warning (the ``ringtrain`` logger, rank in the line) such as::

    r0 | WARNING | allreduce of tensor 'w' (call 7 on ranks 0-3) has waited 60 s for
    rank 2, which has not called it (it is in no collective; 6 earlier calls on these
    ranks, the last 61 s ago: allreduce of tensor 'v' (call 6 on ranks 0-3)); ranks 1,3
    are waiting in it too

Ranks answer from their own inspector thread, so a rank busy computing, sleeping or
blocked in another collective still answers; one that does not answer within a few
seconds is reported as such (dead, or holding the GIL). With ``stall_shutdown_seconds``
(``RINGTRAIN_STALL_SHUTDOWN_SECONDS``) set, a rank that has waited that long logs an error
naming the missing ranks and aborts the job (every rank ends with an error instead of
waiting forever).

Cost on the data path: the collectives thread stores which call it is in (a few
attribute writes per collective); the inspector wakes a few times per check interval
and probes its own communicator. It needs MPI_THREAD_MULTIPLE (mpi4py's default).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mpi4py import MPI

from ...common.environment import STALL_SHUTDOWN_SECONDS
from .. import timeline
from ..base._activity import Activity, PeerWait, _ranks, entry
from ..logs import LOGGER

ANSWER_SECONDS = 3.0
"""How long a stalled rank waits for the others' answers."""

_QUERY, _ANSWER = 1, 2


class StallInspector:
    """The inspector thread of one rank.

    Args:
        comm: a communicator of its own over the same ranks as ringtrain's world.
        activity: what this rank's collectives are doing.
        check_seconds: report after this long in one agreement, and again every as long.
        shutdown_seconds: abort the job after this long (0: never).
    """

    def __init__(self, comm: MPI.Comm, activity: Activity, check_seconds: float,
                 shutdown_seconds: float):
        self._comm = comm
        self._rank = comm.Get_rank()
        self._activity = activity
        self._check = check_seconds
        self._shutdown = shutdown_seconds
        self._interval = min(1.0, check_seconds / 4)
        self._stop = threading.Event()
        self._reported: tuple[Any, int] | None = None
        self._thread = threading.Thread(target=self._run, name="ringtrain-stall-inspector",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (at shutdown)."""
        self._stop.set()
        self._thread.join()
        if not MPI.Is_finalized():
            self._comm.Free()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._answer_queries()
            record = self._activity.current
            waiting = entry(record) or self._activity.point_to_point
            if waiting is None:
                continue
            line = timeline.ACTIVE
            if line is not None:  # a call that waits shows on the timeline
                line.flush()
            waited = time.monotonic() - waiting.started
            if self._shutdown and waited >= self._shutdown:
                LOGGER.error("%s; aborting the job (%s=%g)",
                             self._report(waiting, waited), STALL_SHUTDOWN_SECONDS.name,
                             self._shutdown)
                for handler in LOGGER.handlers:
                    handler.flush()
                self._comm.Abort(1)
            periods = int(waited // self._check)
            if periods >= 1 and self._reported != (record or waiting, periods):
                self._reported = (record or waiting, periods)
                LOGGER.warning("%s", self._report(waiting, waited))

    def _answer_queries(self) -> None:
        status = MPI.Status()
        while self._comm.Iprobe(MPI.ANY_SOURCE, _QUERY, status):
            world_ranks = self._comm.recv(source=status.Get_source(), tag=_QUERY)
            self._comm.send(self._activity.status(world_ranks), dest=status.Get_source(),
                            tag=_ANSWER)

    def _report(self, entry: Any, waited: float) -> str:
        """Ask the other ranks of ``entry``'s set what they are doing; describe it."""
        others = [r for r in entry.world_ranks if r != self._rank]
        for rank in others:
            self._comm.isend(entry.world_ranks, dest=rank, tag=_QUERY).Free()
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + ANSWER_SECONDS
        status = MPI.Status()
        while len(answers) < len(others) and time.monotonic() < deadline:
            self._answer_queries()
            if self._comm.Iprobe(MPI.ANY_SOURCE, _ANSWER, status):
                source = status.Get_source()
                answers[source] = self._comm.recv(source=source, tag=_ANSWER)
            else:
                time.sleep(0.01)
        waiting, missing = [], []
        for rank in others:
            answer = answers.get(rank)
            current = answer and answer["current"]
            if current and current[1] == entry.world_ranks and current[2] == entry.number:
                waiting.append(rank)
            else:
                missing.append(f"rank {rank}, which {_whereabouts(answer, entry)}")
        text = f"{entry.describe()} has waited {waited:.0f} s"
        if missing:
            text += " for " + "; ".join(missing)
        if waiting:
            text += f"; {_ranks(tuple(waiting))} {'is' if len(waiting) == 1 else 'are'} " \
                    f"waiting in it too"
        return text


def _whereabouts(answer: dict[str, Any] | None, entry: Any) -> str:
    """What a missing rank said it is doing."""
    if answer is None:
        return f"did not answer within {ANSWER_SECONDS:g} s (dead, or not running Python)"
    current, peer = answer["current"], answer["point_to_point"]
    if current is not None:
        return f"is waiting in {current[0]} for {current[3]:.0f} s"
    if peer is not None:
        return f"is waiting in {peer[0]} for {peer[1]:.0f} s"
    if isinstance(entry, PeerWait):
        return "has not posted the matching call (it is in no collective or " \
               "point-to-point wait)"
    count = answer["entered"]
    text = f"has not called it (it is in no collective; {count} earlier " \
           f"call{'' if count == 1 else 's'} on these ranks"
    if answer["last"] is not None:
        text += f", the last {answer['last'][1]:.0f} s ago: {answer['last'][0]}"
    return text + ")"
