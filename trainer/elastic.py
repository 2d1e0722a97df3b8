"""Restart-based elastic training: commit the training state, restore it after a restart.

Under ``ringtrain-run --max-restarts K``, a job in which a rank fails is started again
from the beginning, possibly with a different number of ranks. The training script
keeps what it must not lose in a :class:`State` and calls :meth:`State.commit` at points
where every rank agrees (e.g. after each step); after a restart, :meth:`State.restore`
(called by :func:`run`) gives every rank the last committed values, and training goes on
from there::

    import ringtrain as rt
    from ringtrain import elastic

    state = elastic.State(epoch=0, weights=np.zeros(10), optimizer=my_optimizer)

    @elastic.run
    def train(state):
        while state.epoch < 5:
            ...                       # rt.allreduce(...) of the gradients
            state.epoch += 1
            state.commit()
        return state.weights

    weights = train(state)

Rank 0 writes the checkpoint: one pickle file, ``state.pkl``, in the directory given as
``State(directory=...)``, else in ``$RINGTRAIN_ELASTIC_DIR`` (set by the launcher). The
values are taken as equal on every rank (data-parallel training), so only rank 0's are
saved. A commit copies them at once and writes the file in the background;
:meth:`State.flush` waits until the last commit is on disk.

Under ``ringtrain-run --host-discovery-script``, a job also changes size without a
failure: when the discovered hosts change, the launcher says so, and at the next
:meth:`State.commit` (or :meth:`State.check_host_updates`) every rank raises
:class:`HostsChanged`, which ends the process with status 0 once that commit is on disk;
the launcher then starts the job on the new hosts, where :meth:`State.restore` resumes
from that commit (see :mod:`ringtrain.common.resize_protocol`). No step is lost and no rank is
killed mid-step.

``import ringtrain.elastic`` (or ``from ringtrain import elastic``) imports neither
mpi4py nor the collectives; they are imported when a :class:`State` is first committed
or restored.
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ..common.atomic_file import write_atomically
from ..common.environment import ELASTIC_DIR, RESTART_COUNT
from ..common.resize_protocol import HOSTS_UPDATED, RESIZING, is_marked, path_in

ELASTIC_DIR_VARIABLE = ELASTIC_DIR.name
RESTART_COUNT_VARIABLE = RESTART_COUNT.name
CHECKPOINT_NAME = "state.pkl"
_FORMAT = 1

Result = TypeVar("Result")


class ElasticError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the file."""


class HostsChanged(SystemExit):
    """Raised on every rank by :meth:`State.commit` and :meth:`State.check_host_updates`
    when ``ringtrain-run`` found other hosts: the job stops at this commit, which is on
    disk, and starts again on the new hosts from it. A ``SystemExit`` with status 0, so
    an uncaught one ends the process quietly (``finally`` blocks run); catch it only to
    clean up, and let it go on."""

    def __init__(self) -> None:
        super().__init__(0)


def restart_count() -> int:
    """How many times the launcher has restarted this job (0 on the first start, and
    outside ``ringtrain-run``)."""
    return RESTART_COUNT.read()


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


