"""A ``--rendezvous-addr`` the rendezvous server cannot listen on is one line, no traceback."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

from hvdrun.cli import run_cli


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("elastic", [[], ["--min-np", "1", "--max-np", "1"]])
def test_a_busy_rendezvous_port_is_one_error_line(
    elastic: list[str], busy_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    addr = f"127.0.0.1:{busy_port}"
    argv = ["-np", "1", "-H", "localhost:1", *elastic, "--rendezvous-addr", addr]
    code = run_cli([*argv, sys.executable, "-c", "pass"])
    err = capsys.readouterr().err
    assert code == 255  # as when a host cannot be started
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("hvdrun: error:")]
    assert errors == [
        f"hvdrun: error: --rendezvous-addr {addr}: the rendezvous server cannot listen on "
        f"{addr}: port {busy_port} is in use"
    ]
    assert "add_port" not in err  # (gRPC's own log line)


def test_an_address_of_another_machine_cannot_be_listened_on() -> None:
    from rendezvous.server.serving import ListenError, RendezvousServer

    server = RendezvousServer([], "s" * 32, "job", bind_host="192.0.2.1", port=0)
    with pytest.raises(ListenError, match=r"192\.0\.2\.1:0: it is not an address of this"):
        server.start()
    server.stop()
