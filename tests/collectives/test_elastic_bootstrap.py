"""Bootstrap on a rendezvous harness (no hvdrun, no root): a worker whose bootstrap of one
membership generation was superseded joins the next one with workers that never failed; a
worker whose rendezvous does not answer its first call at once keeps dialling."""

from __future__ import annotations

import secrets
import socket
import subprocess
import threading
import time
from datetime import timedelta

import pytest

from collectives.runtime import registration
from collectives.runtime.state import RuntimeState, Topology
from rendezvous.client import RendezvousClient
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots
from tests.collectives.conftest import clean_env, spawn_worker

JOB_ID = "elastic-bootstrap-test"


def _spawn(addr: str, secret: str, host: str) -> subprocess.Popen[str]:
    env = clean_env()
    env.update(
        HVDRUN_RENDEZVOUS_ADDR=addr,
        HVDRUN_JOB_ID=JOB_ID,
        HVDRUN_SECRET=secret,
        HVDRUN_ELASTIC="1",
        HVDRUN_HOSTNAME=host,
        HVDRUN_LOCAL_RANK="0",
        HVDRUN_GLOO_TIMEOUT_SECONDS="5",
    )
    return spawn_worker("elastic_join_worker.py", env)


def test_a_superseded_bootstrap_does_not_keep_the_next_generation_apart() -> None:
    # torch counts the default group that a failed init_process_group never created: the
    # worker's next bootstrap would look for its peers under other store keys than theirs.
    secret = secrets.token_hex(16)
    with RendezvousServer(
        [], secret, JOB_ID, bind_host="127.0.0.1", heartbeat_interval=0.2, elastic=True
    ) as server:
        addr = f"127.0.0.1:{server.port}"
        server.publish(assign_slots([("a", 1), ("b", 1)], 2))  # a never comes
        workers = [_spawn(addr, secret, "b")]
        client = RendezvousClient(addr, secret, JOB_ID)
        try:
            # b, rank 1 of generation 1, has published its address and waits for rank 0
            client.get("hvdrun/g1/i1/0//cpu//0/1", timeout=60)
            server.publish(assign_slots([("b", 1), ("c", 1)], 2))  # supersedes generation 1
            workers.append(_spawn(addr, secret, "c"))
            outputs = [worker.communicate(timeout=60) for worker in workers]
        finally:
            client.close()
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.communicate()
    (b_out, b_err), (c_out, c_err) = outputs
    # (routine when hosts change: no warning, and nothing said of the network)
    assert "could not join generation 1" not in b_err and "GLOO_SOCKET_IFNAME" not in b_err, b_err
    assert workers[0].returncode == 0, b_out + b_err
    assert workers[1].returncode == 0, c_out + c_err
    assert "joined rank=0 size=2 generation=2 sum=3" in b_out, b_out + b_err
    assert "joined rank=1 size=2 generation=2 sum=3" in c_out, c_out + c_err


def test_a_worker_keeps_dialling_a_rendezvous_that_does_not_answer_yet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An overloaded host may fail a worker's first connection: that must not fail its host.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens here for now
    secret = secrets.token_hex(16)
    server = RendezvousServer(
        assign_slots([("a", 1)], 1), secret, JOB_ID, bind_host="127.0.0.1", port=port
    )
    late = threading.Timer(1.5, server.start)
    late.start()
    client = RendezvousClient(f"127.0.0.1:{port}", secret, JOB_ID, rpc_timeout=5)
    state = RuntimeState(Topology(0, 1, 0, 1, 0, 1), "gloo", timedelta(seconds=5), None)
    state.client, state.host = client, "a"
    try:
        registration.register(state, 0)
        assert (state.topology.rank, state.topology.size) == (0, 1)
    finally:
        late.join()
        client.close()
        server.stop()

    # a server that never answers fails the worker after the retry window, naming it
    monkeypatch.setattr(registration, "REGISTER_RETRY_SECONDS", 1.0)
    client = RendezvousClient(f"127.0.0.1:{port}", secret, JOB_ID, rpc_timeout=5)
    state.client = client
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="could not register with the rendezvous"):
            registration.register(state, 0)
    finally:
        client.close()
    assert time.monotonic() - start < 5
