"""What a 2-host job puts on the wire: the rendezvous is TLS, the secret never in clear text.

Runs on the test cluster (tests/cluster.py: network namespaces on a bridge, root and sshd
needed) and captures every frame on the bridge with a raw packet socket while the job runs.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, cluster_for_tests

PY = sys.executable
REGISTER = Path(__file__).resolve().parents[1] / "launcher" / "scripts" / "register.py"
ETH_P_ALL = 0x0003


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    yield from cluster_for_tests(hosts=2, sshd_hosts=2, tests="wire capture tests")


class BridgeCapture:
    """Every frame that crosses the cluster's bridge, kept in memory."""

    def __init__(self, interface: str) -> None:
        self.frames: list[bytes] = []
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
        self._sock.bind((interface, 0))
        self._sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.frames.append(self._sock.recv(65535))
            except TimeoutError:
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def tcp_payload(self, port: int) -> bytes:
        """The TCP payload bytes of IPv4 frames to or from ``port``."""
        payload = bytearray()
        for frame in self.frames:
            if len(frame) < 34 or frame[12:14] != b"\x08\x00":
                continue
            ip = frame[14:]
            header = (ip[0] & 0x0F) * 4
            if ip[9] != 6:  # TCP
                continue
            tcp = ip[header:]
            source, dest = struct.unpack("!HH", tcp[:4])
            if port in (source, dest):
                payload += tcp[(tcp[12] >> 4) * 4 :]
        return bytes(payload)


def test_secret_never_crosses_the_network_in_clear_text(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    show = (
        "import os; e = os.environ; "
        "print('secret=' + e['HVDRUN_SECRET'], 'server=' + e['HVDRUN_RENDEZVOUS_ADDR'])"
    )
    capture = BridgeCapture(cluster.bridge)
    try:
        result = cluster.hvdrun(
            "-H",
            f"{node1.alias}:2,{node2.alias}:2",
            "sh",
            "-c",
            f'{PY} -c "{show}" && {PY} {REGISTER}',
        )
    finally:
        capture.stop()
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "<stdout>:secret=" in line]
    assert len(lines) == 4, result.stdout
    secret = lines[0].split("secret=", 1)[1].split()[0]
    port = int(lines[0].rsplit(":", 1)[1])
    assert len(secret) >= 32
    rendezvous = capture.tcp_payload(port)
    assert len(rendezvous) > 1000  # the rendezvous traffic really was captured...
    assert rendezvous[:3] in (b"\x16\x03\x01", b"\x16\x03\x03")  # ...and opens a TLS handshake
    everything = b"".join(capture.frames)
    assert secret.encode() not in everything
    assert b"-----BEGIN CERTIFICATE-----" not in everything  # the PEM travels inside SSH only
