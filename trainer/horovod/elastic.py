"""Horovod's elastic API (``hvd.elastic``) on ringtrain's restart-based elastic training.

A Horovod elastic script runs unchanged::

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, batch=0)
    state.register_reset_callbacks([rescale_learning_rate])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch, (data, target) in enumerate(loader):
                ...
                state.sampler.record_batch(batch, batch_size)
                state.commit()
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

How it maps: under ``ringtrain-run --max-restarts K`` a failed rank makes the launcher
start the whole job again, possibly with another number of ranks (the ranks of a job
never change while it runs). :meth:`State.commit` keeps the values in memory (as
Horovod's) and also writes them through :mod:`ringtrain.elastic`'s checkpoint; when the
job starts again, :func:`run` restores the last commit from it, makes every rank hold
rank 0's values (:meth:`State.sync`), runs the reset callbacks (the job was restarted,
perhaps resized), and calls the training function, which goes on from the committed
epoch and batch. Under ``ringtrain-run --host-discovery-script``, when the hosts change
while the job runs, the next :meth:`State.commit` (or :meth:`State.check_host_updates`)
raises :class:`HostsUpdatedInterrupt` on every rank once that commit is on disk; it ends
the process quietly (it is a ``SystemExit`` with status 0), and the launcher starts the
job on the new hosts, where :func:`run` restores that commit and runs the reset
callbacks with the new size.

:class:`ElasticSampler` fixes each epoch's order by its seed and the epoch, and after a
restart hands out the samples of that order not yet processed, in order, split over the
ranks of the new job: no sample is given twice and none is lost. With as many ranks as
before, the batches are exactly those an uninterrupted run would have had.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from ... import collectives
from .. import elastic as _elastic
from ._handles import HorovodInternalError
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)

Result = TypeVar("Result")


class HostsUpdatedInterrupt(_elastic.HostsChanged):
    """The set of hosts changed (Horovod's name): the job stops at the last commit and
    ringtrain-run starts it again on the new hosts (see
    :class:`ringtrain.elastic.HostsChanged`, which it is).

    Attributes:
        skip_sync: whether the state may skip its synchronisation after the change
            (Horovod's; the restarted job always synchronises).
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__()
        self.skip_sync = skip_sync


class State:
    """What an elastic training function keeps between commits (Horovod's base class).

    Subclasses say how their values are saved in memory (:meth:`save`), put back
    (:meth:`restore`), made equal on every rank (:meth:`sync`), and given to the
    checkpoint (:meth:`state_dict`, :meth:`load_state_dict`: the last saved values).
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._checkpoint = _elastic.State(horovod_state=self)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call ``callbacks`` (no arguments) after the job was restarted, before training
        goes on: e.g. to scale the learning rate by the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks, in the order they were registered."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the values in memory and in the checkpoint (every rank must call it; the
        file is written in the background), then check for host updates.

        Raises:
            HostsUpdatedInterrupt: on every rank, when the hosts changed (the commit is
                then on disk).
        """
        self.save()
        try:
            self._checkpoint.commit()
        except _elastic.HostsChanged:
            raise HostsUpdatedInterrupt() from None

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank when ringtrain-run found
        other hosts (every rank must call it); the job resumes from the last commit.

        Raises:
            HostsUpdatedInterrupt: when the hosts changed.
        """
        try:
            self._checkpoint.check_host_updates()
        except _elastic.HostsChanged:
            raise HostsUpdatedInterrupt() from None

    def restore_commit(self) -> bool:
        """Load the last committed values from the checkpoint, on every rank; False when
        there is none (a first start)."""
        return self._checkpoint.restore()

    def save(self) -> None:
        """Keep the current values in memory as the last committed ones."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put back the values last saved."""
        raise NotImplementedError

    def sync(self) -> None:
        """Give every rank rank 0's values (collective), and save them."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The values last saved, as the checkpoint stores them."""
        raise NotImplementedError

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take ``saved`` (from :meth:`state_dict`) as the last saved values, and restore
        them."""
        raise NotImplementedError


class ObjectState(State):
    """Picklable values as attributes: ``ObjectState(epoch=0, batch=0)``, then
    ``state.epoch``; only the names given here are saved."""

    def __init__(self, **values: Any) -> None:
        super().__init__()
        self._saved = dict(values)
        for name, value in values.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._save_values()

    def restore(self) -> None:
        self._restore_values()

    def sync(self) -> None:
        self._save_values()
        self._saved = broadcast_object(self._saved, root_rank=0, name="elastic.sync")
        self._restore_values()

    def _save_values(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._saved}

    def _restore_values(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def state_dict(self) -> dict[str, Any]:
        return {"objects": self._saved}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._saved = dict(saved["objects"])
        self.restore()


class TorchState(ObjectState):
    """A model, its optimizer, :class:`ElasticSampler`s and other values (Horovod's
    ``TorchState(model, optimizer, **kwargs)``).

    The model's and the optimizer's ``state_dict()`` are copied on :meth:`save` and
    loaded back on :meth:`restore`; :meth:`sync` broadcasts rank 0's parameters and
    optimizer state. A sampler's processed samples are those of every rank: :meth:`save`
    and :meth:`sync` gather them.
    """

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **values: Any) -> None:
        self.model = model
        self.optimizer = optimizer
        self._samplers = {name: value for name, value in values.items()
                          if isinstance(value, ElasticSampler)}
        super().__init__(**{name: value for name, value in values.items()
                            if name not in self._samplers})
        for name, sampler in self._samplers.items():
            setattr(self, name, sampler)
        self._model_state: dict[str, Any] | None = None
        self._optimizer_state: dict[str, Any] | None = None
        self._sampler_states: dict[str, dict[str, Any]] = {}
        self._save_tensors()

    def save(self) -> None:
        """Gathers the samplers' processed samples (collective), then saves."""
        for sampler in self._samplers.values():
            sampler.gather_processed()
        self._save_tensors()
        self._save_values()

    def restore(self) -> None:
        if self.model is not None and self._model_state is not None:
            self.model.load_state_dict(self._model_state)
        if self.optimizer is not None and self._optimizer_state is not None:
            self.optimizer.load_state_dict(self._optimizer_state)
        for name, saved in self._sampler_states.items():
            self._samplers[name].load_state_dict(saved)
        self._restore_values()

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for sampler in self._samplers.values():
            sampler.load_state_dict(broadcast_object(sampler.state_dict(), root_rank=0,
                                                     name="elastic.sampler"))
        self._save_tensors()
        super().sync()

    def _save_tensors(self) -> None:
        """Copy the model's, the optimizer's and the samplers' states."""
        if self.model is not None:
            self._model_state = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_state = copy.deepcopy(self.optimizer.state_dict())
        self._sampler_states = {name: sampler.state_dict()
                                for name, sampler in self._samplers.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self._model_state, "optimizer": self._optimizer_state,
                "samplers": self._sampler_states, **super().state_dict()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._model_state = saved["model"]
        self._optimizer_state = saved["optimizer"]
        self._sampler_states = dict(saved["samplers"])
        super().load_state_dict(saved)


class ElasticSampler(torch.utils.data.Sampler):
    """Hands this rank its share of the samples of the epoch not yet processed (Horovod's
    ``ElasticSampler(dataset, shuffle=True, seed=0)``).

    The epoch's order is a permutation of the dataset seeded by ``seed + epoch`` (the
    dataset's order without ``shuffle``); the samples not yet processed keep that order,
    and rank r of n takes every n-th from the r-th on, so shares differ by at most one
    sample and none is given twice. Record what a step processed with
    :meth:`record_batch` (or :meth:`record_indices`); :meth:`set_epoch` starts an epoch
    with nothing processed.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self._recorded: set[int] = set()
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: its order, nothing processed."""
        self.epoch = epoch
        self.processed_indices = set()
        self._recorded = set()
        self.reset()

    def get_indices(self, batch_index: int, batch_size: int) -> list[int]:
        """The samples of this rank's batch ``batch_index`` (of ``batch_size``)."""
        start = batch_index * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_index: int, batch_size: int) -> None:
        """Mark this rank's batch ``batch_index`` (of ``batch_size``) processed."""
        self.record_indices(self.get_indices(batch_index, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark samples processed by this rank."""
        self._recorded.update(int(i) for i in indices)

    def gather_processed(self) -> None:
        """Add the samples every rank recorded since the last call to the processed ones
        (collective); the split of the epoch is not changed until :meth:`reset`."""
        for recorded in allgather_object(sorted(self._recorded), name="elastic.processed"):
            self.processed_indices.update(recorded)
        self._recorded = set()

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the samples processed in it (as of :meth:`gather_processed`)."""
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take the epoch and processed samples of :meth:`state_dict`, and split the rest."""
        self.epoch = saved["epoch"]
        self.processed_indices = set(saved["processed_indices"])
        self._recorded = set()
        self.reset()

    def reset(self) -> None:
        """Split the samples of the epoch not yet processed over the ranks of the job."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        remaining = [index for index in order if index not in self.processed_indices]
        self.indices = remaining[collectives.rank()::collectives.size()]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


def run(train: Callable[..., Result]) -> Callable[..., Result]:
    """Wrap an elastic training function ``train(state, *args, **kwargs)`` (Horovod's
    ``@hvd.elastic.run``).

    The wrapper starts ringtrain if needed, restores the state's last commit (after a
    restart), makes every rank hold rank 0's values (:meth:`State.sync`), runs the
    reset callbacks when the job was restarted, then calls ``train``.
    """

    @functools.wraps(train)
    def restored_and_run(state: State, *args: Any, **kwargs: Any) -> Result:
        collectives.init()
        restored = state.restore_commit()
        state.sync()
        if restored or _elastic.restart_count() > 0:
            state.on_reset()
        return train(state, *args, **kwargs)

    return restored_and_run


__all__ = ["ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt", "ObjectState",
           "State", "TorchState", "run"]
