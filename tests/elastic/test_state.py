"""Elastic state and sampler in one process (a job of size 1, no launcher: the ``hvd``
fixture of tests/collectives/test_size1.py, through conftest.py)."""

from __future__ import annotations

from collections import defaultdict
from types import ModuleType

import pytest
import torch

from collectives.errors import HostsUpdatedInterrupt
from collectives.runtime import state as runtime_state
from collectives.torch import elastic


@pytest.mark.usefixtures("hvd")
def test_torch_state_commit_restore_and_sync() -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = elastic.TorchState(model=model, optimizer=optimizer, epoch=3, history=[1])
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state.epoch = 4
    state.history.append(2)
    state.commit()
    committed = model.weight.detach().clone()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    state.epoch = 5
    state.history.append(3)
    state.restore()
    assert torch.equal(model.weight, committed)
    assert (state.epoch, state.history) == (4, [1, 2])
    assert optimizer.state_dict()["state"][0]["momentum_buffer"] is not None
    state.sync()  # from rank 0: itself
    assert (state.epoch, state.history) == (4, [1, 2])
    with pytest.raises(AttributeError, match="has no attribute 'missing'"):
        _ = state.missing


@pytest.mark.usefixtures("hvd")
def test_torch_state_restores_every_model_optimizer_and_scheduler_in_place() -> None:
    model, head = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = elastic.TorchState(
        model=model, optimizer=optimizer, head=head, scheduler=scheduler, epoch=0
    )
    optimizer.step()  # (no gradients: changes nothing, but comes before the scheduler's)
    scheduler.step()
    state.commit()  # lr 0.5
    committed = head.weight.detach().clone()
    with torch.no_grad():
        head.weight.add_(1.0)
    scheduler.step()
    scheduler.step()  # lr 0.125
    state.restore()
    # The script's own objects, rolled back: nothing was swapped for a copy.
    assert state.head is head and state.scheduler is scheduler and state.optimizer is optimizer
    assert torch.equal(head.weight, committed)
    assert optimizer.param_groups[0]["lr"] == 0.5 and scheduler.last_epoch == 1
    state.scheduler.step()  # still drives the optimizer the script steps
    assert optimizer.param_groups[0]["lr"] == 0.25
    state.sync()
    assert state.scheduler is scheduler and scheduler.optimizer is optimizer


@pytest.mark.usefixtures("hvd")
def test_a_reassigned_sampler_is_the_one_a_restore_rolls_back() -> None:
    first = elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = elastic.TorchState(sampler=first)
    second = elastic.ElasticSampler(list(range(10)), shuffle=False)
    state.sampler = second  # saved as it is now: nothing processed
    second.record_batch(0, 3)
    state.commit()
    second.record_batch(1, 3)
    state.restore()
    assert state.sampler is second
    assert second.state_dict()["processed_indices"] == [0, 1, 2]
    with pytest.raises(TypeError, match="sampler holds an object of type ElasticSampler"):
        state.sampler = 3


def test_run_retries_after_a_host_update_and_restores_after_a_failure(
    hvd: ModuleType, caplog: pytest.LogCaptureFixture
) -> None:
    state = elastic.ObjectState(tries=0, value=0)
    calls: list[tuple[int, int]] = []

    @elastic.run
    def train(state: elastic.ObjectState) -> str:
        calls.append((state.tries, state.value))
        state.tries += 1
        state.value = 10
        state.commit()
        if state.tries == 1:
            state.value = 99  # not committed: rolled back
            raise hvd.HorovodInternalError("a peer died")
        return "done"

    # A job that is not elastic (size 1 without hvdrun) has no next generation to join: the
    # peer's error ends the worker, as in plain training, after the restore.
    with pytest.raises(hvd.HorovodInternalError, match="a peer died"):
        train(state)
    # (nor does it say it is restoring the last commit to go on: it does not go on)
    assert "restoring the last commit" not in caplog.text
    assert calls == [(0, 0)]
    assert (state.tries, state.value) == (1, 10)  # the last commit


def test_object_state_calls_a_bcast_object_as_horovod_does(hvd: ModuleType) -> None:
    seen: list[object] = []

    def bcast_object(obj: object) -> object:  # (Horovod calls it with the object only)
        seen.append(obj)
        return obj

    state = elastic.ObjectState(bcast_object, hvd.rank, epoch=2)
    state.sync()
    assert seen == [{"epoch": 2}]


def test_a_state_written_for_horovod_constructs_and_syncs(hvd: ModuleType) -> None:
    # Horovod's State takes (bcast_object, get_rank) and keeps them as _bcast_object and
    # _rank; a custom state written for Horovod calls them so.
    class CounterState(elastic.State):
        def __init__(self, value: int) -> None:
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)
            self.value = self.saved = value

        def save(self) -> None:
            self.saved = self.value

        def restore(self) -> None:
            self.value = self.saved

        def sync(self) -> None:
            self.value = self._bcast_object(self.value)

    state = CounterState(5)
    state.value = 7
    state.restore()
    assert state.value == 5
    state.sync()
    assert (state.value, state._rank()) == (5, 0)
    assert elastic.ObjectState(epoch=1)._rank() == 0


