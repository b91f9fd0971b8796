"""How a host of -H becomes SSH settings: ~/.ssh/config, then -p/-i, as with OpenSSH."""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.spec.options import SSHOptions
from launcher.transport import ssh_config
from launcher.transport.ssh import SSHConnector, append_whole_line
from launcher.transport.ssh_config import (
    SSHConnectError,
    jump_target,
    load_config,
    resolve_target,
    split_jump,
)
from tests.processes import REPO

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


def test_a_proxy_command_s_secrets_are_masked_where_shown(home: Path) -> None:
    # The plan (--dry-run) and the debug log show the ProxyCommand; a credential among its
    # options must not travel with it (ssh -v prints it, hvdrun does not).
    (home / ".ssh" / "config").write_text(
        "Host tunnel\n    ProxyCommand cloudflared access ssh --hostname %h "
        "--service-token-id abc --service-token-secret S3CRET --password=pw1 -W %h:%p\n"
    )
    target = resolve_target("tunnel", SSHOptions())
    assert target.proxy_command is not None and "S3CRET" in target.proxy_command
    assert target.shown_proxy_command == (
        "cloudflared access ssh --hostname tunnel --service-token-id **** "
        "--service-token-secret **** --password=**** -W tunnel:22"
    )


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


# ---- Include, /etc/ssh/ssh_config and ProxyJump, as OpenSSH reads them -------------------


@pytest.fixture
def system_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /etc/ssh/ssh_config (and its directory, for relative Includes)."""
    etc = tmp_path / "etc-ssh"
    etc.mkdir()
    path = etc / "ssh_config"
    path.write_text("")
    monkeypatch.setattr(ssh_config, "SYSTEM_CONFIG", str(path))
    return path


def test_include_relative_glob_and_inside_a_host_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, system_config: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    ssh = tmp_path / ".ssh"
    (ssh / "conf.d").mkdir(parents=True)
    (ssh / "conf.d" / "10-cluster.conf").write_text("Host node*\n    User trainer\n    Port 2201\n")
    (ssh / "conf.d" / "20-lab.conf").write_text("Host lab1\n    HostName 10.7.0.1\n")
    (ssh / "conf.d" / "notes.txt").write_text("Host node*\n    User wrong\n")
    (ssh / "gpu-keys").write_text("IdentityFile ~/keys/gpu\n")
    (ssh / "config").write_text(
        "Include conf.d/*.conf\n"
        "Host gpu*\n"
        "    Include gpu-keys\n"
        "    Port 2300\n"  # still under 'Host gpu*' after the Include
        "Host *\n"
        "    User everyone\n"
    )
    node = resolve_target("node3", SSHOptions())
    assert (node.user, node.port) == ("trainer", 2201)
    assert resolve_target("lab1", SSHOptions()).hostname == "10.7.0.1"
    gpu = resolve_target("gpu2", SSHOptions())
    assert (gpu.user, gpu.port, gpu.identity_files) == ("everyone", 2300, (f"{tmp_path}/keys/gpu",))
    assert resolve_target("other", SSHOptions()).port == 22  # the gpu block's Port stayed in it


def test_system_config_is_read_after_the_users(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, system_config: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host n1\n    User alice\n")
    (system_config.parent / "ssh_config.d").mkdir()
    (system_config.parent / "ssh_config.d" / "site.conf").write_text(
        "Host *.site\n    ProxyJump gateway.site\n"
    )
    system_config.write_text("Include ssh_config.d/*.conf\nHost *\n    User root\n    Port 2022\n")
    target = resolve_target("n1", SSHOptions())
    assert (target.user, target.port) == ("alice", 2022)  # the user's value first
    assert resolve_target("x.site", SSHOptions()).proxy_jump == "gateway.site"
    # --ssh-config-file replaces both, like ssh -F
    alone = resolve_target("n1", SSHOptions(config_file=str(tmp_path / ".ssh" / "config")))
    assert (alone.user, alone.port) == ("alice", 22)


def test_include_loop_is_an_error(tmp_path: Path, system_config: Path) -> None:
    config = tmp_path / "loop"
    config.write_text(f"Include {config}\n")
    with pytest.raises(SSHConnectError, match="Include nested more than 16 deep"):
        load_config(str(config))


def test_proxy_jump_from_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, system_config: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text(
        "Host inner\n    HostName 10.9.0.2\n    ProxyJump ops@bastion:2022,relay\n"
        "Host relay\n    User relayuser\n"
        "Host direct\n    ProxyJump none\n"
    )
    inner = resolve_target("inner", SSHOptions(port=2200, identity_files=("~/k",)))
    assert inner.proxy_jump == "ops@bastion:2022,relay"
    hop = jump_target(inner.proxy_jump, SSHOptions(port=2200, identity_files=("~/k",)))
    # the last hop, reached through the hops before it; -p and -i are not for jump hosts
    assert (hop.user, hop.hostname, hop.port, hop.identity_files) == ("relayuser", "relay", 22, ())
    assert hop.proxy_jump == "ops@bastion:2022"
    first = jump_target(hop.proxy_jump, SSHOptions())
    assert (first.user, first.hostname, first.port, first.proxy_jump) == (
        "ops",
        "bastion",
        2022,
        None,
    )
    assert resolve_target("direct", SSHOptions()).proxy_jump is None


@pytest.mark.parametrize(
    ("hop", "expected"),
    [
        ("bastion", ("bastion", None)),
        ("ops@bastion:2022", ("ops@bastion", 2022)),
        ("ssh://ops@bastion:2022", ("ops@bastion", 2022)),
        ("[fe80::1]:2022", ("fe80::1", 2022)),
        ("fe80::1", ("fe80::1", None)),
    ],
)
def test_split_jump(hop: str, expected: tuple[str, int | None]) -> None:
    assert split_jump(hop) == expected


def test_jump_host_failure_is_named(home: Path) -> None:
    with socket.socket() as sock:  # a port that is certainly closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = home / ".ssh" / "config"
    config.write_text(f"Host inner\n    ProxyJump 127.0.0.1:{port}\n")
    target = resolve_target("inner", SSHOptions(config_file=str(config)))
    with pytest.raises(SSHConnectError) as info:
        SSHConnector(target).connect(time.monotonic() + 5)
    assert str(info.value) == (
        f"ProxyJump host 127.0.0.1:{port}: connection refused by 127.0.0.1 port {port} "
        "(is sshd running there?)"
    )


def _openssh_view(config: Path, alias: str) -> dict[str, list[str]]:
    """What ``ssh -G`` (OpenSSH's own resolution) says about ``alias``."""
    result = subprocess.run(
        ["ssh", "-G", "-F", str(config), alias],
        capture_output=True,
        text=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
        check=True,
    )
    view: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        view.setdefault(key, []).append(value)
    return view


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's ssh client")
def test_resolution_agrees_with_openssh(tmp_path: Path, system_config: Path) -> None:
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "a.conf").write_text(
        f"Host gpu*\n  User trainer\n  IdentityFile {tmp_path}/k1\n"
    )
    (tmp_path / "inc2").write_text(f"IdentityFile {tmp_path}/k2\n")
    config = tmp_path / "cfg"
    config.write_text(
        f"Include {tmp_path}/inc/*.conf\n"
        "Host gpu2\n"
        "  Port 2300\n"
        f"  Include {tmp_path}/inc2\n"
        "  ProxyJump ops@bastion:2022\n"
        "  HostName 10.8.0.2\n"
        "Host *\n"
        "  User everyone\n"
        f"  IdentityFile {tmp_path}/k3\n"
    )
    for alias in ("gpu1", "gpu2", "other"):
        ours = resolve_target(alias, SSHOptions(config_file=str(config)))
        theirs = _openssh_view(config, alias)
        assert ours.user == theirs["user"][0]
        assert ours.hostname == theirs["hostname"][0]
        assert ours.port == int(theirs["port"][0])
        assert list(ours.identity_files) == theirs["identityfile"]
        assert ours.proxy_jump == theirs.get("proxyjump", [None])[0]