class State:
    """The values a training run must not lose: attributes saved by :meth:`commit`.

    ``State(epoch=0, step=0, model=model, optimizer=optimizer)``: every keyword becomes
    an attribute (``state.epoch``, ``state.epoch = 3``); attributes assigned later are
    saved too. An object with ``state_dict()`` and ``load_state_dict()`` (a PyTorch
    module or optimizer, or any class of yours) is saved through them and restored into
    the same object; any other value (numbers, numpy arrays, dicts, ...) must be
    picklable and is replaced by the saved copy on restore, so read it from the state
    again after :meth:`restore`.

    Args:
        directory: where the checkpoint file lives; default ``$RINGTRAIN_ELASTIC_DIR``.
            With neither, :meth:`commit` saves nothing (it warns once) and
            :meth:`restore` finds nothing.
        **values: the initial values.
    """

    def __init__(self, *, directory: str | None = None, **values: Any) -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_directory",
                           directory or ELASTIC_DIR.read())
        object.__setattr__(self, "_warned", False)

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__["_values"]
        if name in values:
            return values[name]
        raise AttributeError(f"State has no value {name!r}; it holds {sorted(values)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            raise AttributeError(f"State values cannot start with '_': {name!r}")
        self._values[name] = value

    def __repr__(self) -> str:
        return f"State({', '.join(sorted(self._values))})"

    @property
    def checkpoint_path(self) -> str | None:
        """The checkpoint file, or None when no directory was given."""
        if self._directory is None:
            return None
        return os.path.join(self._directory, CHECKPOINT_NAME)

    def snapshot(self) -> dict[str, Any]:
        """The values as they are saved: ``state_dict()`` for objects that have one."""
        saved = {}
        for name, value in self._values.items():
            if _has_state_dict(value):
                saved[name] = ("state_dict", value.state_dict())
            else:
                saved[name] = ("value", value)
        return {"format": _FORMAT, "values": saved}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Take the values of a :meth:`snapshot` (objects with ``load_state_dict`` load
        theirs; other values are replaced)."""
        for name, (kind, saved) in snapshot["values"].items():
            current = self._values.get(name)
            if kind == "state_dict" and _has_state_dict(current):
                current.load_state_dict(saved)
            else:
                self._values[name] = saved

    def commit(self) -> None:
        """Save the state: rank 0 copies it now and writes it to disk in the background.

        Every rank must call it (a ShardedOptimizer among the values gathers its full
        state for rank 0 then). Rank 0 copies the values before the call returns, so
        training may change them at once, and pickles them into the file on a thread of its own
        (atomically: :func:`write_atomically`), so a step is not held by the disk. A
        commit waits for the previous commit's write to finish first (none is skipped),
        and every rank learns whether that write worked: a write that failed raises at
        the next commit, or at :meth:`flush`. Until the write is done the file holds the
        previous commit, which a restart after a crash would resume from.

        Under ``ringtrain-run`` with a host discovery script, a commit also looks for
        a change of hosts, as :meth:`check_host_updates` does (no extra message).

        Raises:
            ElasticError: the previous commit's checkpoint could not be written, or this
                one could not be copied (on every rank).
            HostsChanged: on every rank, when the hosts changed (after this commit is
                on disk).
        """
        from .. import collectives

        collectives.init()
        for value in self._values.values():
            # A sharded optimizer gathers its full state on rank 0 (every rank takes part).
            consolidate = getattr(value, "consolidate_state_dict", None)
            if callable(consolidate):
                consolidate()
        error, changed = None, False
        if collectives.rank() == 0:
            error = _writer_of(self.checkpoint_path).wait() or self._start_write()
            changed = _hosts_updated()
        error, changed = collectives.broadcast_object((error, changed), root_rank=0,
                                                      name="elastic.commit")
        if error is not None:
            raise ElasticError(error)
        if changed:
            self._stop_for_resize()

    def check_host_updates(self) -> None:
        """Stop for a resize (:class:`HostsChanged`) if the launcher found other hosts
        since the job started; every rank must call it. The job resumes from the last
        commit (which this writes to disk first).

        Raises:
            HostsChanged: on every rank, when the hosts changed.
        """
        from .. import collectives

        collectives.init()
        changed = _hosts_updated() if collectives.rank() == 0 else False
        if collectives.broadcast_object(changed, root_rank=0, name="elastic.hosts"):
            self._stop_for_resize()

    def _stop_for_resize(self) -> None:
        """Flush the last commit, mark the job as stopped for a resize, end it."""
        from .. import collectives

        self.flush()
        if collectives.rank() == 0:
            write_atomically(path_in(ELASTIC_DIR.read(), RESIZING), b"")
        raise HostsChanged()

    def flush(self) -> None:
        """Return on every rank once the last commit is on disk (every rank must call it).

        Raises:
            ElasticError: it could not be written (on every rank).
        """
        from .. import collectives

        collectives.init()
        error = _writer_of(self.checkpoint_path).wait() if collectives.rank() == 0 else None
        error = collectives.broadcast_object(error, root_rank=0, name="elastic.flush")
        if error is not None:
            raise ElasticError(error)

    def _start_write(self) -> str | None:
        """Pickle the values and start writing them; an error message, or None."""
        path = self.checkpoint_path
        if path is None:
            if not self._warned:
                object.__setattr__(self, "_warned", True)
                warnings.warn(f"no checkpoint directory (State(directory=...) or "
                              f"${ELASTIC_DIR_VARIABLE}): commits are not saved", stacklevel=4)
            return None
        try:
            snapshot = copy.deepcopy(self.snapshot())
        except Exception as error:  # reported to every rank, raised there
            return f"cannot commit the elastic state to {path}: {type(error).__name__}: {error}"
        _writer_of(path).start(snapshot)
        return None

    def restore(self) -> bool:
        """Load the last commit, if there is one, on every rank.

        Rank 0 reads the checkpoint and broadcasts it; every rank loads it. Every rank
        must call it.

        Returns:
            Whether a commit was found and loaded.

        Raises:
            ElasticError: the checkpoint exists but cannot be read (on every rank).
        """
        from .. import collectives

        collectives.init()
        found: tuple[str, Any] = ("none", None)
        if collectives.rank() == 0:
            found = self._read()
        kind, payload = collectives.broadcast_object(found, root_rank=0, name="elastic.restore")
        if kind == "error":
            raise ElasticError(payload)
        if kind == "none":
            return False
        self.load_snapshot(payload)
        return True

    def _read(self) -> tuple[str, Any]:
        path = self.checkpoint_path
        if path is not None:
            _writer_of(path).wait()  # this process's own last commit first
        if path is None or not os.path.exists(path):
            return "none", None
        try:
            with open(path, "rb") as handle:
                snapshot = pickle.load(handle)
            if not isinstance(snapshot, dict) or snapshot.get("format") != _FORMAT:
                raise ValueError("not a ringtrain elastic checkpoint")
        except Exception as error:
            return "error", f"cannot restore the elastic state from {path}: " \
                            f"{type(error).__name__}: {error}"
        return "snapshot", snapshot


def _hosts_updated() -> bool:
    """Whether the launcher has said that the hosts changed (read on rank 0)."""
    return is_marked(ELASTIC_DIR.read(), HOSTS_UPDATED)


class _BackgroundWriter:
    """Writes one checkpoint file on a thread of its own, one write at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def start(self, snapshot: dict[str, Any]) -> None:
        """Start pickling ``snapshot`` into the file (after the write in progress, if any,
        has finished); ``snapshot`` must not change until then."""
        self.wait()
        self._thread = threading.Thread(target=self._write, args=(snapshot,),
                                        name="ringtrain-elastic-commit")
        self._thread.start()

    def wait(self) -> str | None:
        """Wait for the write in progress; its error message, or None (reported once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error

    def _write(self, snapshot: dict[str, Any]) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_atomically(self.path, lambda file: pickle.dump(
                snapshot, file, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as error:  # reported at the next commit, on every rank
            self._error = (f"cannot commit the elastic state to {self.path}: "
                           f"{type(error).__name__}: {error}")


_writers: dict[str | None, _BackgroundWriter] = {}


def _writer_of(path: str | None) -> _BackgroundWriter:
    """The writer of checkpoint ``path`` in this process (one per file)."""
    writer = _writers.get(path)
    if writer is None:
        writer = _writers[path] = _BackgroundWriter(path or "")
    return writer


def run(train: Callable[[State], Result]) -> Callable[[State], Result]:
    """Wrap a training function: ``run(train)(state)`` (or ``@run`` on ``train``).

    The wrapper starts ringtrain (``ringtrain.init()``) if it has not been, restores
    the state's last commit (if any) on every rank, then calls ``train(state)`` and
    returns what it returns.
    """

    @functools.wraps(train)
    def restored_and_run(state: State) -> Result:
        from .. import collectives

        collectives.init()
        state.restore()
        return train(state)

    return restored_and_run


__all__ = ["State", "run", "restart_count", "write_atomically", "ElasticError", "HostsChanged",
           "ELASTIC_DIR_VARIABLE", "RESTART_COUNT_VARIABLE", "CHECKPOINT_NAME"]