@pytest.mark.usefixtures("hvd")
def test_a_commit_copies_plain_data_and_keeps_other_objects_as_they_are() -> None:
    class Loader:  # (a sampler or dataset of the script's: never copied)
        def __init__(self) -> None:
            self.epoch = 0

    loader = Loader()
    weight = torch.ones(2, requires_grad=True)
    counts: defaultdict[str, list[int]] = defaultdict(list, {"steps": [1]})
    state = elastic.ObjectState(loss=None, loader=loader, metrics={"acc": [0.5]}, counts=counts)
    state.loss = (weight * 2).sum()  # a tensor of the autograd graph
    state.commit()
    state.metrics["acc"].append(0.7)
    state.counts["steps"].append(2)
    loader.epoch = 3
    state.loss = torch.zeros(())
    state.restore()
    assert state.loss.item() == 4.0 and not state.loss.requires_grad
    assert state.metrics == {"acc": [0.5]}
    assert type(state.counts) is defaultdict and state.counts == {"steps": [1]}
    assert state.loader is loader and loader.epoch == 3  # (the script's own object)


@pytest.mark.usefixtures("hvd")
def test_check_host_updates_without_news() -> None:
    state = elastic.ObjectState(x=1)
    state.check_host_updates()  # nothing newer than this generation: no interrupt
    assert issubclass(HostsUpdatedInterrupt, RuntimeError)


@pytest.mark.usefixtures("hvd")
def test_host_messages_show_the_generations_announced_since_this_workers_own() -> None:
    # Horovod scripts poll state._host_messages (a queue there) for host changes.
    state = elastic.TorchState(epoch=0)
    assert state._host_messages.empty() and state._host_messages.qsize() == 0
    live = runtime_state.current()
    assert live is not None
    live.saw_generation(live.generation + 2)  # what the rendezvous watch does on a notice
    try:
        _check_pending(state, live.generation)
    finally:
        live.newest_generation = live.generation  # (the runtime is shared by these tests)


def _check_pending(state: elastic.TorchState, generation: int) -> None:
    messages = state._host_messages
    assert not messages.empty() and len(messages) == 2
    mixed = elastic.HostUpdateResult.mixed
    assert list(messages) == [(generation + 1, mixed), (generation + 2, mixed)]
    assert not state._host_messages.empty()  # reading takes nothing away
    state._last_updated_timestamp = 0  # (Horovod's scripts reset it before they wait)
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()  # and the commit acts on them, on every rank at once


def test_elastic_sampler_resplits_the_rest_of_the_epoch() -> None:
    sampler = elastic.ElasticSampler(list(range(20)), shuffle=True, seed=1)
    sampler.set_epoch(2)
    sampler.split(num_replicas=2, rank=0)
    shards = [sampler._shard(rank) for rank in range(2)]
    assert sorted(shards[0] + shards[1]) == list(range(20))
    sampler.record_batch(0, 3)  # batch 0 of both ranks: 6 samples done
    sampler.record_batch(1, 3)  # 12 done
    done = set(shards[0][:6] + shards[1][:6])
    assert sampler.processed_indices == done
    state = sampler.state_dict()
    # three workers now: the 8 samples left, split three ways (padded to 9)
    other = elastic.ElasticSampler(list(range(20)), shuffle=True, seed=1)
    other.load_state_dict(state)
    other.split(num_replicas=3, rank=2)
    parts = [other._shard(rank) for rank in range(3)]
    assert len(other) == 3
    assert set().union(*map(set, parts)) == set(range(20)) - done
    assert list(other) == parts[2]
    sampler.set_epoch(3)
    assert sampler.processed_indices == set()


def test_elastic_sampler_keeps_horovods_order_and_loads_its_state() -> None:
    import random

    sampler = elastic.ElasticSampler(list(range(20)), shuffle=True, seed=1)
    sampler.set_epoch(2)
    sampler.split(num_replicas=2, rank=1)
    order = list(range(20))
    random.Random(1 + 2).shuffle(order)  # Horovod's shuffle of epoch 2 with seed 1
    assert list(sampler) == order[1:20:2]
    # Horovod's state after 2 batches of 3 on 2 ranks: the first 12 samples of the order
    horovods = {"epoch": 2, "processed_num": 12}
    resumed = elastic.ElasticSampler(list(range(20)), shuffle=True, seed=1)
    resumed.load_state_dict(horovods)
    assert resumed.processed_indices == set(order[:12]) and resumed.processed_num == 12
    resumed.split(num_replicas=2, rank=0)
    assert list(resumed) == order[12:20:2]
    # and the other way round: the state holds what Horovod's sampler loads
    sampler.record_batch(0, 3)
    sampler.record_batch(1, 3)
    assert sampler.state_dict()["processed_num"] == 12
    assert sampler.processed_indices == set(order[:12])
    sampler.processed_num = 4  # (Horovod's attribute, which its scripts may set)
    assert sampler.processed_indices == set(order[:4]) and len(sampler) == 8
