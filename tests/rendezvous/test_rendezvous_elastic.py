"""Membership generations of elastic jobs: publish, blocking Register, Watch, superseded waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from rendezvous.client import RendezvousError, RendezvousRemoved, RendezvousTimeout
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots
from tests.rendezvous.conftest import JOB_ID, SECRET, ClientFactory


@pytest.fixture
def elastic() -> Iterator[RendezvousServer]:
    with RendezvousServer(
        [], SECRET, JOB_ID, bind_host="127.0.0.1", heartbeat_interval=0.2, elastic=True
    ) as srv:
        yield srv


def test_register_waits_for_the_generation_and_follows_it(
    elastic: RendezvousServer, make_client: ClientFactory
) -> None:
    client = make_client(elastic)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(client.register("b", 0, 1, timeout=10)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # nothing published yet
    assert elastic.waiting_slots() == {("b", 0)}
    assert elastic.publish(assign_slots([("a", 1), ("b", 1)], 2)) == 1
    waiter.join(10)
    (info,) = got
    assert elastic.waiting_slots() == set()
    assert (info.rank, info.size, info.generation) == (1, 2, 1)  # type: ignore[attr-defined]
    assert elastic.registered_count() == 1
    # host a fails: b is rank 0 of generation 2
    assert elastic.publish(assign_slots([("b", 1)], 1)) == 2
    info = client.register("b", 0, 2, timeout=5)
    assert (info.rank, info.size, info.generation) == (0, 1, 2)
    with pytest.raises(RendezvousRemoved, match="not part of generation 2"):
        client.register("a", 0, 2, timeout=5)
    with pytest.raises(RendezvousTimeout, match="no membership generation 3"):
        client.register("b", 0, 3, timeout=0.2)


def test_watch_reports_new_generations(
    elastic: RendezvousServer, make_client: ClientFactory
) -> None:
    elastic.publish(assign_slots([("a", 1)], 1))
    client = make_client(elastic)
    seen: list[int] = []
    client.watch(0, lambda reason: None, lost_after=5, on_generation=seen.append)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and seen[-1] == 1
    elastic.publish(assign_slots([("a", 1), ("b", 1)], 2))
    while seen[-1] != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen[-1] == 2


def test_each_roll_call_is_heard_once_and_answers_count_from_it(
    elastic: RendezvousServer, make_client: ClientFactory
) -> None:
    elastic.publish(assign_slots([("a", 1), ("b", 1)], 2))
    client = make_client(elastic)
    heard: list[int] = []

    def answer(roll: int) -> None:  # as a worker does, from its watch thread
        heard.append(roll)
        client.set("hvdrun/present/7", str(roll).encode())

    client.watch(0, lambda reason: None, lost_after=5, on_roll_call=answer)
    time.sleep(0.3)
    assert heard == [] and elastic.present_workers(1) == set()  # no roll called yet
    assert elastic.call_roll() == 1
    deadline = time.monotonic() + 5
    while elastic.present_workers(1) != {7} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert elastic.present_workers(1) == {7}
    assert elastic.call_roll() == 2
    assert elastic.present_workers(2) == set()  # an answer to an earlier roll is not one
    while elastic.present_workers(2) != {7} and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # more heartbeats carry roll 2: it is heard once
    assert heard == [1, 2]


def test_publishing_fails_bootstrap_waits_of_older_generations(
    elastic: RendezvousServer, make_client: ClientFactory
) -> None:
    elastic.publish(assign_slots([("a", 1), ("b", 1)], 2))
    client = make_client(elastic)
    errors: list[RendezvousError] = []

    def wait_for_peer() -> None:
        try:
            client.get("hvdrun/g1/i1/0//cpu//0/1", timeout=30)
        except RendezvousError as error:
            errors.append(error)

    waiter = threading.Thread(target=wait_for_peer)
    waiter.start()
    time.sleep(0.2)
    elastic.publish(assign_slots([("a", 1)], 1))
    waiter.join(5)
    assert not waiter.is_alive()
    (error,) = errors
    assert error.code == grpc.StatusCode.ABORTED
    assert "generation 1 was superseded by generation 2" in str(error)
    # a late bootstrap of the old generation fails at once; the new one works
    with pytest.raises(RendezvousError, match="superseded"):
        client.get("hvdrun/g1/i1/other", timeout=30)
    client.set("hvdrun/g2/i1/key", b"v")
    assert client.get("hvdrun/g2/i1/key", timeout=1) == b"v"
