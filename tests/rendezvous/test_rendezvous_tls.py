"""TLS on the rendezvous: a per-job certificate, pinned by clients; the secret never in clear."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.spec.job import JobSpec
from launcher.supervision.core import agent_spec
from rendezvous import worker_env
from rendezvous.client import RendezvousClient, RendezvousUnavailable
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots
from rendezvous.tls import certificate_for, make_job_certificate

SECRET = "tls-test-secret-0123456789abcdef"
JOB_ID = "job-tls"
ROOT = Path(__file__).resolve().parents[2]


class RecordingProxy:
    """A TCP relay between a client and the server that keeps every byte it forwards."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                with self._lock:
                    self.captured += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def _server(tls: bool) -> RendezvousServer:
    slots = assign_slots([("host-a", 2)], 2)
    certificate = make_job_certificate(JOB_ID) if tls else None
    return RendezvousServer(slots, SECRET, JOB_ID, bind_host="127.0.0.1", tls=certificate)


@pytest.fixture
def tls_server() -> Iterator[RendezvousServer]:
    with _server(tls=True) as server:
        yield server


def _cert(server: RendezvousServer) -> bytes:
    tls = server._tls
    assert tls is not None
    return tls.cert_pem


def test_pinned_client_works_and_wire_never_shows_the_secret(
    tls_server: RendezvousServer,
) -> None:
    proxy = RecordingProxy(tls_server.port)
    client = RendezvousClient(f"127.0.0.1:{proxy.port}", SECRET, JOB_ID, cert_pem=_cert(tls_server))
    try:
        info = client.register("host-a", 1)
        client.set("greeting", b"hello-over-tls")
        assert client.get("greeting", timeout=5) == b"hello-over-tls"
    finally:
        client.close()
        proxy.close()
    assert info.rank == 1
    assert len(proxy.captured) > 0
    assert SECRET.encode() not in proxy.captured
    assert b"hello-over-tls" not in proxy.captured


def test_plaintext_server_shows_the_secret_on_the_wire() -> None:
    """The control for the test above: without TLS the recording does hold the secret."""
    with _server(tls=False) as server:
        proxy = RecordingProxy(server.port)
        client = RendezvousClient(f"127.0.0.1:{proxy.port}", SECRET, JOB_ID)
        try:
            client.register("host-a", 0)
        finally:
            client.close()
            proxy.close()
    assert SECRET.encode() in proxy.captured


def test_client_pinning_another_certificate_is_refused(tls_server: RendezvousServer) -> None:
    other = make_job_certificate("another-job").cert_pem
    client = RendezvousClient(f"127.0.0.1:{tls_server.port}", SECRET, JOB_ID, cert_pem=other)
    try:
        with pytest.raises(RendezvousUnavailable):
            client.register("host-a", 0)
    finally:
        client.close()
    # The server still serves its own clients.
    good = RendezvousClient(
        f"127.0.0.1:{tls_server.port}", SECRET, JOB_ID, cert_pem=_cert(tls_server)
    )
    try:
        assert good.register("host-a", 0).rank == 0
    finally:
        good.close()


def test_plaintext_client_cannot_talk_to_a_tls_server(tls_server: RendezvousServer) -> None:
    client = RendezvousClient(f"127.0.0.1:{tls_server.port}", SECRET, JOB_ID, rpc_timeout=5)
    try:
        with pytest.raises(RendezvousUnavailable):
            client.register("host-a", 0)
    finally:
        client.close()


def test_certificate_only_off_loopback_and_key_never_shown() -> None:
    assert certificate_for("127.0.0.1", JOB_ID) is None
    assert certificate_for("::1", JOB_ID) is None
    tls = certificate_for("0.0.0.0", JOB_ID)
    assert tls is not None
    assert tls.cert_pem.startswith(b"-----BEGIN CERTIFICATE-----")
    assert b"PRIVATE KEY" in tls.key_pem
    assert "PRIVATE" not in repr(tls)
    # A fresh key per job.
    assert make_job_certificate(JOB_ID).key_pem != tls.key_pem


def test_certificate_travels_with_the_secret_in_the_start_message_env() -> None:
    tls = make_job_certificate(JOB_ID)
    pem = tls.cert_pem.decode()
    slots = assign_slots([("h", 1)], 1)
    spec = JobSpec(command=["true"], num_proc=1, hosts=[], env={}, cwd="/")
    agent = agent_spec(spec, "h", slots, "10.0.0.1:5", JOB_ID, SECRET, 5.0, pem)
    assert agent.env[worker_env.RENDEZVOUS_CERT] == pem
    assert agent.env[worker_env.SECRET] == SECRET
    assert all(pem not in arg and "PRIVATE" not in arg for arg in agent.command)
    # A job without TLS: no certificate, even one inherited (hvdrun run inside another
    # job's worker), whose TLS handshake the plain server would refuse.
    inherited = JobSpec(["true"], 1, [], {worker_env.RENDEZVOUS_CERT: pem}, "/")
    plain = agent_spec(inherited, "h", slots, "127.0.0.1:5", JOB_ID, SECRET, 5.0)
    assert not plain.env.get(worker_env.RENDEZVOUS_CERT)


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.123", 9))  # no packet is sent: only picks the route
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_hvdrun_serves_tls_when_the_rendezvous_leaves_loopback() -> None:
    """A job whose rendezvous listens on a network address: the server speaks TLS, the
    host's relay dials it with the job's certificate, the workers register through the relay."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    script = ROOT / "tests" / "launcher" / "scripts" / "register.py"
    show = (
        "import os; e = os.environ; "
        "print('via', e['HVDRUN_RENDEZVOUS_RELAY_ADDR'][:5], e['HVDRUN_RENDEZVOUS_CERT'][:27])"
    )
    result = subprocess.run(
        [
            *(sys.executable, "-m", "hvdrun", "-np", "2", "--rendezvous-addr", address),
            *("sh", "-c", f'{sys.executable} -c "{show}" && {sys.executable} {script}'),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        # Workers reach the (TLS) server through their host's relay, on a Unix socket.
        assert f"[{rank}]<stdout>:via unix: -----BEGIN CERTIFICATE-----" in result.stdout
        assert f"[{rank}]<stdout>:registered rank {rank}" in result.stdout


def test_without_relay_workers_get_the_certificate() -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    script = ROOT / "tests" / "launcher" / "scripts" / "register.py"
    show = "import os; print('cert', os.environ.get('HVDRUN_RENDEZVOUS_CERT', '')[:27])"
    result = subprocess.run(
        [
            *(sys.executable, "-m", "hvdrun", "-np", "2", "--rendezvous-addr", address),
            *("sh", "-c", f'{sys.executable} -c "{show}" && {sys.executable} {script}'),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "HVDRUN_RENDEZVOUS_RELAY": "0"},
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[{rank}]<stdout>:cert -----BEGIN CERTIFICATE-----" in result.stdout
        assert f"[{rank}]<stdout>:registered rank {rank}" in result.stdout
