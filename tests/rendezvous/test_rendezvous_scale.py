"""256 concurrent clients (threads, each with its own client and channel) against one server."""

from __future__ import annotations

import threading
import time

from rendezvous.client import RankInfo, RendezvousClient
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots

HOSTS = 16
SLOTS = 16
N = HOSTS * SLOTS


def test_256_clients_register_exchange_and_barrier(secret: str, job_id: str) -> None:
    slots = assign_slots([(f"node{h:02d}", SLOTS) for h in range(HOSTS)], N)
    expected = {(slot.hostname, slot.local_rank): slot for slot in slots}
    results: dict[int, tuple[RankInfo, bytes, bytes]] = {}
    errors: list[str] = []
    lock = threading.Lock()

    with RendezvousServer(slots, secret, job_id, bind_host="127.0.0.1") as server:
        addr = f"127.0.0.1:{server.port}"
        clients = [RendezvousClient(addr, secret, job_id, rpc_timeout=60) for _ in range(N)]

        def worker(index: int) -> None:
            client = clients[index]
            host, local_rank = f"node{index // SLOTS:02d}", index % SLOTS
            try:
                info = client.register(host, local_rank)
                rank = info.rank
                partner = rank ^ 1
                # Odd ranks publish late, so the even partner's get really blocks.
                if rank % 2:
                    time.sleep(0.2)
                client.set(f"addr/{rank}", f"rank-{rank}".encode())
                from_partner = client.get(f"addr/{partner}", timeout=60)
                # Everybody blocks on "go" until the test thread sets it.
                client.add("arrived", 1)
                go = client.get("go", timeout=60)
                client.barrier("all", N, timeout=60)
                with lock:
                    results[rank] = (info, from_partner, go)
            except Exception as error:
                with lock:
                    errors.append(f"{host}/{local_rank}: {error}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
        start = time.monotonic()
        try:
            for thread in threads:
                thread.start()
            observer = RendezvousClient(addr, secret, job_id)
            try:
                deadline = time.monotonic() + 60
                while observer.get("arrived", timeout=60) != str(N).encode():
                    assert time.monotonic() < deadline, f"errors: {errors[:5]}"
                    if errors:
                        break
                    time.sleep(0.05)
                assert errors == []
                assert server.registered_count() == N
                observer.set("go", b"GO")
            finally:
                observer.close()
            for thread in threads:
                thread.join(timeout=120)
        finally:
            for client in clients:
                client.close()
        elapsed = time.monotonic() - start

    assert errors == []
    assert sorted(results) == list(range(N))
    for rank, (info, from_partner, go) in results.items():
        slot = slots[rank]
        assert expected[(slot.hostname, slot.local_rank)] == slot
        assert (info.rank, info.size, info.local_rank, info.local_size) == (
            slot.rank,
            N,
            slot.local_rank,
            SLOTS,
        )
        assert (info.cross_rank, info.cross_size) == (slot.cross_rank, HOSTS)
        assert from_partner == f"rank-{rank ^ 1}".encode()
        assert go == b"GO"
    assert elapsed < 60
