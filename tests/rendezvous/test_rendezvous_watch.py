"""Watch streams: heartbeats, SHUTDOWN on stop(), a killed server, a silent (stopped) server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY, rendezvous_pb2, rendezvous_pb2_grpc
from rendezvous.client import RendezvousClient
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots

ClientFactory = Callable[..., RendezvousClient]
SERVER_SCRIPT = Path(__file__).with_name("rdzv_server_process.py")


class LostRecorder:
    """An on_lost callback that remembers every call and when it came."""

    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.at: list[float] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.at.append(time.monotonic())
        self.event.set()


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_heartbeats_arrive_and_ranks_are_tracked(
    server: RendezvousServer, secret: str, job_id: str
) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    metadata = ((TOKEN_METADATA_KEY, secret), (JOB_METADATA_KEY, job_id))
    try:
        stream = stub.Watch(rendezvous_pb2.WatchRequest(rank=2), metadata=metadata)
        start = time.monotonic()
        events = [next(stream) for _ in range(4)]  # one at once, then every 0.2 s
        elapsed = time.monotonic() - start
        assert all(event.kind == rendezvous_pb2.WatchEvent.HEARTBEAT for event in events)
        assert 0.4 < elapsed < 3
        assert server.watching_ranks() == {2}
        second = stub.Watch(rendezvous_pb2.WatchRequest(rank=3), metadata=metadata)
        next(second)
        assert server.watching_ranks() == {2, 3}
        stream.cancel()
        assert wait_until(lambda: server.watching_ranks() == {3}, 5)
        second.cancel()
        assert wait_until(lambda: server.watching_ranks() == set(), 5)
    finally:
        channel.close()


def test_client_watch_survives_heartbeats_and_close_is_silent(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    client = make_client(server)
    lost = LostRecorder()
    client.watch(1, lost, lost_after=0.8)  # heartbeats every 0.2 s keep it alive
    assert wait_until(lambda: 1 in server.watching_ranks(), 5)
    time.sleep(1.5)
    assert lost.reasons == []
    client.close()
    assert wait_until(lambda: 1 not in server.watching_ranks(), 5)
    time.sleep(1.0)  # longer than lost_after: the closed watch must not fire
    assert lost.reasons == []


def test_stop_sends_shutdown(make_client: ClientFactory, secret: str, job_id: str) -> None:
    srv = RendezvousServer(
        assign_slots([("h", 2)], 2), secret, job_id, bind_host="127.0.0.1", heartbeat_interval=5
    )
    srv.start()
    lost = [LostRecorder(), LostRecorder()]
    for rank in range(2):
        make_client(srv).watch(rank, lost[rank], lost_after=30)
    assert wait_until(lambda: srv.watching_ranks() == {0, 1}, 5)
    start = time.monotonic()
    srv.stop(grace=0)  # even without grace, SHUTDOWN goes out first
    for recorder in lost:
        assert recorder.event.wait(5)
        assert recorder.at[0] - start < 2
        assert "shut down" in recorder.reasons[0]
    time.sleep(0.3)
    assert [len(recorder.reasons) for recorder in lost] == [1, 1]  # exactly once


@pytest.fixture
def server_process(secret: str, job_id: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    process = subprocess.Popen(
        [sys.executable, str(SERVER_SCRIPT), job_id, "2", "0.2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(secret + "\n")
        process.stdin.flush()
        port = int(process.stdout.readline())
        yield process, f"127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_killed_server_process_is_noticed(
    server_process: tuple[subprocess.Popen[str], str], make_client: ClientFactory
) -> None:
    process, addr = server_process
    client = make_client(addr)
    client.set("k", b"v")
    lost = LostRecorder()
    client.watch(0, lost, lost_after=30)  # only the broken connection can fire it
    time.sleep(0.5)
    assert lost.reasons == []
    start = time.monotonic()
    os.kill(process.pid, signal.SIGKILL)
    assert lost.event.wait(10)
    assert lost.at[0] - start < 5
    assert "unavailable" in lost.reasons[0].lower() or "closed" in lost.reasons[0]
    time.sleep(0.3)
    assert len(lost.reasons) == 1


def test_silent_server_is_noticed_after_lost_after(
    server_process: tuple[subprocess.Popen[str], str], make_client: ClientFactory
) -> None:
    """A stopped (SIGSTOP) server keeps its connections open but sends nothing, like a cut
    network: only the heartbeat timeout can tell."""
    process, addr = server_process
    client = make_client(addr)
    lost = LostRecorder()
    client.watch(1, lost, lost_after=1.0)
    time.sleep(0.6)
    assert lost.reasons == []
    start = time.monotonic()
    os.kill(process.pid, signal.SIGSTOP)
    try:
        assert lost.event.wait(10)
        assert 0.5 < lost.at[0] - start < 3
        assert "no heartbeat" in lost.reasons[0]
    finally:
        os.kill(process.pid, signal.SIGCONT)
    time.sleep(0.3)
    assert len(lost.reasons) == 1
