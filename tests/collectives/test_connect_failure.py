"""A rank whose Gloo cannot connect to its peers says what each side advertised and names
--network-interface (Gloo's error names only the peer's address)."""

from __future__ import annotations

import datetime
import socket

import psutil
import pytest

from collectives.runtime import reach, registration
from collectives.runtime.state import RuntimeState, Topology

GLOO_TEXT = (
    "Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: "
    "Connection timed out, remote=[10.9.51.2]:49055$0"
)
GLOO_ERROR = "hvd.init() could not connect rank 0 to its 1 peers: " + GLOO_TEXT


def test_a_connect_failure_names_both_sides_and_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    name, entries = next(iter(psutil.net_if_addrs().items()))
    address = next(e.address for e in entries if e.family in (socket.AF_INET, socket.AF_INET6))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    message = str(reach.connect_failure(0, 2, RuntimeError(GLOO_TEXT)))
    assert message.startswith(GLOO_ERROR + ". This rank advertised " + f"{name} (")
    assert address.split("%")[0] in message
    assert f"on {socket.gethostname()}; the peer(s) it could not reach advertised 10.9.51.2." in (
        message
    )
    assert "hvdrun --network-interface IF" in message


def test_hvd_init_under_hvdrun_explains_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default group of a registered generation fails to connect (Gloo's error).
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError(GLOO_TEXT)

    monkeypatch.setattr(registration, "init_default_group", fail)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    topology = Topology(rank=0, size=2, local_rank=0, local_size=1, cross_rank=0, cross_size=2)
    runtime_ = RuntimeState(
        topology=topology,
        backend="gloo",
        timeout=datetime.timedelta(seconds=5),
        store=None,
        client=object(),
    )
    with pytest.raises(RuntimeError, match="This rank advertised the address of its host name"):
        registration._bootstrap(runtime_, 1)
