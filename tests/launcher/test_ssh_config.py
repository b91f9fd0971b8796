"""How a host of -H becomes SSH settings: ~/.ssh/config, then -p/-i, as with OpenSSH."""

from __future__ import annotations

import getpass
import socket
import time
from pathlib import Path

import pytest

from launcher.spec.options import SSHOptions
from launcher.transport.ssh import SSHConnector
from launcher.transport.ssh_config import SSHConnectError, load_config, resolve_target

CONFIG = """
Host gpu*
    User trainer
    Port 2200
    IdentityFile ~/keys/gpu_key
    IdentitiesOnly yes

Host gpu1
    HostName 10.1.0.1
    HostKeyAlias gpu-one

Host behind
    HostName 10.2.0.7
    ProxyCommand ssh -W %h:%p bastion
    UserKnownHostsFile ~/.ssh/cluster_hosts /dev/null
    StrictHostKeyChecking yes

Host lax
    StrictHostKeyChecking no
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(CONFIG)
    return tmp_path


def test_config_host_name_user_port_identity(home: Path) -> None:
    target = resolve_target("gpu1", SSHOptions())
    assert (target.hostname, target.user, target.port) == ("10.1.0.1", "trainer", 2200)
    assert target.identity_files == (f"{home}/keys/gpu_key",)
    assert target.identities_only
    assert target.proxy_command is None
    assert target.known_hosts_files == (f"{home}/.ssh/known_hosts",)
    assert target.host_key_policy == "accept-new"
    assert target.key_name == "[gpu-one]:2200"  # how OpenSSH files it in known_hosts


def test_flags_take_precedence_over_the_config(home: Path) -> None:
    options = SSHOptions(port=2222, identity_files=("~/id_cli",), host_key_policy="off")
    target = resolve_target("admin@gpu7", options)
    assert (target.hostname, target.user, target.port) == ("gpu7", "admin", 2222)
    assert target.identity_files == (f"{home}/id_cli", f"{home}/keys/gpu_key")
    assert target.host_key_policy == "off"


def test_proxy_command_known_hosts_and_strict_checking(home: Path) -> None:
    target = resolve_target("behind", SSHOptions())
    assert target.proxy_command == "ssh -W 10.2.0.7:22 bastion"
    assert target.known_hosts_files == (f"{home}/.ssh/cluster_hosts", "/dev/null")
    assert target.host_key_policy == "strict"
    assert resolve_target("lax", SSHOptions()).host_key_policy == "off"


def test_unlisted_host_gets_the_defaults(home: Path) -> None:
    target = resolve_target("10.9.9.9", SSHOptions())
    assert (target.hostname, target.port, target.user) == ("10.9.9.9", 22, getpass.getuser())
    assert target.identity_files == ()
    assert target.key_name == "10.9.9.9"


def test_no_config_file_is_fine_but_a_missing_explicit_one_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/config at all
    assert resolve_target("n9", SSHOptions()).hostname == "n9"
    with pytest.raises(SSHConnectError, match="does not exist"):
        load_config(str(tmp_path / "missing"))


def test_alternative_config_file(tmp_path: Path) -> None:
    config = tmp_path / "cfg"
    config.write_text("Host n1\n    HostName 10.3.0.1\n    User bob\n")
    target = resolve_target("n1", SSHOptions(config_file=str(config)))
    assert (target.hostname, target.user) == ("10.3.0.1", "bob")


def _target(port: int, home: Path) -> object:
    return resolve_target("127.0.0.1", SSHOptions(port=port, config_file=str(home / ".ssh/config")))


def test_refused_connection_is_named(home: Path) -> None:
    with socket.socket() as sock:  # a port that is certainly closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    connector = SSHConnector(_target(port, home))  # type: ignore[arg-type]
    with pytest.raises(SSHConnectError) as info:
        connector.connect(time.monotonic() + 5)
    assert str(info.value) == (
        f"connection refused by 127.0.0.1 port {port} (is sshd running there?)"
    )


def test_a_server_that_is_not_sshd(home: Path) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        connector = SSHConnector(_target(port, home))  # type: ignore[arg-type]
        with pytest.raises(
            SSHConnectError,
            match=f"(no SSH server answered at|SSH handshake with) 127.0.0.1 port {port}",
        ):
            connector.connect(time.monotonic() + 1.5)
