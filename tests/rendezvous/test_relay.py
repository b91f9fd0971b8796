"""The host relay: a host's workers reach the server through one connection and one stream."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rendezvous.client import RendezvousAuthError, RendezvousClient
from rendezvous.relay import HostRelay
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots
from tests.forwarding import Forwarder
from tests.rendezvous.conftest import JOB_ID, SECRET


@pytest.fixture
def served() -> Iterator[RendezvousServer]:
    slots = assign_slots([("host-a", 2), ("host-b", 2)], 4)
    with RendezvousServer(
        slots, SECRET, JOB_ID, bind_host="127.0.0.1", heartbeat_interval=0.2
    ) as server:
        yield server


@pytest.fixture
def relay(served: RendezvousServer) -> Iterator[HostRelay]:
    relay = HostRelay(
        f"127.0.0.1:{served.port}", SECRET, JOB_ID, [0, 1], heartbeat_interval=0.2, lost_after=2
    )
    relay.start()
    yield relay
    relay.stop()


def test_workers_through_the_relay_meet_workers_without_one(
    served: RendezvousServer, relay: HostRelay
) -> None:
    assert relay.addr.startswith("unix:")
    local = [RendezvousClient(relay.addr, SECRET, JOB_ID) for _ in range(2)]
    direct = [RendezvousClient(f"127.0.0.1:{served.port}", SECRET, JOB_ID) for _ in range(2)]
    results: dict[int, bytes] = {}
    try:
        before = relay.upstream_calls
        registered: dict[int, object] = {}
        threads = [
            threading.Thread(
                target=lambda i=i: registered.update({i: local[i].register("host-a", i)})
            )
            for i in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert relay.upstream_calls - before == 1  # both Registers went as one RegisterHost
        infos = [registered[0], registered[1]]
        infos += [direct[i].register("host-b", i) for i in range(2)]
        assert [info.rank for info in infos] == [0, 1, 2, 3]  # type: ignore[attr-defined]
        lost: list[str] = []
        for i, client in enumerate(local):
            client.watch(i, lost.append, lost_after=2)
        assert served.watching_ranks() >= {0, 1}  # the relay's one stream carries both

        def worker(client: RendezvousClient, rank: int) -> None:
            client.set(f"addr/{rank}", f"r{rank}".encode())
            results[rank] = client.get("uid", timeout=10)
            client.barrier("init", 4, timeout=10)

        clients = local + direct
        calls_before = relay.upstream_calls
        threads = [threading.Thread(target=worker, args=(c, r)) for r, c in enumerate(clients)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # the local workers' reads of "uid" are waiting in the relay now
        direct[0].set("uid", b"the-unique-id")
        for thread in threads:
            thread.join(20)
        assert results == {rank: b"the-unique-id" for rank in range(4)}
        assert local[1].multi_get(["addr/2", "addr/3"], timeout=5) == [b"r2", b"r3"]
        # 2 sets, the two local reads of "uid" as one call, 2 barriers, 1 multi_get.
        assert relay.upstream_calls - calls_before == 2 + 1 + 2 + 1
        time.sleep(0.6)  # heartbeats keep the local streams alive
        assert not lost
    finally:
        for client in local + direct:
            client.close()


@pytest.mark.parametrize("outage", ["reset", "lost"])
def test_a_broken_upstream_is_opened_again_and_only_lost_after_silence_ends_the_workers(
    served: RendezvousServer, outage: str
) -> None:
    """The relay's connection to the server resets (a network blip): it opens its stream
    again and the workers go on. Where the server stays out of reach for ``lost_after``
    seconds, the workers' streams end, saying the host's relay lost the server (the server
    did not end the job)."""
    forwarder = Forwarder([served.port])
    relay = HostRelay(
        f"127.0.0.1:{forwarder.port}", SECRET, JOB_ID, [0, 1], heartbeat_interval=0.2,
        lost_after=3,
    )  # fmt: skip
    relay.start()
    client = RendezvousClient(relay.addr, SECRET, JOB_ID)
    lost: list[str] = []
    ended = threading.Event()
    try:
        client.watch(0, lambda reason: (lost.append(reason), ended.set()), lost_after=10)
        time.sleep(0.5)
        streams = relay.upstream_calls
        if outage == "reset":
            forwarder.cut()
            assert not ended.wait(4), lost  # (longer than lost_after)
            assert relay.upstream_calls > streams  # its stream was opened again
            client.set("after", b"the reset")
            assert client.get("after", timeout=5) == b"the reset"
        else:
            forwarder.close()
            assert ended.wait(10), "the workers never heard that the server was lost"
            (reason,) = lost
            assert reason.startswith(
                f"the host's rendezvous relay lost the server at 127.0.0.1:{forwarder.port}: "
                "no heartbeat for 3 s"
            ), reason
            assert "shut down" not in reason, reason
    finally:
        client.close()
        relay.stop()
        forwarder.close()


def test_wrong_secret_through_the_relay_is_rejected(relay: HostRelay) -> None:
    with RendezvousClient(relay.addr, "guessed", JOB_ID) as bad:
        with pytest.raises(RendezvousAuthError) as err:
            bad.set("k", b"v")
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        lost = threading.Event()
        bad.watch(0, lambda reason: lost.set(), lost_after=2)
        assert lost.wait(5)  # its Watch is refused by the relay itself


def test_server_shutdown_reaches_every_local_worker(served: RendezvousServer) -> None:
    relay = HostRelay(
        f"127.0.0.1:{served.port}", SECRET, JOB_ID, [0, 1], heartbeat_interval=0.2, lost_after=2
    )
    relay.start()
    reasons: list[str] = []
    done = threading.Event()
    clients = [RendezvousClient(relay.addr, SECRET, JOB_ID) for _ in range(2)]
    try:

        def on_lost(reason: str) -> None:
            reasons.append(reason)
            if len(reasons) == 2:
                done.set()

        for i, client in enumerate(clients):
            client.watch(i, on_lost, lost_after=5)
        time.sleep(0.3)
        served.stop()
        assert done.wait(5)
        assert all("shut down" in reason for reason in reasons), reasons
    finally:
        for client in clients:
            client.close()
        relay.stop()


def test_hvd_init_through_the_relay_over_tls() -> None:
    """A real job whose rendezvous leaves loopback: each host's agent relays its workers
    (TLS to the server), and hvd.init() plus a Gloo allreduce work through it."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("192.0.2.123", 9))  # picks the route, sends nothing
        address = sock.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    code = (
        "import os, torch; import collectives.torch as hvd; hvd.init(); "
        "s = hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum).item(); "
        "print('via', os.environ['HVDRUN_RENDEZVOUS_RELAY_ADDR'][:5], 'sum', s); hvd.shutdown()"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hvdrun",
            "-np",
            "2",
            "--rendezvous-addr",
            address,
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[{rank}]<stdout>:via unix: sum 3.0" in result.stdout


def test_agent_starts_a_relay_only_for_a_fixed_job_that_leaves_this_machine(
    served: RendezvousServer,
) -> None:
    from launcher.agent.session import start_relay
    from launcher.transport.protocol import AgentSpec, WorkerLaunch
    from rendezvous import worker_env

    def decide(addr: str, **extra: str) -> tuple[HostRelay | None, dict[str, str]]:
        env = {
            worker_env.RENDEZVOUS_ADDR: addr,
            worker_env.SECRET: SECRET,
            worker_env.JOB_ID: JOB_ID,
            worker_env.RENDEZVOUS_RELAY_ADDR: "unix:/stale",
            **extra,
        }
        spec = AgentSpec(
            hostname="host-a",
            command=["true"],
            cwd="/",
            env=dict(env),
            workers=[WorkerLaunch(rank=r, env={}) for r in (0, 1)],
            rendezvous_addr=addr,
        )
        return start_relay(spec, env), env

    port = served.port
    for addr, extra in (
        (f"127.0.0.1:{port}", {}),  # this machine alone
        (f"localhost-free.invalid:{port}", {"HVDRUN_ELASTIC": "1"}),
        (f"localhost-free.invalid:{port}", {"HVDRUN_RENDEZVOUS_RELAY": "0"}),
    ):
        relay, env = decide(addr, **extra)
        assert relay is None, addr
        assert worker_env.RENDEZVOUS_RELAY_ADDR not in env  # no stale address survives
    # A name, not a loopback address: the job spans machines, so the relay runs.
    relay, env = decide(f"localhost:{port}")
    assert relay is not None
    try:
        assert env[worker_env.RENDEZVOUS_RELAY_ADDR] == relay.addr
        assert env[worker_env.RENDEZVOUS_ADDR] == f"localhost:{port}"  # still the server
        with RendezvousClient.from_environment(env) as client:
            assert client.addr == relay.addr
            assert client.register("host-a", 1).rank == 1
    finally:
        relay.stop()


def test_a_relay_removes_the_directories_of_agents_that_died(
    served: RendezvousServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed agent cannot remove its relay's socket directory; the next relay on the
    host removes it, and leaves those of live agents, of other hosts (a TMPDIR shared
    between hosts, where their pids mean nothing) and anything else alone: a link named as
    a dead agent's directory too, which it neither follows nor says it removed."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    tmp_path = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # (short: a socket's path)
    host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    stale = tmp_path / f"hvdrun-relay-{host}-{dead.pid}-x1"
    alive = tmp_path / f"hvdrun-relay-{host}-{os.getppid()}-x2"
    elsewhere = tmp_path / f"hvdrun-relay-0badc0de-{dead.pid}-x3"
    other = tmp_path / "hvdrun-relay-notes"
    for path in (stale, alive, elsewhere, other):
        path.mkdir()
    (stale / "rendezvous.sock").write_text("")
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "data").write_text("keep")
    link = tmp_path / f"hvdrun-relay-{host}-{dead.pid}-x4"
    link.symlink_to(kept)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    caplog.set_level(logging.INFO, logger="rendezvous.relay")
    relay = HostRelay(f"127.0.0.1:{served.port}", SECRET, JOB_ID, [0], heartbeat_interval=0.2)
    relay.start()
    try:
        left = sorted(path.name for path in tmp_path.iterdir())
        own = [name for name in left if name.startswith(f"hvdrun-relay-{host}-{os.getpid()}-")]
        assert not stale.exists() and alive.exists() and elsewhere.exists() and other.exists()
        assert link.is_symlink() and (kept / "data").read_text() == "keep"
        said = [r.getMessage() for r in caplog.records if "removed relay" in r.getMessage()]
        assert len(said) == 1 and str(stale) in said[0] and str(link) not in said[0], said
        assert len(own) == 1 and relay.addr.endswith(f"{own[0]}/rendezvous.sock")
    finally:
        relay.stop()
    assert not (tmp_path / own[0]).exists()
    shutil.rmtree(tmp_path)


