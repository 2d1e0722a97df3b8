"""hvd.elastic's ElasticSampler and states in one process, without MPI (the ranks and the
object collectives are stood in for): the split of an epoch over any number of ranks, its
continuation after a restart, and save/restore/state_dict. tests/test_horovod_elastic.py
runs them on real ranks."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ringtrain.horovod as hvd  # noqa: E402
from ringtrain import collectives  # noqa: E402
from ringtrain.trainer.horovod import elastic  # noqa: E402


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    """Rank 0 of 1, with the object collectives of one rank."""
    monkeypatch.setattr(collectives, "rank", lambda: 0)
    monkeypatch.setattr(collectives, "size", lambda: 1)
    monkeypatch.setattr(elastic, "allgather_object", lambda value, name=None: [value])
    monkeypatch.setattr(elastic, "broadcast_object",
                        lambda value, root_rank=0, name=None: value)


def shares(monkeypatch, dataset, ranks: int, state=None, **options) -> list[list[int]]:
    """Each rank's indices of an ElasticSampler of a job of ``ranks`` ranks."""
    found = []
    for rank in range(ranks):
        monkeypatch.setattr(collectives, "rank", lambda rank=rank: rank)
        monkeypatch.setattr(collectives, "size", lambda: ranks)
        sampler = hvd.elastic.ElasticSampler(dataset, **options)
        if state is not None:
            sampler.load_state_dict(state)
        found.append(list(sampler))
    return found


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_an_epoch_is_split_without_repeats_or_losses(monkeypatch, ranks):
    dataset = list(range(23))
    split = shares(monkeypatch, dataset, ranks, seed=5)
    assert sorted(i for share in split for i in share) == dataset
    assert max(map(len, split)) - min(map(len, split)) <= 1


def test_a_restart_with_as_many_ranks_continues_the_same_batches(monkeypatch):
    dataset, ranks, batch = list(range(40)), 2, 3
    before = shares(monkeypatch, dataset, ranks, seed=1)
    steps = 4
    processed = {i for share in before for i in share[:steps * batch]}
    after = shares(monkeypatch, dataset, ranks, {"epoch": 0, "processed_indices": processed},
                   seed=1)
    assert after == [share[steps * batch:] for share in before]
    fewer = shares(monkeypatch, dataset, 1, {"epoch": 0, "processed_indices": processed},
                   seed=1)
    assert sorted(fewer[0]) == sorted(set(dataset) - processed)


def test_epochs_seeds_and_order(monkeypatch):
    dataset = list(range(30))
    first = shares(monkeypatch, dataset, 1, seed=2)[0]
    assert shares(monkeypatch, dataset, 1, seed=2)[0] == first
    assert shares(monkeypatch, dataset, 1, seed=3)[0] != first
    assert shares(monkeypatch, dataset, 1, shuffle=False)[0] == dataset
    sampler = hvd.elastic.ElasticSampler(dataset, seed=2)
    sampler.record_batch(0, 4)
    sampler.gather_processed()
    assert sampler.state_dict() == {"epoch": 0, "processed_indices": set(first[:4])}
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "processed_indices": set()}
    assert list(sampler) != first and sorted(sampler) == dataset


def test_torch_state_saves_restores_and_round_trips_its_checkpoint():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), seed=0)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                   epoch=0, seen=np.zeros(3))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state.epoch, state.seen[1] = 2, 5.0
    sampler.record_indices([4, 7])
    state.save()
    saved_weight = model.weight.detach().clone()
    checkpoint = state.state_dict()
    with torch.no_grad():
        model.weight.zero_()
    state.epoch, state.seen = 9, np.ones(3)
    state.restore()
    assert torch.equal(model.weight, saved_weight)
    assert state.epoch == 2 and state.seen.tolist() == [0.0, 5.0, 0.0]
    assert sampler.state_dict()["processed_indices"] == {4, 7}
    other = hvd.elastic.TorchState(model=torch.nn.Linear(3, 2), optimizer=None,
                                   sampler=hvd.elastic.ElasticSampler(list(range(10))),
                                   epoch=0, seen=np.zeros(3))
    other.load_state_dict(checkpoint)
    assert torch.equal(other.model.weight, saved_weight) and other.epoch == 2
    assert other.sampler.state_dict()["processed_indices"] == {4, 7}


def test_object_state_and_reset_callbacks():
    state = hvd.elastic.ObjectState(epoch=1, batch=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append("a"), lambda: calls.append("b")])
    state.epoch = 4
    state.save()
    state.epoch = 7
    state.restore()
    assert state.epoch == 4
    state.sync()
    assert state.epoch == 4
    state.on_reset()
    assert calls == ["a", "b"]
    assert hvd.elastic.HostsUpdatedInterrupt(skip_sync=True).skip_sync is True


def test_one_horovod_internal_error():
    """Horovod has one HorovodInternalError; scripts catch it under either name."""
    assert hvd.HorovodInternalError is hvd.elastic.HorovodInternalError
    with pytest.raises(hvd.HorovodInternalError):
        raise hvd.elastic.HorovodInternalError("rank 1 is gone")
