"""Jobs another launcher placed: ranks register with the rank srun/mpirun/torchrun gave them,
and the server derives local and cross ranks from the hosts they came from."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator

import pytest

from rendezvous.client import RankInfo, RendezvousClient, RendezvousError, RendezvousTimeout
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots, derive_slots
from tests.rendezvous.conftest import JOB_ID, SECRET, ClientFactory


def test_derive_slots_matches_hvdruns_own_assignment() -> None:
    hosts = ["a", "a", "b", "b", "c"]
    derived = derive_slots(hosts, [None] * 5)
    assert derived == assign_slots([("a", 2), ("b", 2), ("c", 1)], 5)


def test_derive_slots_cyclic_placement() -> None:
    # srun -m cyclic: ranks alternate between the nodes.
    slots = derive_slots(["n1", "n2", "n1", "n2"], [0, 0, 1, 1])
    assert [(s.hostname, s.local_rank, s.local_size) for s in slots] == [
        ("n1", 0, 2),
        ("n2", 0, 2),
        ("n1", 1, 2),
        ("n2", 1, 2),
    ]
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (1, 2), (0, 2), (1, 2)]


def test_derive_slots_uneven_hosts() -> None:
    slots = derive_slots(["a", "b", "b", "b"], [None] * 4)
    assert [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 1, 0, 2),
        (0, 3, 1, 2),
        (1, 3, 0, 1),
        (2, 3, 0, 1),
    ]


def test_derive_slots_rejects_local_ranks_that_do_not_add_up() -> None:
    # Two machines that both call themselves "localhost".
    with pytest.raises(ValueError, match=r"2 ranks registered from host 'localhost'.*share"):
        derive_slots(["localhost", "localhost"], [0, 0])
    # LOCAL_RANK set on some ranks only: said so, not a guess about shared host names.
    with pytest.raises(
        ValueError, match=r"a local rank .* to some of them but not to rank\(s\) \[0\]: set it"
    ):
        derive_slots(["localhost", "localhost"], [None, 1])


@pytest.fixture
def placed() -> Iterator[RendezvousServer]:
    with RendezvousServer(
        [], SECRET, JOB_ID, bind_host="127.0.0.1", heartbeat_interval=0.2, placed_size=4
    ) as server:
        yield server


def _register_all(
    server: RendezvousServer, make_client: ClientFactory, hosts: list[str], timeout: float = 10
) -> dict[int, RankInfo | BaseException]:
    results: dict[int, RankInfo | BaseException] = {}

    def register(rank: int) -> None:
        client = make_client(server)
        try:
            results[rank] = client.register(hosts[rank], -1, timeout=timeout, rank=rank)
        except BaseException as error:
            results[rank] = error

    threads = [threading.Thread(target=register, args=(r,)) for r in range(len(hosts))]
    for thread in reversed(threads):  # the highest rank first: registration order is free
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def test_every_rank_learns_its_place_once_all_registered(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    results = _register_all(placed, make_client, ["n2", "n1", "n2", "n1"])
    infos = [results[r] for r in range(4)]
    assert all(isinstance(info, RankInfo) for info in infos), infos
    assert [(i.rank, i.size, i.local_rank, i.local_size, i.cross_rank) for i in infos] == [  # type: ignore[union-attr]
        (0, 4, 0, 2, 0),
        (1, 4, 0, 2, 1),
        (2, 4, 1, 2, 0),
        (3, 4, 1, 2, 1),
    ]
    assert placed.registered_count() == 4


def test_missing_ranks_are_named_after_the_timeout(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    client = make_client(placed)
    with pytest.raises(RendezvousTimeout, match=r"3 of 4 ranks did not register within .*1, 2, 3"):
        client.register("n1", 0, timeout=0.5, rank=0)


def test_a_rank_that_registers_again_is_told_how_long_it_has_waited(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    # A rank registers again every few seconds while it waits (collectives.runtime.launched);
    # what it is told at the end is the whole wait, not its last call's.
    client = make_client(placed)
    for _ in range(3):
        with pytest.raises(RendezvousTimeout) as caught:
            client.register("n1", 0, timeout=0.4, rank=0)
    found = re.search(r"3 of 4 ranks did not register within ([0-9.]+) s", str(caught.value))
    assert found is not None and float(found[1]) >= 1.2, caught.value


def test_the_same_rank_from_two_hosts_is_refused(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    def register_first() -> None:
        with pytest.raises(RendezvousTimeout):
            make_client(placed).register("n1", 0, timeout=1, rank=2)

    first = threading.Thread(target=register_first)
    first.start()
    time.sleep(0.2)
    with pytest.raises(
        RendezvousError, match="rank 2 registered from host 'n1' and again from 'n9'"
    ):
        make_client(placed).register("n9", 0, timeout=1, rank=2)
    first.join()


def test_a_rank_held_by_another_process_is_refused_until_that_one_gives_up(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    # Two processes started with rank 2 on one host (two jobs meeting at one address): the
    # second is refused while the first waits for the others, and may have the rank once
    # the first has given up (it died while waiting, a restarted pod).
    def first_waits() -> None:
        with pytest.raises(RendezvousTimeout):
            make_client(placed).register("n1", 0, timeout=1, rank=2, process="pid 1 (a)")

    first = threading.Thread(target=first_waits)
    first.start()
    time.sleep(0.3)
    with pytest.raises(
        RendezvousError,
        match=r"rank 2 is held by another process \(pid 1 \(a\)\), which waits for it; "
        r"this one \(pid 2 \(b\)\) was started with the same rank: two jobs meet",
    ):
        make_client(placed).register("n1", 0, timeout=1, rank=2, process="pid 2 (b)")
    first.join()
    with pytest.raises(RendezvousTimeout):  # (the first gave up: the second has it now)
        make_client(placed).register("n1", 0, timeout=0.3, rank=2, process="pid 2 (b)")


def test_a_rank_in_the_job_is_refused_to_another_process_but_not_to_itself(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    results: dict[int, RankInfo | BaseException] = {}

    def register(rank: int) -> None:
        client = make_client(placed)
        results[rank] = client.register("n1", rank, timeout=10, rank=rank, process=f"p{rank}")

    threads = [threading.Thread(target=register, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    again = make_client(placed).register("n1", 1, timeout=1, rank=1, process="p1")
    assert again == results[1]  # a lost answer asked again
    with pytest.raises(
        RendezvousError, match=r"rank 1 is held by another process \(p1\), which is in the job"
    ):
        make_client(placed).register("n1", 1, timeout=1, rank=1, process="another job's")


def test_rank_outside_the_job(placed: RendezvousServer, make_client: ClientFactory) -> None:
    with pytest.raises(RendezvousError, match=r"rank 4 is outside this job's ranks \[0, 4\)"):
        make_client(placed).register("n1", 0, timeout=1, rank=4)


def test_modes_do_not_mix(
    placed: RendezvousServer, server: RendezvousServer, make_client: ClientFactory
) -> None:
    with pytest.raises(RendezvousError, match="registered without its rank"):
        make_client(placed).register("n1", 0)
    with pytest.raises(
        RendezvousError, match="assigned by hvdrun; this worker registered with a rank"
    ):
        make_client(server).register("host-a", 0, rank=0)


def test_local_ranks_that_do_not_add_up_fail_every_rank(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    results: dict[int, object] = {}

    def register(rank: int) -> None:
        try:
            results[rank] = make_client(placed).register("same", 0, timeout=10, rank=rank)
        except RendezvousError as error:
            results[rank] = error

    threads = [threading.Thread(target=register, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(isinstance(results[r], RendezvousError) for r in range(4)), results
    assert "4 ranks registered from host 'same'" in str(results[0])


def test_a_rank_given_another_job_size_fails_every_rank(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    # Rank 0 (whose size made the server: 4) waits for the others; rank 1 was told the job
    # has 3 processes. Rank 0 hears why at once instead of waiting out its timeout.
    results: dict[int, object] = {}

    def register(rank: int, size: int) -> None:
        try:
            results[rank] = make_client(placed).register(
                "n1", rank, timeout=20, rank=rank, size=size
            )
        except RendezvousError as error:
            results[rank] = error

    first = threading.Thread(target=register, args=(0, 4))
    first.start()
    time.sleep(0.3)
    started = time.monotonic()
    register(1, 3)
    first.join(10)
    assert time.monotonic() - started < 5
    why = "rank 1 (host 'n1') was started as one of 3 processes, but rank 0 as one of 4"
    assert isinstance(results[1], RendezvousError) and why in str(results[1])
    assert isinstance(results[0], RendezvousError) and why in str(results[0])
    # A rank that comes later (its rank outside rank 0's job, even) is told the same.
    register(3, 4)
    assert isinstance(results[3], RendezvousError) and why in str(results[3])


def test_the_same_job_size_is_accepted(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    infos = [make_client(placed) for _ in range(4)]
    results: dict[int, object] = {}

    def register(rank: int) -> None:
        results[rank] = infos[rank].register("n1", rank, timeout=10, rank=rank, size=4)

    threads = [threading.Thread(target=register, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [results[r].size for r in range(4)] == [4, 4, 4, 4]  # type: ignore[attr-defined]


def test_server_refuses_a_placed_size_with_slots() -> None:
    with pytest.raises(ValueError, match="placed_size"):
        RendezvousServer(assign_slots([("a", 1)], 1), SECRET, JOB_ID, placed_size=1)


def test_a_client_of_a_placed_job_can_watch(
    placed: RendezvousServer, make_client: ClientFactory
) -> None:
    results = _register_all(placed, make_client, ["a", "a", "a", "a"])
    assert all(isinstance(results[r], RankInfo) for r in range(4))
    client: RendezvousClient = make_client(placed)
    lost = threading.Event()
    client.watch(3, lambda reason: lost.set(), lost_after=2.0)
    assert not lost.wait(0.6)