def test_a_relay_under_a_long_tmpdir_puts_its_socket_in_tmp(
    served: RendezvousServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Unix socket's path holds 107 bytes: under a long TMPDIR the relay could not bind
    and every worker dialled the server itself, silently."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    relay = HostRelay(f"127.0.0.1:{served.port}", SECRET, JOB_ID, [0], heartbeat_interval=0.2)
    try:
        host = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
        assert relay.start().startswith(f"unix:/tmp/hvdrun-relay-{host}-{os.getpid()}-")
        client = RendezvousClient(relay.addr, SECRET, JOB_ID)
        try:
            assert client.register("host-a", 0).rank in (0, 1)
        finally:
            client.close()
    finally:
        relay.stop()


def test_a_relay_stopped_by_its_agent_logs_no_warning(
    served: RendezvousServer, caplog: pytest.LogCaptureFixture
) -> None:
    # (every job's end stops it: hvdrun --verbose showed a warning from each host's agent)
    relay = HostRelay(
        f"127.0.0.1:{served.port}", SECRET, JOB_ID, [0, 1], heartbeat_interval=0.2, lost_after=2
    )
    relay.start()
    with caplog.at_level("DEBUG", logger="rendezvous.relay"):
        relay.stop()
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "rendezvous.relay"]
    assert ("DEBUG", "rendezvous relay: the host's rendezvous relay stopped") in said, said
    assert not [level for level, _ in said if level == "WARNING"], said