def test_a_system_config_paramiko_cannot_read_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, system_config: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host n1\n    User alice\n")
    system_config.write_text("Match all host x\n    User root\n")
    assert resolve_target("n1", SSHOptions()).user == "alice"
    # the user's own broken file is an error, as before
    (tmp_path / ".ssh" / "config").write_text("Match user\n")
    monkeypatch.setattr(ssh_config, "SYSTEM_CONFIG", str(tmp_path / "none"))
    with pytest.raises(SSHConnectError, match="cannot read ssh config"):
        resolve_target("n1", SSHOptions())


def test_a_failing_proxy_command_shows_what_it_said(home: Path) -> None:
    """As ssh shows a ProxyCommand's stderr, the error carries its last words."""
    config = home / ".ssh" / "config"
    config.write_text(
        "Host inner\n    ProxyCommand sh -c "
        "'echo \"ssh: Could not resolve hostname bastion.corp\" >&2; exit 255'\n"
    )
    target = resolve_target("inner", SSHOptions(config_file=str(config)))
    started = time.monotonic()
    with pytest.raises(SSHConnectError) as info:
        SSHConnector(target).connect(time.monotonic() + 5)
    assert time.monotonic() - started < 3
    assert str(info.value) == (
        "its ProxyCommand exited with code 255: ssh: Could not resolve hostname bastion.corp"
    )


def test_a_user_id_without_a_name_asks_for_the_ssh_user(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's uid with no passwd entry and no USER: the SSH user must be given."""
    import getpass

    def nameless() -> str:
        raise KeyError("getpwuid(): uid not found: 12345")

    monkeypatch.setattr(getpass, "getuser", nameless)
    for alias in ("n7", "trainer@n7"):  # (paramiko's config lookup asks for it too)
        with pytest.raises(SSHConnectError) as info:
            resolve_target(alias, SSHOptions())
        assert str(info.value).startswith(
            "cannot read the ssh config for n7: this process's user id "
        ), info.value
        assert "and USER is not set (a container's user, say): export USER=<a name>" in str(
            info.value
        )


def test_a_known_hosts_line_is_appended_whole_or_not_at_all(tmp_path: Path) -> None:
    # A full disk cut a host's line short, and the next host's then ran on from it.
    known = tmp_path / "known_hosts"
    known.write_bytes(b"a ssh-ed25519 AAAA\nb ssh-ed25519 BB")  # (an earlier fragment)
    with known.open("a+b", buffering=0) as handle:
        append_whole_line(handle.fileno(), b"c ssh-ed25519 CCCC\n")
    assert known.read_bytes() == b"a ssh-ed25519 AAAA\nb ssh-ed25519 BB\nc ssh-ed25519 CCCC\n"
    script = (
        "import os, resource, sys\n"
        "from launcher.transport.ssh import append_whole_line\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(sys.argv[1]) + 8, -1))\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_APPEND)\n"
        "try:\n"
        "    append_whole_line(fd, b'd ssh-ed25519 DDDDDDDDDDDDDDDD\\n')\n"
        "except OSError as error:\n"
        "    print(error.strerror)\n"
    )
    before = known.read_bytes()
    result = subprocess.run(
        [sys.executable, "-c", script, str(known)], capture_output=True, text=True, cwd=REPO
    )
    assert result.stdout == "File too large\n", result
    assert known.read_bytes() == before
