"""TLS on the rendezvous: a per-job certificate, pinned by clients; the secret never in clear."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher.spec.job import JobSpec
from launcher.supervision.core import agent_spec
from rendezvous import worker_env
from rendezvous.client import RendezvousClient, RendezvousUnavailable
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots
from rendezvous.tls import authority_from_secret, certificate_for, make_job_certificate
from tests.forwarding import Forwarder

SECRET = "tls-test-secret-0123456789abcdef"
JOB_ID = "job-tls"
ROOT = Path(__file__).resolve().parents[2]


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


def _refused(port: int, cert_pem: bytes | None) -> RendezvousUnavailable:
    """The error of a client (trusting ``cert_pem``, plaintext when None) whose register
    call to ``port`` cannot connect."""
    client = RendezvousClient(f"127.0.0.1:{port}", SECRET, JOB_ID, cert_pem=cert_pem, rpc_timeout=5)
    try:
        with pytest.raises(RendezvousUnavailable) as refused:
            client.register("host-a", 0)
    finally:
        client.close()
    return refused.value


def test_pinned_client_works_and_wire_never_shows_the_secret(
    tls_server: RendezvousServer,
) -> None:
    proxy = Forwarder([tls_server.port])
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
        proxy = Forwarder([server.port])
        client = RendezvousClient(f"127.0.0.1:{proxy.port}", SECRET, JOB_ID)
        try:
            client.register("host-a", 0)
        finally:
            client.close()
            proxy.close()
    assert SECRET.encode() in proxy.captured


def test_client_pinning_another_certificate_is_refused(tls_server: RendezvousServer) -> None:
    other = make_job_certificate("another-job").cert_pem
    refused = _refused(tls_server.port, other)
    assert refused.tls_refusal() == "its TLS certificate is not one this rank trusts"
    # The server still serves its own clients.
    good = RendezvousClient(
        f"127.0.0.1:{tls_server.port}", SECRET, JOB_ID, cert_pem=_cert(tls_server)
    )
    try:
        assert good.register("host-a", 0).rank == 0
    finally:
        good.close()


def test_plaintext_client_cannot_talk_to_a_tls_server(tls_server: RendezvousServer) -> None:
    refused = _refused(tls_server.port, None)
    assert refused.tls_refusal() is None  # (it speaks none: it only sees closed sockets)


def test_ranks_with_one_secret_trust_each_other_and_no_other() -> None:
    """Jobs started without hvdrun: rank 0 serves with a certificate signed by the authority
    it derives from the job secret; another rank derives its own copy of that authority
    and trusts it (the wire never shows the secret); a rank whose secret differs derives
    another authority, and its handshake fails, saying why, before its secret is sent."""
    served = authority_from_secret(SECRET).server_certificate()
    slots = assign_slots([("host-a", 2)], 2)
    with RendezvousServer(slots, SECRET, JOB_ID, bind_host="127.0.0.1", tls=served) as server:
        proxy = Forwarder([server.port])
        own = authority_from_secret.__wrapped__(SECRET)  # (as another rank derives it)
        client = RendezvousClient(f"127.0.0.1:{proxy.port}", SECRET, JOB_ID, cert_pem=own.root_pem)
        try:
            assert client.register("host-a", 1).rank == 1
        finally:
            client.close()
            proxy.close()
        other = authority_from_secret(SECRET + "-another").root_pem
        stranger = Forwarder([server.port])
        try:
            refused = _refused(stranger.port, other)
        finally:
            stranger.close()
    assert refused.tls_refusal() == "its TLS certificate is not one this rank trusts"
    assert proxy.captured and stranger.captured
    assert SECRET.encode() not in proxy.captured + stranger.captured
    assert "PRIVATE" not in repr(own) and "key" not in repr(own)
    # Derived, not drawn: the same secret gives the same key on every rank.
    same = authority_from_secret.__wrapped__(SECRET).key.private_numbers()
    assert same == own.key.private_numbers()


def test_a_tls_client_says_when_the_server_speaks_no_tls() -> None:
    with _server(tls=False) as server:
        refused = _refused(server.port, authority_from_secret(SECRET).root_pem)
    assert refused.tls_refusal() == "the program there speaks no TLS"


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


def test_every_certificate_is_valid_whatever_a_hosts_clock_says() -> None:
    # A host whose clock ran an hour or more behind hvdrun's (a hardware clock kept in local
    # time) failed its handshake, "certificate is not yet valid": a job's certificates are
    # trusted by their key (or the secret's authority) alone, and valid from 1970 to 9999.
    from cryptography import x509

    served = authority_from_secret(SECRET).server_certificate()
    root = authority_from_secret(SECRET).root_pem
    for pem in (make_job_certificate(JOB_ID).cert_pem, served.cert_pem, root):
        certificate = x509.load_pem_x509_certificate(pem)
        assert certificate.not_valid_before_utc.year == 1970
        assert certificate.not_valid_after_utc.year == 9999


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
