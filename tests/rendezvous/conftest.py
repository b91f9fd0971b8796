"""Shared fixtures for the rendezvous tests: real servers on ephemeral ports, real clients."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY
from rendezvous.client import RendezvousClient
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots

SECRET = "s3cret-token-for-tests"
JOB_ID = "job-rdzv-test"

ClientFactory = Callable[..., RendezvousClient]


@pytest.fixture(scope="module")
def server() -> Iterator[RendezvousServer]:
    """One server per test module: 2 hosts x 2 slots, fast heartbeats, small value limit."""
    slots = assign_slots([("host-a", 2), ("host-b", 2)], 4)
    with RendezvousServer(
        slots, SECRET, JOB_ID, bind_host="127.0.0.1", heartbeat_interval=0.2, max_value_bytes=4096
    ) as srv:
        yield srv


@pytest.fixture
def make_client() -> Iterator[ClientFactory]:
    """Builds clients (closed at teardown): make_client(server, secret=..., job_id=...)."""
    clients: list[RendezvousClient] = []

    def factory(
        srv: RendezvousServer | str,
        secret: str = SECRET,
        job_id: str = JOB_ID,
        rpc_timeout: float = 10.0,
    ) -> RendezvousClient:
        addr = srv if isinstance(srv, str) else f"127.0.0.1:{srv.port}"
        client = RendezvousClient(addr, secret, job_id, rpc_timeout=rpc_timeout)
        clients.append(client)
        return client

    yield factory
    for client in clients:
        client.close()


@pytest.fixture
def secret() -> str:
    return SECRET


@pytest.fixture
def job_id() -> str:
    return JOB_ID


@pytest.fixture
def metadata() -> tuple[tuple[str, str], ...]:
    """Good call metadata for raw gRPC stubs."""
    return ((TOKEN_METADATA_KEY, SECRET), (JOB_METADATA_KEY, JOB_ID))


@pytest.fixture
def client(server: RendezvousServer, make_client: ClientFactory) -> RendezvousClient:
    return make_client(server)
