"""ProxyJump on the namespace hosts: a host that only its jump host may log in to is
reached through that host, as ``ssh -J`` would (tests/cluster.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import Cluster, ClusterHost

PY = sys.executable
WHERE = "import socket; print('on', socket.gethostname())"


@pytest.fixture
def node2_behind_node1(cluster: Cluster) -> Iterator[tuple[ClusterHost, ClusterHost]]:
    """hvd-node2's sshd lets root in only from hvd-node1's address (then restored)."""
    node1, node2 = cluster.hosts[:2]
    original = node2.sshd_config.read_text()
    node2.sshd_config.write_text(original + f"AllowUsers root@{node1.address}\n")
    cluster.stop_sshd(node2)
    cluster.start_sshd(node2)
    try:
        yield node1, node2
    finally:
        node2.sshd_config.write_text(original)
        cluster.stop_sshd(node2)
        cluster.start_sshd(node2)


def test_proxy_jump_reaches_a_host_behind_another(
    cluster: Cluster, node2_behind_node1: tuple[ClusterHost, ClusterHost], tmp_path: Path
) -> None:
    node1, node2 = node2_behind_node1
    login = f"    User root\n    IdentityFile {cluster.client_key}\n    IdentitiesOnly yes\n"
    config = tmp_path / "ssh_config"
    config.write_text(
        f"Host jump1\n    HostName {node1.address}\n{login}"
        f"Host inner2\n    HostName {node2.address}\n    ProxyJump jump1\n{login}"
        f"Host direct2\n    HostName {node2.address}\n{login}"
    )
    direct = cluster.hvdrun("--ssh-config-file", str(config), "-H", "direct2", "true")
    assert direct.returncode == 255
    assert "authentication failed for user root" in direct.stderr

    argv = ["--verbose", "--ssh-config-file", str(config), "-H", "jump1:1,inner2:1"]
    result = cluster.hvdrun(*argv, PY, "-c", WHERE)
    assert result.returncode == 0, result.stderr
    assert f"[0]<stdout>:on {node1.uts_hostname}" in result.stdout
    assert f"[1]<stdout>:on {node2.uts_hostname}" in result.stdout
    # --verbose tells how each host was reached, and the remote agents' own messages
    assert (
        f"inner2: connecting to root@{node2.address} port 22 via ProxyJump jump1" in result.stderr
    )
    assert "agent on inner2: hvdrun agent: DEBUG launcher.agent.session: starting 1 worker(s)" in (
        result.stderr
    )
    # node2 saw the login come from node1
    assert f"Accepted publickey for root from {node1.address}" in node2.sshd_log.read_text()


def test_ctrl_c_at_the_terminal_stops_a_job_reached_through_a_proxy_command(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A terminal's Ctrl-C reaches hvdrun's whole process group: the ProxyCommand must not
    die of it first, or hvdrun takes the Ctrl-C for a lost host (exit 255)."""
    if shutil.which("ssh") is None:
        pytest.skip("the ssh client (openssh-client) is needed as ProxyCommand")
    node1, node2 = cluster.hosts[:2]
    config = cluster.proxied_config(tmp_path / "ssh_config", "via1", node2, node1)
    script = "import time; print('ready', flush=True); time.sleep(60)"
    argv = ["--ssh-config-file", str(config), "-H", "via1:1", PY, "-c", script]
    proc = subprocess.Popen(
        cluster.hvdrun_argv(*argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=cluster.env(),
        start_new_session=True,  # (its own process group, as a terminal's foreground job)
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "[0]<stdout>:ready\n", proc.stderr.read() if proc.stderr else line
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "received SIGINT; stopping all workers" in stderr
    assert "lost the connection" not in stderr, stderr
