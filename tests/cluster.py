"""A throw-away cluster for SSH tests: hosts as network namespaces, each with its own sshd.

As root, :func:`start_cluster` creates a bridge in this machine's network namespace (it
plays the launching host, at ``.1`` of a private /24 under 10.213.0.0/16 used nowhere
else) and K hosts, each a network namespace with a veth on the bridge (``.11``, ``.12``,
...; :meth:`Cluster.side_link` adds a second link to one host, under 10.212.0.0/16), a UTS
hostname of its own that resolves nowhere, and an ``sshd`` listening on ports 22 and 2222
that accepts one test key (no PAM, no DNS). The filesystem is shared, so the
hosts run this checkout's Python, as a cluster with a shared home directory would, except
for :attr:`Cluster.local_only`, a directory that is empty on the hosts (each host mounts a
tmpfs of its own there) to test what hvdrun says about a host that lacks an installation.

Host ``i`` is reachable under the ssh-config alias ``hvd-node<i>`` (HostName, User,
IdentityFile) written to a test HOME's ``.ssh/config``; :meth:`Cluster.env` points HOME
there and drops SSH_AUTH_SOCK, so the tests never see the developer's own SSH set-up.
hvdrun runs through :meth:`Cluster.hvdrun_argv`, in a mount namespace whose resolv.conf
names only 127.0.0.1: names that are not in /etc/hosts fail to resolve at once, and no DNS
query leaves the machine.

Names embed the pid of the test process and a per-process cluster number
(``hvdt<pid>c<n>...``), so two runs, or two clusters of one run, never collide;
leftovers of runs whose process is gone (a killed pytest) are removed at start. Teardown
kills every process in the namespaces and deletes them, the veths and the bridge, whatever
the tests did. Without root, ``ip``, ``unshare`` or ``sshd`` the tests skip and say why.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

PREFIX = "hvdt"
SSH_PORTS = (22, 2222)
SUBNET_BASE = "10.213"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
_CLUSTER_NUMBERS = itertools.count()


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` for a daemon a test starts (with ``start_new_session=True``): SIGKILL when the
    test process goes away. ``setpriv`` sets the parent-death signal rather than a
    ``preexec_fn``, which would make ``subprocess`` fork() a process whose gRPC threads are
    running: gRPC's fork handlers can kill the child before it execs, and the test then meets
    a daemon that never started."""
    return ["setpriv", "--pdeathsig", "KILL", *argv]


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def unavailable_reason() -> str | None:
    """Why the cluster cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root)"
    linux_tools = (("unshare", "util-linux"), ("nsenter", "util-linux"), ("setpriv", "util-linux"))
    tools = (("ip", "iproute2"), *linux_tools)
    for tool, package in (*tools, ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing (apt-get install {package})"
    if not os.path.exists(SSHD):
        return "sshd is missing (apt-get install openssh-server)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


def _owner_alive(name: str) -> bool:
    match = re.match(rf"^{PREFIX}(\d+)", name)
    if match is None:
        return True  # not ours to judge
    try:
        return psutil.Process(int(match.group(1))).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _netns_pids(netns: str) -> list[int]:
    result = _run("ip", "netns", "pids", netns, check=False)
    return [int(pid) for pid in result.stdout.split()]


def _delete_netns(netns: str) -> None:
    for _ in range(20):  # processes may fork while we kill them
        pids = _netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _run("ip", "netns", "delete", netns, check=False)


def remove_stale() -> None:
    """Deletes namespaces and bridges left by test runs whose process is gone."""
    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        netns = line.split()[0] if line.split() else ""
        if netns.startswith(PREFIX) and not _owner_alive(netns):
            _delete_netns(netns)
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for name in re.findall(rf"^\d+: ({PREFIX}\d+\w*?)[@:]", links, flags=re.M):
        if not _owner_alive(name):
            _run("ip", "link", "delete", name, check=False)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        if not _owner_alive(path.name):
            shutil.rmtree(path, ignore_errors=True)


def _free_subnet() -> str:
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    start = os.getpid() % 200 + 20
    for offset in range(200):
        subnet = f"{SUBNET_BASE}.{(start + offset) % 250 + 1}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError(f"no free /24 under {SUBNET_BASE}.0.0/16")


@dataclass
class ClusterHost:
    index: int
    alias: str  # name in the test ssh config
    uts_hostname: str  # what `hostname` says on the host; resolves nowhere
    address: str
    netns: str
    veth: str
    host_key: Path
    sshd_config: Path
    sshd_log: Path
    sshd: subprocess.Popen[bytes] | None = None

    @property
    def netns_inode(self) -> int:
        return os.stat(f"/run/netns/{self.netns}").st_ino


@dataclass
class Cluster:
    root: Path
    subnet: str
    bridge: str
    hosts: list[ClusterHost] = field(default_factory=list)

    @property
    def gateway(self) -> str:
        """This machine's address on the cluster's bridge."""
        return f"{self.subnet}.1"

    @property
    def unused_address(self) -> str:
        """An address in the subnet where nothing answers (not even ARP)."""
        return f"{self.subnet}.99"

    @property
    def client_key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def known_hosts(self) -> Path:
        return self.home / ".ssh" / "known_hosts"

    @property
    def local_only(self) -> Path:
        """A directory of this machine that is empty (a tmpfs of their own) on the hosts."""
        return self.root / "local-only"

    def on_host_filesystem(self, host: ClusterHost, *argv: str) -> None:
        """Runs a command in the host's view of the filesystem (to install things there)."""
        assert host.sshd is not None
        _run("nsenter", "--target", str(host.sshd.pid), "--mount", "--", *argv)

    @property
    def resolv_conf(self) -> Path:
        return self.root / "resolv.conf"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SSH_")}
        env["HOME"] = str(self.home)
        env.update(extra)
        return env

    def hvdrun_argv(self, *args: str) -> list[str]:
        """``python -m hvdrun ARGS`` with DNS pointed at loopback (see the module docstring)."""
        return self.python_argv("-m", "hvdrun", *args)

    def python_argv(self, *args: str) -> list[str]:
        """``python ARGS`` (a script that launches jobs itself) as :meth:`hvdrun_argv` runs."""
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        return [
            "unshare",
            "--mount",
            "--",
            "sh",
            "-c",
            script,
            str(self.resolv_conf),
            sys.executable,
            *args,
        ]

    def hvdrun(
        self,
        *args: str,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.hvdrun_argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or self.env(),
            stdin=subprocess.DEVNULL,
            cwd=cwd,
        )

    # ---- the hosts --------------------------------------------------------------------

    def start_sshd(self, host: ClusterHost) -> None:
        # The host's own mounts: local_only is an empty tmpfs there.
        script = f'hostname "$0" && mount -t tmpfs hvdt "$3" && exec {SSHD} -D -f "$1" -E "$2"'
        host.sshd = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                "unshare",
                "--uts",
                "--mount",
                "--",
                "sh",
                "-c",
                script,
                host.uts_hostname,
                str(host.sshd_config),
                str(host.sshd_log),
                str(self.local_only),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60  # (ends once it listens; CI hosts may be loaded)
        while time.monotonic() < deadline:
            if host.sshd.poll() is not None:
                error = host.sshd.stderr.read().decode() if host.sshd.stderr else ""
                log = host.sshd_log.read_text() if host.sshd_log.exists() else ""
                raise RuntimeError(f"sshd on {host.alias} exited: {error} {log}")
            with contextlib.suppress(OSError), socket.create_connection((host.address, 22), 0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd on {host.alias} did not start listening")

    def stop_sshd(self, host: ClusterHost) -> None:
        if host.sshd is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(host.sshd.pid, signal.SIGKILL)
            host.sshd.wait()
            host.sshd = None

    def replace_host_key(self, host: ClusterHost, key: Path) -> None:
        """Restarts the host's sshd with another host key (a reinstalled host, or an attacker)."""
        self.stop_sshd(host)
        _write_sshd_config(host, self, key)
        self.start_sshd(host)

    def set_link(self, host: ClusterHost, up: bool) -> None:
        """Cuts (or restores) the host's cable: its veth on the bridge goes down."""
        _run("ip", "link", "set", host.veth, "up" if up else "down")

    def blackhole(self, host: ClusterHost, peer: ClusterHost, on: bool) -> None:
        """Makes ``host``'s packets to ``peer`` vanish without an error (or undoes it): a
        neighbour entry points the peer's address at a MAC address no one has, as a firewall
        that drops silently would. Both still reach this machine (hvdrun, the rendezvous)."""
        if on:
            _run("ip", "-n", host.netns, "neigh", "replace", peer.address, "lladdr",
                 "02:00:00:00:00:99", "dev", "eth0", "nud", "permanent")  # fmt: skip
        else:
            _run("ip", "-n", host.netns, "neigh", "del", peer.address, "dev", "eth0", check=False)

    @contextlib.contextmanager
    def side_link(self, host: ClusterHost) -> Iterator[tuple[str, str]]:
        """A second cable between this machine and ``host`` alone, a /30 of its own under
        10.212.0.0/16 (a management network the other hosts are not on, and no route leads
        from them to it; its addresses sort below the cluster's own); yields (this
        machine's address on it, the host's); removed on exit. The host's end is its
        interface ``side0``."""
        net = f"10.212.{self.subnet.rsplit('.', 1)[1]}"
        mine, theirs = f"{net}.{4 * host.index + 1}", f"{net}.{4 * host.index + 2}"
        link = f"{host.veth.removesuffix(f'v{host.index}')}s{host.index}"
        _run("ip", "link", "add", link, "type", "veth", "peer", "side0", "netns", host.netns)
        try:
            _run("ip", "addr", "add", f"{mine}/30", "dev", link)
            _run("ip", "link", "set", link, "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{theirs}/30", "dev", "side0")
            _run("ip", "-n", host.netns, "link", "set", "side0", "up")
            yield mine, theirs
        finally:
            _run("ip", "link", "delete", link, check=False)

    def processes_on(self, host: ClusterHost) -> list[psutil.Process]:
        """Every process running in the host's network namespace."""
        inode = host.netns_inode
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == inode:
                    found.append(proc)
        return found

    def proxied_config(
        self, path: Path, alias: str, target: ClusterHost, via: ClusterHost, more: str = ""
    ) -> Path:
        """Writes an ssh_config at ``path`` whose ``alias`` reaches ``target`` as root through
        a ProxyCommand on ``via`` (``ssh -W``, the ssh client of openssh-client; ``more``:
        further option lines); returns ``path``."""
        proxy = (
            f"ssh -F /dev/null -i {self.client_key} -o BatchMode=yes "
            "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "
            f"-W %h:%p root@{via.address}"
        )
        path.write_text(
            f"Host {alias}\n    HostName {target.address}\n    User root\n"
            f"    IdentityFile {self.client_key}\n    ProxyCommand {proxy}\n{more}"
        )
        return path

    def new_key(self, name: str) -> Path:
        path = self.root / name
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path))
        return path

    # ---- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        for host in self.hosts:
            with contextlib.suppress(Exception):
                self.stop_sshd(host)
            _delete_netns(host.netns)
            _run("ip", "link", "delete", host.veth, check=False)
        _run("ip", "link", "delete", self.bridge, check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _write_sshd_config(host: ClusterHost, cluster: Cluster, host_key: Path) -> None:
    lines = [*(f"Port {port}" for port in SSH_PORTS)]
    lines += [
        f"HostKey {host_key}",
        f"PidFile {cluster.root / f'sshd-{host.index}.pid'}",
        f"AuthorizedKeysFile {cluster.root / 'authorized_keys'}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "UseDNS no",
        "PermitRootLogin prohibit-password",
        "StrictModes no",
        "PrintMotd no",
        "PrintLastLog no",
        "MaxStartups 100",
        "LogLevel VERBOSE",
    ]
    host.sshd_config.write_text("\n".join(lines) + "\n")


def _write_client_config(cluster: Cluster) -> None:
    ssh_dir = cluster.home / ".ssh"
    ssh_dir.mkdir(parents=True, mode=0o700)
    key = cluster.client_key
    lines = []
    for host in cluster.hosts:
        lines += [f"Host {host.alias}", f"    HostName {host.address}"]
    lines += [
        f"Host {cluster.subnet}.* hvd-node*",
        "    User root",
        f"    IdentityFile {key}",
        "    IdentitiesOnly yes",
    ]
    (ssh_dir / "config").write_text("\n".join(lines) + "\n")
    cluster.known_hosts.touch(mode=0o600)


def start_cluster(hosts: int, sshd_hosts: int) -> Cluster:
    """K hosts; the first ``sshd_hosts`` run sshd, the others are up but refuse SSH."""
    remove_stale()
    pid = os.getpid()
    # At most 15 characters per interface name: hvdt + pid (<= 7 digits) + c<n> + v<i>.
    tag = f"{pid}c{next(_CLUSTER_NUMBERS) % 10}"
    root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-"))
    os.chmod(root, 0o755)
    cluster = Cluster(root=root, subnet=_free_subnet(), bridge=f"{PREFIX}{tag}br")
    try:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation
        cluster.local_only.mkdir()
        cluster.resolv_conf.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        key = cluster.new_key("id_ed25519")
        shutil.copy(f"{key}.pub", root / "authorized_keys")
        _run("ip", "link", "add", cluster.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{cluster.gateway}/24", "dev", cluster.bridge)
        _run("ip", "link", "set", cluster.bridge, "up")
        for index in range(1, hosts + 1):
            host = ClusterHost(
                index=index,
                alias=f"hvd-node{index}",
                uts_hostname=f"{PREFIX}-node{index}-{pid}.invalid",
                address=f"{cluster.subnet}.{10 + index}",
                netns=f"{PREFIX}{tag}n{index}",
                veth=f"{PREFIX}{tag}v{index}",
                host_key=cluster.new_key(f"host{index}_key"),
                sshd_config=root / f"sshd{index}.conf",
                sshd_log=root / f"sshd{index}.log",
            )
            cluster.hosts.append(host)
            _run("ip", "netns", "add", host.netns)
            peer = ("peer", "eth0", "netns", host.netns)
            _run("ip", "link", "add", host.veth, "type", "veth", *peer)
            _run("ip", "link", "set", host.veth, "master", cluster.bridge, "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            _write_sshd_config(host, cluster, host.host_key)
        _write_client_config(cluster)
        for host in cluster.hosts[:sshd_hosts]:
            cluster.start_sshd(host)
        check = cluster.hvdrun("--version")  # can hvdrun run in the DNS-less mount namespace?
        if check.returncode != 0:
            raise RuntimeError(f"cannot run hvdrun without DNS: {check.stderr.strip()}")
    except BaseException:
        cluster.close()
        raise
    return cluster


def cluster_for_tests(hosts: int, sshd_hosts: int, tests: str) -> Iterator[Cluster]:
    """The body of a cluster fixture: :func:`start_cluster`, closed after the tests; where
    it cannot be built, the ``tests`` (e.g. "SSH cluster tests") skip and say why."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"{tests} skipped: {reason}")
    try:
        built = start_cluster(hosts=hosts, sshd_hosts=sshd_hosts)
    except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        pytest.skip(f"{tests} skipped: cannot build the test cluster: {detail}")
    try:
        yield built
    finally:
        built.close()


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Three hosts: hvd-node1 and hvd-node2 run sshd; hvd-node3 is up but runs none."""
    yield from cluster_for_tests(hosts=3, sshd_hosts=2, tests="SSH cluster tests")


def listening_sshd(proc: psutil.Process) -> bool:
    """Whether the process is a host's listening sshd (not a session it forked)."""
    return "sshd" in proc.name() and "-D -f" in " ".join(proc.cmdline())


def assert_hosts_clean(cluster: Cluster, hosts: list[ClusterHost], within: float) -> None:
    """Nothing but sshd itself is left running on the hosts."""
    deadline = time.monotonic() + within
    left: list[str] = []
    while time.monotonic() < deadline:
        left = []
        for host in hosts:
            for proc in cluster.processes_on(host):
                try:
                    if proc.status() == psutil.STATUS_ZOMBIE or listening_sshd(proc):
                        continue
                    cmdline = " ".join(proc.cmdline())
                except psutil.Error:
                    continue
                left.append(f"{host.alias}: {proc.pid} {cmdline}")
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError("left running on the hosts:\n" + "\n".join(left))


def kill_host(cluster: Cluster, host: ClusterHost, *, sshd: bool = False) -> None:
    """SIGKILLs every process of the host at once: its agent, workers and SSH session, and
    with ``sshd`` its listening sshd too (restart it with ``cluster.start_sshd``); without,
    the host can come back later."""
    victims = []
    for proc in cluster.processes_on(host):
        with contextlib.suppress(psutil.Error):
            if not sshd and listening_sshd(proc):
                continue
            victims.append(proc)
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)


def write_hosts(path: Path, *hosts: ClusterHost) -> None:
    """Writes a discovery script's answer (one ssh alias a line), atomically: a script
    that reads it never sees half a file."""
    temporary = path.with_suffix(".new")
    temporary.write_text("".join(f"{host.alias}\n" for host in hosts))
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
