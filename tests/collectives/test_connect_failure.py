"""A rank whose Gloo cannot connect to its peers says what each side advertised and names
--network-interface (Gloo's error names only the peer's address)."""

from __future__ import annotations

import socket

import psutil
import pytest

from collectives.runtime import bootstrap

GLOO_ERROR = (
    "hvd.init() could not connect rank 0 to its 1 peers: Gloo connectFullMesh failed with "
    "[pair.cc:152] timed out connecting: SO_ERROR: Connection timed out, "
    "remote=[10.9.51.2]:49055$0"
)


def test_a_connect_failure_names_both_sides_and_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    name, entries = next(iter(psutil.net_if_addrs().items()))
    address = next(e.address for e in entries if e.family in (socket.AF_INET, socket.AF_INET6))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)

    def fail() -> None:
        raise RuntimeError(GLOO_ERROR)

    with pytest.raises(RuntimeError) as raised, bootstrap._explained_connect_failure():
        fail()
    message = str(raised.value)
    assert message.startswith(GLOO_ERROR + ". This rank advertised " + f"{name} (")
    assert address.split("%")[0] in message
    assert f"on {socket.gethostname()}; the peer(s) it could not reach advertised 10.9.51.2." in (
        message
    )
    assert "hvdrun --network-interface IF" in message


def test_other_errors_pass_unchanged() -> None:
    with (
        pytest.raises(RuntimeError, match=r"^something else$"),
        bootstrap._explained_connect_failure(),
    ):
        raise RuntimeError("something else")


def test_hvd_init_under_hvdrun_explains_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise RuntimeError(GLOO_ERROR)

    monkeypatch.setattr(bootstrap, "init_from_rendezvous", fail)
    monkeypatch.setenv("HVDRUN_RENDEZVOUS_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("HVDRUN_JOB_ID", "job-test-connect-failure")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(RuntimeError, match="This rank advertised the address of its host name"):
        bootstrap.init()
