"""hvdrun over SSH on real sshd hosts (tests/cluster.py): placement, failures, cleanup.

Hosts are network namespaces whose own hostnames resolve nowhere; hvdrun reaches them by
ssh-config alias or address. Workers report the host name and the address they run at, so
every check below is made from inside the hosts.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launcher.output import RANK_COLOURS
from tests.cluster import Cluster, ClusterHost, assert_hosts_clean
from tests.launcher.pythons import make_venv, venv_needing_library_path
from tests.launcher.reports import placements
from tests.processes import assert_gone

SCRIPTS = Path(__file__).parent / "scripts"
PY = sys.executable


def worker_pids(line: str) -> list[int]:
    return [int(p) for p in line.split("pids ", 1)[1].split()] if "pids " in line else []


def wait_for_pids(proc: subprocess.Popen[str], count: int) -> list[int]:
    """Reads hvdrun's stdout until ``count`` fail_rank.py workers have reported their pids."""
    pids: list[int] = []
    assert proc.stdout is not None
    while len(pids) < 2 * count:
        line = proc.stdout.readline()
        if not line:
            stderr = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"hvdrun ended early ({proc.wait()}): {stderr}")
        pids += worker_pids(line)
    return pids


def start_job(cluster: Cluster, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cluster.hvdrun_argv(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env or cluster.env(),
    )


def test_two_hosts_two_slots_from_a_hostfile(cluster: Cluster, tmp_path: Path) -> None:
    node1, node2 = cluster.hosts[:2]
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# the test cluster\n{node1.alias} slots=2\n\n{node2.alias}:2  # two\n")
    result = cluster.hvdrun("--hostfile", str(hostfile), PY, str(SCRIPTS / "placement.py"))
    assert result.returncode == 0, result.stderr
    found = placements(result.stdout)
    assert sorted(found) == [0, 1, 2, 3]
    for rank, report in found.items():
        host = node1 if rank < 2 else node2
        assert report["hostname"] == host.uts_hostname  # it really ran there...
        assert report["address"] == host.address  # ...and reaches the rendezvous from there
        assert report["rendezvous"].startswith(f"{cluster.gateway}:")
        assert (report["rank"], report["size"]) == (rank, 4)
        assert (report["local_rank"], report["local_size"]) == (rank % 2, 2)
        assert (report["cross_rank"], report["cross_size"]) == (rank // 2, 2)
        assert report["gloo_ifname"] == report["nccl_ifname"] == "eth0"
        assert report["sum"] == 1 + 2 + 3 + 4
        assert report["gathered"] == [0, 1, 2, 3]
    # accept-new recorded both hosts' keys for next time
    known = cluster.known_hosts.read_text()
    assert f"{node1.address} ssh-ed25519 " in known and f"{node2.address} ssh-ed25519 " in known


def test_this_machine_and_a_remote_host_in_one_job(cluster: Cluster) -> None:
    node1 = cluster.hosts[0]
    result = cluster.hvdrun(
        "-H", f"{cluster.gateway}:1,{node1.address}:1", PY, str(SCRIPTS / "placement.py")
    )
    assert result.returncode == 0, result.stderr
    found = placements(result.stdout)
    # the local rank's Gloo must face the other host, not loopback
    assert found[0]["address"] == cluster.gateway
    assert found[0]["gloo_ifname"] == cluster.bridge
    assert found[1]["hostname"] == node1.uts_hostname
    assert found[0]["sum"] == found[1]["sum"] == 3


def test_a_host_reached_over_another_network_gives_gloo_the_one_its_peers_share(
    cluster: Cluster,
) -> None:
    """hvdrun reaches node1 over a link of its own that node2 has no route to (a management
    network), and node2 over the network both share: node1's workers dial the rendezvous
    over the side link but give Gloo and NCCL the shared network's interface, so node2's
    rank connects to them (Gloo's pairs choose by address which side dials: the side
    link's addresses sort below the shared network's, so that node2's rank dials)."""
    node1, node2 = cluster.hosts[:2]
    with cluster.side_link(node1) as (side_gateway, side_address):
        result = cluster.hvdrun(
            *("-H", f"{node2.alias}:1,{side_address}:1", "-i", str(cluster.client_key)),
            *(PY, str(SCRIPTS / "placement.py")),
        )
    assert result.returncode == 0, result.stderr
    found = placements(result.stdout)
    assert found[1]["hostname"] == node1.uts_hostname
    assert found[1]["address"] == side_address  # (what it dials the rendezvous from)
    assert found[1]["rendezvous"].startswith(f"{side_gateway}:")
    assert found[0]["gloo_ifname"] == found[1]["gloo_ifname"] == "eth0"
    assert found[0]["sum"] == found[1]["sum"] == 3


def test_hvdrun_run_calls_a_function_on_two_hosts(cluster: Cluster, tmp_path: Path) -> None:
    """hvdrun.run from a script: the function (by value, with an argument over the store's
    value limit) reaches the hosts over the job's connections; results come back by rank."""
    node1, node2 = cluster.hosts[:2]
    script = tmp_path / "driver.py"
    script.write_text(
        f"""
import json, socket
import hvdrun

def where(blob):
    import collectives.torch as hvd, torch
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(len(blob) + hvd.rank())]), op=hvd.Sum)
    return {{"host": socket.gethostname(), "rank": hvd.rank(), "sum": total.item()}}

results = hvdrun.run(
    where, args=(b"x" * 6_000_000,), num_proc=2, hosts="{node1.alias}:1,{node2.alias}:1"
)
print("RESULTS", json.dumps(results))
"""
    )
    result = subprocess.run(
        cluster.python_argv(str(script)),
        capture_output=True,
        text=True,
        timeout=120,
        env=cluster.env(),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    assert json.loads(line.removeprefix("RESULTS ")) == [
        {"host": node1.uts_hostname, "rank": 0, "sum": 12_000_001.0},
        {"host": node2.uts_hostname, "rank": 1, "sum": 12_000_001.0},
    ]


def test_a_plain_ddp_script_over_ssh_meets_on_rank_0s_host(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    example = Path(__file__).parents[2] / "examples" / "pytorch_ddp.py"
    result = cluster.hvdrun(
        "-H", f"{node1.alias}:1,{node2.alias}:1", PY, str(example), "--epochs", "1"
    )
    assert result.returncode == 0, result.stderr
    assert "[0]<stdout>:ddp: 2 ranks" in result.stdout
    assert "[1]<stdout>:ddp rank 1: weights equal rank 0's: True" in result.stdout
    result = cluster.hvdrun(
        "-H",
        f"{node1.alias}:1,{node2.alias}:1",
        PY,
        str(SCRIPTS / "show_env.py"),
        "MASTER_ADDR",
    )
    # rank 0's host address on the bridge: routes from every host, unlike a loopback one
    assert f"[1]<stdout>:MASTER_ADDR={node1.address}" in result.stdout, result.stdout


def test_unusable_hosts_are_all_named_within_the_start_timeout(cluster: Cluster) -> None:
    node1, _, node3 = cluster.hosts
    start = time.monotonic()
    result = cluster.hvdrun(
        "--start-timeout",
        "3",
        "-H",
        f"{node1.alias}:1,{node3.alias}:1,{cluster.unused_address}:1,nosuch-host.invalid:1",
        PY,
        str(SCRIPTS / "fail_rank.py"),
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 255, result.stderr
    assert elapsed < 3 + 5, elapsed  # bounded by --start-timeout, plus interpreter start
    lines = result.stderr.splitlines()
    assert lines[0] == "hvdrun: error: could not start the job on 3 of 4 host(s):"
    assert re.search(
        rf"^  {node3.alias}\s+connection refused by {node3.address} port 22 "
        r"\(is sshd running there\?\)$",
        result.stderr,
        re.M,
    )
    unused = next(line for line in lines if line.startswith(f"  {cluster.unused_address}"))
    assert "timed out after" in unused or "no route to" in unused, unused
    assert re.search(
        r"^  nosuch-host.invalid\s+cannot resolve host name 'nosuch-host.invalid' \(DNS\)",
        result.stderr,
        re.M,
    )
    assert node1.alias not in result.stderr  # the good host is not blamed
    assert "pids" not in result.stdout  # no worker started anywhere
    assert_hosts_clean(cluster, [node1], within=5)


def test_kill_9_of_hvdrun_leaves_nothing_on_any_host(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    proc = start_job(
        cluster, "-H", f"{node1.alias}:2,{node2.alias}:2", PY, str(SCRIPTS / "fail_rank.py")
    )
    try:
        pids = wait_for_pids(proc, 4)
    finally:
        proc.kill()
        proc.wait()
    assert_gone(pids, within=10)
    assert_hosts_clean(cluster, [node1, node2], within=10)


def test_a_killed_remote_agent_leaves_no_worker_behind(cluster: Cluster) -> None:
    """The agent on host 2 dies (SIGKILL, the OOM killer): its workers, which no agent
    will stop now, are killed through the SSH connection, children included."""
    node1, node2 = cluster.hosts[:2]
    proc = start_job(
        cluster, "-H", f"{node1.alias}:1,{node2.alias}:1", PY, str(SCRIPTS / "fail_rank.py")
    )
    try:
        pids = wait_for_pids(proc, 2)
        (agent,) = [
            p for p in cluster.processes_on(node2) if "launcher.agent" in " ".join(p.cmdline())
        ]
        agent.kill()
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 255, stderr
    assert_gone(pids, within=10)
    assert_hosts_clean(cluster, [node1, node2], within=10)


def test_worker_failing_on_host_2_stops_every_host(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    proc = start_job(
        cluster,
        "-x",
        "FAIL_RANK=3",
        "-x",
        "FAIL_CODE=5",
        "-H",
        f"{node1.alias}:2,{node2.alias}:2",
        PY,
        str(SCRIPTS / "fail_rank.py"),
    )
    pids = wait_for_pids(proc, 4)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 5, stderr
    assert "hvdrun: rank 3 on host hvd-node2 failed first: exit code 5" in stderr
    assert re.search(r"hvdrun:   RANK\s+HOST\s+EXIT\s+STATUS\s+LAST STDERR LINE", stderr)
    assert re.search(r"hvdrun:   3\s+hvd-node2\s+5\s+FAILED FIRST\s+rank 3 gives up", stderr)
    for rank in (0, 1, 2):
        host = "hvd-node1" if rank < 2 else "hvd-node2"
        assert re.search(rf"hvdrun:   {rank}\s+{host}\s+143\s+stopped", stderr), stderr
    assert "    rank 3 gives up" in stderr
    assert_gone(pids, within=10)
    assert_hosts_clean(cluster, [node1, node2], within=10)


def test_one_host_under_two_names_is_noted(cluster: Cluster, tmp_path: Path) -> None:
    # Its alias and its address: two hosts to -H, one machine (each host's first worker takes
    # local rank 0, the same GPU).
    node1 = cluster.hosts[0]
    result = cluster.hvdrun(
        "-H", f"{node1.alias}:1,{node1.address}:1", PY, "-c", "pass", cwd=tmp_path, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert (
        f"hvdrun: note: hosts {node1.alias}, {node1.address} are one machine "
        f"({node1.uts_hostname}, as their agents say)"
    ) in result.stderr, result.stderr


def test_environment_forwarding_rules(cluster: Cluster, tmp_path: Path) -> None:
    node1 = cluster.hosts[0]
    names = [
        "MY_SETTING",
        "SET_BY_X",
        "CUDA_VISIBLE_DEVICES",
        "DISPLAY",
        "HOSTNAME",
        "HOME",
        "USER",
        "PYTHONUNBUFFERED",
        "HVDRUN_HOSTNAME",
        "PWD",
        "OLDPWD",
    ]
    env = cluster.env(
        MY_SETTING="from the caller",
        CUDA_VISIBLE_DEVICES="0,1",
        DISPLAY=":99",
        HOSTNAME="the-callers-machine",
    )
    result = subprocess.run(
        cluster.hvdrun_argv(
            "-x",
            "SET_BY_X=a b=c",
            "-x",
            "CUDA_VISIBLE_DEVICES",
            "-H",
            f"{node1.alias}:1",
            PY,
            str(SCRIPTS / "show_env.py"),
            *names,
        ),
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    seen = dict(
        line.removeprefix("[0]<stdout>:").split("=", 1) for line in result.stdout.splitlines()
    )
    assert seen["MY_SETTING"] == "from the caller"  # the caller's environment travels
    assert seen["SET_BY_X"] == "a b=c"  # -x VAR=VALUE
    assert seen["CUDA_VISIBLE_DEVICES"] == "0,1"  # host-specific, but forced with -x VAR
    assert seen["DISPLAY"] == "<unset>"  # host-specific: not copied
    assert seen["HOSTNAME"] != "the-callers-machine"
    assert seen["HOME"] == "/root"  # from the remote login, not the caller's test HOME
    assert seen["USER"] == "root"
    assert seen["PYTHONUNBUFFERED"] == "1"
    assert seen["HVDRUN_HOSTNAME"] == node1.alias
    assert seen["cwd"] == str(tmp_path)  # the caller's working directory
    assert seen["PWD"] == str(tmp_path) and seen["OLDPWD"] == "<unset>"  # (not the agent's /)


def test_a_working_directory_whose_name_is_not_utf8_reaches_remote_workers(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Linux names are bytes: a directory made by a Latin-1 tool is as good a place to run
    # from as any, and its name goes on the agent's command line byte for byte.
    odd = tmp_path / os.fsdecode(b"caf\xe9 run")
    odd.mkdir()
    show = "import os; print(os.getcwdb().hex())"
    result = cluster.hvdrun(
        "-H", f"{cluster.hosts[0].alias}:1", PY, "-c", show, cwd=odd, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split(":")[-1].strip() == bytes(odd).hex()


def test_secret_is_in_no_process_argv_on_any_host(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    env = cluster.env(STAY="30")
    proc = start_job(
        cluster,
        "-H",
        f"{node1.alias}:1,{node2.alias}:1",
        PY,
        str(SCRIPTS / "show_env.py"),
        env=env,
    )
    try:
        secrets: list[str] = []
        assert proc.stdout is not None
        while len(secrets) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            if "<stdout>:secret=" in line:
                secrets.append(line.split("secret=", 1)[1].strip())
        (secret,) = set(secrets)  # one job, one secret, and both workers have it
        assert len(secret) >= 32
        on_hosts = {host.alias: len(cluster.processes_on(host)) for host in (node1, node2)}
        assert all(count >= 3 for count in on_hosts.values()), on_hosts  # sshd, agent, worker
        for process in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(process.info["cmdline"] or [])
            assert secret not in cmdline, f"secret in the argv of {process.info['pid']}: {cmdline}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    for host in (node1, node2):
        assert secret not in host.sshd_log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM


def test_changed_host_key_is_refused_under_accept_new(cluster: Cluster) -> None:
    node2 = cluster.hosts[1]
    first = cluster.hvdrun("-H", f"{node2.address}:1", "true")  # records the key if new
    assert first.returncode == 0, first.stderr
    known_before = cluster.known_hosts.read_text()
    assert f"{node2.address} ssh-ed25519 " in known_before
    cluster.replace_host_key(node2, cluster.new_key("reinstalled_host_key"))
    try:
        result = cluster.hvdrun("-H", f"{node2.address}:1", "true")
        assert result.returncode == 255
        assert f"  {node2.address}  HOST KEY CHANGED: {node2.address} now presents" in (
            result.stderr
        )
        assert f"remove the old key with: ssh-keygen -R '{node2.address}'" in result.stderr
        assert cluster.known_hosts.read_text() == known_before  # nothing overwritten
        # 'off' checks nothing (throw-away clusters only)
        off = cluster.hvdrun("--ssh-host-key-policy", "off", "-H", f"{node2.address}:1", "true")
        assert off.returncode == 0, off.stderr
    finally:
        cluster.replace_host_key(node2, node2.host_key)


def test_unknown_host_is_refused_under_strict(cluster: Cluster, tmp_path: Path) -> None:
    node1 = cluster.hosts[0]
    home = tmp_path / "home"
    shutil.copytree(cluster.home, home)
    (home / ".ssh" / "known_hosts").write_text("")
    env = cluster.env(HOME=str(home))
    strict = cluster.hvdrun(
        "--ssh-host-key-policy", "strict", "-H", f"{node1.address}:1", "true", env=env
    )
    assert strict.returncode == 255
    assert f"host key of {node1.address} is not in known_hosts" in strict.stderr
    assert "policy is strict" in strict.stderr
    assert (home / ".ssh" / "known_hosts").read_text() == ""


def test_known_hosts_files_are_read_as_openssh_reads_them(cluster: Cluster, tmp_path: Path) -> None:
    """GlobalKnownHostsFile is read; marker lines and lines paramiko cannot parse are
    skipped, not fatal to every host; a key marked @revoked is refused; a known_hosts file
    that cannot be written does not stop accept-new (the key is trusted for the job)."""
    node1 = cluster.hosts[0]
    key = " ".join(Path(f"{node1.host_key}.pub").read_text().split()[:2])
    known = tmp_path / "global_known_hosts"
    known.write_text(
        "@cert-authority *.example.com ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI\n"
        "not a known_hosts line at all !!\n"
        f"{node1.address} {key}\n"
    )
    config = tmp_path / "ssh_config"

    def run(user_known: str, global_known: str, strict: str) -> subprocess.CompletedProcess[str]:
        config.write_text(
            f"Host n1\n    HostName {node1.address}\n    User root\n"
            f"    IdentityFile {cluster.client_key}\n    UserKnownHostsFile {user_known}\n"
            f"    GlobalKnownHostsFile {global_known}\n    StrictHostKeyChecking {strict}\n"
        )
        return cluster.hvdrun("--ssh-config-file", str(config), "-H", "n1:1", "true")

    empty = tmp_path / "user_known_hosts"
    empty.write_text("")
    strict = run(str(empty), str(known), "yes")
    assert strict.returncode == 0, strict.stderr
    with known.open("a") as handle:
        handle.write(f"@revoked * {key}\n")
    revoked = run(str(empty), str(known), "yes")
    assert revoked.returncode == 255
    assert f"the host key of {node1.address} (SHA256:" in revoked.stderr
    assert "is marked @revoked in known_hosts" in revoked.stderr
    unwritable = run("/dev/null/known_hosts", "none", "accept-new")
    assert unwritable.returncode == 0, unwritable.stderr
    assert f"could not add the host key of {node1.address} to /dev/null/known_hosts" in (
        unwritable.stderr
    )


def test_ssh_config_port_and_proxy_command(cluster: Cluster, tmp_path: Path) -> None:
    if shutil.which("ssh") is None:
        pytest.skip("the ssh client (openssh-client) is needed as ProxyCommand")
    node1, node2 = cluster.hosts[:2]
    config = cluster.proxied_config(
        tmp_path / "ssh_config", "behind-node1", node2, node1, "    Port 2222\n"
    )
    result = cluster.hvdrun(
        "--ssh-config-file",
        str(config),
        "-H",
        "behind-node1:1",
        PY,
        str(SCRIPTS / "show_env.py"),
        "HVDRUN_RENDEZVOUS_ADDR",
        "GLOO_SOCKET_IFNAME",
    )
    assert result.returncode == 0, result.stderr
    assert f"[0]<stdout>:HVDRUN_RENDEZVOUS_ADDR={cluster.gateway}:" in result.stdout
    assert "[0]<stdout>:GLOO_SOCKET_IFNAME=eth0" in result.stdout
    assert f"[{node2.address}]:2222 ssh-ed25519 " in cluster.known_hosts.read_text()
    # -p and -i on the command line, no config entry for the address
    direct = cluster.hvdrun(
        "-p", "2222", "-i", str(cluster.client_key), "-H", f"root@{node1.address}:1", "true"
    )
    assert direct.returncode == 0, direct.stderr
    assert f"[{node1.address}]:2222 ssh-ed25519 " in cluster.known_hosts.read_text()


def test_check_hosts_table(cluster: Cluster) -> None:
    from importlib import metadata

    node1, node2, node3 = cluster.hosts
    result = cluster.hvdrun("--check-hosts", "-H", f"{node1.alias}:2,{node2.alias}:2,{node3.alias}")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "HOST",
        "STATUS",
        "PYTHON",
        "TORCH",
        "HVDRUN",
        "GPUS",
        "NCCL",
        "INTERFACE",
    ]
    python = ".".join(map(str, sys.version_info[:3]))
    torch_version = metadata.version("torch")
    # The hosts are this machine's namespaces: its GPUs, and its torch's NCCL (a CUDA build
    # of torch has NCCL even where no GPU is).
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "-"
    for host, line in zip((node1, node2), lines[1:3], strict=True):
        assert line.split() == [
            host.alias,
            "ok",
            python,
            torch_version,
            metadata.version("hvdrun"),
            str(gpus),
            nccl,
            "eth0",
            host.address,
        ]
    assert lines[3].split()[:2] == [node3.alias, "UNUSABLE"]
    assert f"  {node3.alias}: connection refused by {node3.address} port 22" in result.stdout
    assert lines[-1] == "2 of 3 host(s) usable"
    assert "disagree" not in result.stdout


@contextlib.contextmanager
def cut_off(cluster: Cluster, proc: subprocess.Popen, host: ClusterHost) -> Iterator[list[int]]:
    """Once the job's two workers run, cuts ``host``'s cable and yields their pids; then
    stops hvdrun if it still runs, mends the cable and checks the host was left clean."""
    try:
        pids = wait_for_pids(proc, 2)
        cluster.set_link(host, up=False)
        yield pids
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster.set_link(host, up=True)
    assert_hosts_clean(cluster, [host], within=10)


def test_cut_network_stops_the_cut_off_host_and_the_job(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    proc = start_job(
        cluster,
        "--agent-timeout",
        "2",
        "--term-grace",
        "1",
        "-H",
        f"{node1.alias}:1,{node2.alias}:1",
        PY,
        str(SCRIPTS / "fail_rank.py"),
    )
    with cut_off(cluster, proc, node2) as pids:
        start = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 255, stderr
        assert time.monotonic() - start < 10
        assert "host hvd-node2: heard nothing from its agent for 2 s" in stderr
        # node2's agent noticed on its own, while still cut off
        assert_gone(pids, within=10)
        assert_hosts_clean(cluster, [node1], within=5)


def test_ctrl_c_while_a_host_is_cut_off_ends_soon(cluster: Cluster) -> None:
    """Ctrl-C right after node2's cable was cut: its agent cannot answer the stop, and
    hvdrun gives up on it after 5 s instead of waiting out the workers' grace and the slack
    (17.7 s before); node2's agent stops its worker on its own."""
    node1, node2 = cluster.hosts[:2]
    proc = start_job(
        cluster, "--heartbeat-timeout", "4", "-H", f"{node1.alias}:1,{node2.alias}:1",
        PY, str(SCRIPTS / "fail_rank.py"),
    )  # fmt: skip
    with cut_off(cluster, proc, node2) as pids:
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - start
        assert proc.returncode == 130, stderr
        assert took < 10, (took, stderr)
        assert (
            "host hvd-node2: its agent did not answer the stop within 5 s (is the host cut off?)"
        ) in stderr, stderr
        assert_gone(pids, within=10)  # node2's agent, on its own
        assert_hosts_clean(cluster, [node1], within=5)


def test_a_heartbeat_timeout_shorter_than_the_agent_timeout_counts(cluster: Cluster) -> None:
    """--heartbeat-timeout 2 with the default --agent-timeout 30: hvdrun pings often enough
    for a healthy job to run on (8 s), and an agent cut off from hvdrun stops its workers
    after 2 s of silence, not 30."""
    node1, node2 = cluster.hosts[:2]
    hosts = f"{node1.alias}:1,{node2.alias}:1"
    healthy = cluster.hvdrun("--heartbeat-timeout", "2", "-H", hosts, "sleep", "8")
    assert healthy.returncode == 0, healthy.stderr
    proc = start_job(
        cluster, "--heartbeat-timeout", "2", "-H", hosts, PY, str(SCRIPTS / "fail_rank.py")
    )
    try:
        pids = wait_for_pids(proc, 2)
        node2_pids = [p for p in pids if p in {q.pid for q in cluster.processes_on(node2)}]
        cluster.set_link(node2, up=False)
        assert_gone(node2_pids, within=8)  # node2's agent, on its own
    finally:
        proc.kill()
        proc.wait()
        cluster.set_link(node2, up=True)
    assert_hosts_clean(cluster, [node1, node2], within=10)


def test_hosts_whose_gloo_addresses_drop_packets_are_named_soon(cluster: Cluster) -> None:
    """node2's packets to node1 vanish (a firewall that drops silently) while both reach
    hvdrun: hvd.init() fails within about REACH_TIMEOUT_SECONDS, naming the host and the
    address it could not reach and how to choose another interface (Gloo alone retries its
    connects for about 7 minutes), and nothing is left running; --check-hosts names it
    before any job."""
    node1, node2 = cluster.hosts[:2]
    cluster.blackhole(node2, node1, on=True)
    try:
        start = time.monotonic()
        result = cluster.hvdrun(
            "-H", f"{node1.alias}:2,{node2.alias}:1", PY, str(SCRIPTS / "placement.py"),
            timeout=150,
        )  # fmt: skip
        elapsed = time.monotonic() - start
        # --check-hosts finds it before any job: each host tries the other's Gloo address
        checked = cluster.hvdrun("--check-hosts", "-H", f"{node1.alias},{node2.alias}")
    finally:
        cluster.blackhole(node2, node1, on=False)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    for host, other in ((node1, node2), (node2, node1)):
        assert (
            f"  {host.alias}: cannot reach host {other.alias} at the address its workers give "
            f"Gloo (eth0): timed out after 10 s connecting to {other.address}:"
        ) in checked.stdout, checked.stdout
    assert checked.stdout.splitlines()[-1] == "0 of 2 host(s) usable", checked.stdout
    assert result.returncode != 0, result.stdout
    output = result.stdout + result.stderr
    assert elapsed < 60, output
    assert "placement " not in result.stdout
    # each host's first rank names the other host's address it cannot reach (the second may
    # be stopped by hvdrun before it says so: both time out at about the same moment)
    said = [
        f"rank {rank} cannot reach host {other.alias} at {other.address} (eth0, "
        for rank, other in ((0, node2), (2, node1))
    ]
    assert any(text in output for text in said), output
    assert "--network-interface" in output, output
    assert_hosts_clean(cluster, [node1, node2], within=10)


def with_python(argv: list[str], python: Path) -> list[str]:
    """``argv`` (:meth:`Cluster.hvdrun_argv`) run by ``python`` instead of this one."""
    argv = list(argv)
    argv[argv.index(sys.executable)] = str(python)
    return argv


def test_a_host_without_the_python_or_hvdrun_is_named(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    venv = cluster.local_only / "venv"
    python = make_venv(venv, with_hvdrun=True)  # here: hvdrun works; on the hosts: no such path
    # node2 has a Python at that path, but without hvdrun
    base = getattr(sys, "_base_executable", sys.executable)
    cluster.on_host_filesystem(node2, base, "-m", "venv", "--without-pip", str(venv))
    result = subprocess.run(
        with_python(cluster.hvdrun_argv("-H", f"{node1.alias}:1,{node2.alias}:1", "true"), python),
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 255, result.stderr
    assert (
        f"  {node1.alias}  no Python at {python} there: hvdrun must be installed at the "
        "same path on every host" in result.stderr
    )
    assert f"  {node2.alias}  hvdrun is not installed for {python} there (" in result.stderr
    assert "No module named" in result.stderr


def test_a_python_that_needs_ld_library_path_starts_where_its_library_is(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A Python that, like one from an Lmod or Spack module, starts only with LD_LIBRARY_PATH
    set: hvdrun, run under it, starts its agents with it. node1 has the library there and
    runs the job; node2 lacks it, and the job and --check-hosts say what the loader said."""
    node1, node2 = cluster.hosts[:2]
    shipped = tmp_path / "lib"
    python = venv_needing_library_path(tmp_path / "venv", shipped)
    libdir = cluster.local_only / "lib"  # here and on node1 only
    shutil.copytree(shipped, libdir)
    cluster.on_host_filesystem(node1, "cp", "-r", str(shipped), str(libdir))
    env = cluster.env(LD_LIBRARY_PATH=str(libdir))
    try:

        def hvdrun(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                with_python(cluster.hvdrun_argv(*args), python),
                capture_output=True, text=True, env=env, timeout=90, stdin=subprocess.DEVNULL,
            )  # fmt: skip

        alone = hvdrun("-H", f"{node1.alias}:1", "true")
        assert alone.returncode == 0, alone.stderr
        both = hvdrun("-H", f"{node1.alias}:1,{node2.alias}:1", "true")
        checked = hvdrun("--check-hosts", "-H", f"{node1.alias},{node2.alias}")
    finally:
        shutil.rmtree(libdir)
        cluster.on_host_filesystem(node1, "rm", "-rf", str(libdir))
    why = (
        f"the Python at {python} cannot start there: error while loading shared libraries: "
        "libhvdtpy"
    )
    hint = f"(it started with hvdrun's LD_LIBRARY_PATH={libdir}: is the library in one of"
    assert both.returncode == 255, both.stderr
    assert f"  {node2.alias}  {why}" in both.stderr, both.stderr
    assert hint in both.stderr
    assert node1.alias not in both.stderr
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[1].split()[:2] == [node1.alias, "ok"], checked.stdout
    assert f"  {node2.alias}: {why}" in checked.stdout, checked.stdout
    assert hint in checked.stdout


def test_what_a_login_shell_prints_on_stdout_does_no_harm(cluster: Cluster, tmp_path: Path) -> None:
    """A ~/.bashrc that sets the terminal's title (an escape sequence, no newline) and says
    hello: jobs start at once and without a warning; --verbose shows the text once."""
    login = pwd.getpwnam("root")
    bashrc = Path(login.pw_dir) / ".bashrc"
    if not login.pw_shell.endswith("/bash") or not bashrc.is_file():
        pytest.skip(f"root's login shell is not bash with a {bashrc} to stand in for")
    node1 = cluster.hosts[0]
    chatty = tmp_path / "bashrc"
    chatty.write_text("echo Welcome\nprintf '\\033]0;%s\\007' node1\n")
    chatty.chmod(0o644)
    cluster.on_host_filesystem(node1, "mount", "--bind", str(chatty), str(bashrc))  # node1's own
    try:
        start = time.monotonic()
        quiet = cluster.hvdrun("-H", f"{node1.alias}:1", "true")
        took = time.monotonic() - start
        verbose = cluster.hvdrun("--verbose", "-H", f"{node1.alias}:1", "true")
    finally:
        cluster.on_host_filesystem(node1, "umount", str(bashrc))
    assert quiet.returncode == 0, quiet.stderr
    assert "warning" not in quiet.stderr and "login shell" not in quiet.stderr, quiet.stderr
    assert took < 20, took  # (not after the start timeout, 30 s)
    assert verbose.returncode == 0, verbose.stderr
    assert "warning" not in verbose.stderr, verbose.stderr
    said = (
        f"the login shell on {node1.alias} printed to stdout before hvdrun's agent started "
        "(~/.bashrc?); ignored: b'Welcome\\n\\x1b]0;node1\\x07'"
    )
    assert verbose.stderr.count(said) == 1, verbose.stderr


def run_on_terminal(argv: list[str], env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """Runs argv with stdout and stderr on a pseudo-terminal; returns (exit code, output)."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer has closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    return proc.wait(timeout=10), b"".join(chunks).decode(errors="replace")


def test_status_line_and_colours_on_a_terminal(cluster: Cluster) -> None:
    node1, node2 = cluster.hosts[:2]
    env = cluster.env(REGISTER_DELAY="0.4", TERM="xterm")
    env.pop("NO_COLOR", None)
    code, output = run_on_terminal(
        cluster.hvdrun_argv(
            "-H", f"{node1.alias}:2,{node2.alias}:2", PY, str(SCRIPTS / "register.py")
        ),
        env,
    )
    assert code == 0, output
    statuses = re.findall(r"hvdrun: connected (\d)/2 hosts, (\d)/4 workers registered", output)
    assert ("2", "0") in statuses or ("2", "1") in statuses, output
    assert all(int(done) < 4 for _, done in statuses)  # it goes away once all registered
    assert "\r\x1b[K" in output  # the status line is redrawn in place, never scrolled
    for rank in range(4):
        host = node1 if rank < 2 else node2
        colour = RANK_COLOURS[rank]
        assert (
            f"\x1b[{colour}m[{rank}]<stdout>:\x1b[0mregistered rank {rank} on {host.uts_hostname}"
            in output
        )
    # NO_COLOR: same job, no colour codes
    code, plain = run_on_terminal(
        cluster.hvdrun_argv("-H", f"{node1.alias}:1", PY, str(SCRIPTS / "register.py")),
        {**env, "NO_COLOR": "1"},
    )
    assert code == 0, plain
    assert f"[0]<stdout>:registered rank 0 on {node1.uts_hostname}" in plain
    assert "\x1b[3" not in plain


def test_keys_from_ssh_agent(cluster: Cluster, tmp_path: Path) -> None:
    if shutil.which("ssh-agent") is None or shutil.which("ssh-add") is None:
        pytest.skip("ssh-agent/ssh-add (openssh-client) are needed")
    node1 = cluster.hosts[0]
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(cluster.known_hosts, home / ".ssh" / "known_hosts")
    (home / ".ssh" / "config").write_text("Host *\n    User root\n")  # no IdentityFile
    socket_path = tmp_path / "agent.sock"
    agent = subprocess.Popen(
        ["ssh-agent", "-D", "-a", str(socket_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 5
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        env = cluster.env(HOME=str(home), SSH_AUTH_SOCK=str(socket_path))
        without = cluster.hvdrun("-H", f"{node1.address}:1", "true", env=env)
        assert without.returncode == 255
        assert (
            f"  {node1.address}  authentication failed for user root: no key to offer (give one "
            "with -i or IdentityFile in ~/.ssh/config, or load one into ssh-agent)"
        ) in without.stderr
        stranger = cluster.new_key("stranger_key")
        wrong = cluster.hvdrun("-i", str(stranger), "-H", f"{node1.address}:1", "true", env=env)
        assert wrong.returncode == 255
        assert (
            f"authentication failed for user root; the server accepted none of: key {stranger} "
            "(hvdrun logs in with keys only, never with passwords)"
        ) in wrong.stderr
        added = subprocess.run(
            ["ssh-add", str(cluster.client_key)], env=env, capture_output=True, timeout=10
        )
        assert added.returncode == 0, added.stderr
        with_key = cluster.hvdrun("-H", f"{node1.address}:1", "true", env=env)
        assert with_key.returncode == 0, with_key.stderr
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.parametrize("kind", ["rsa", "ecdsa", "rsa-encrypted"])
def test_a_refused_key_of_any_kind_says_the_login_failed(
    cluster: Cluster, tmp_path: Path, kind: str
) -> None:
    """paramiko raises its last parse error for a refused RSA or ECDSA key file ("encountered
    RSA key, expected OPENSSH key"); hvdrun says what happened: the login failed."""
    node1 = cluster.hosts[0]
    key = tmp_path / f"{kind}_key"
    passphrase = "secret words" if kind == "rsa-encrypted" else ""
    made = subprocess.run(
        [
            "ssh-keygen",
            "-q",
            "-t",
            kind.split("-")[0],
            "-m",
            "PEM",
            "-N",
            passphrase,
            "-f",
            str(key),
        ],
        capture_output=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    home = tmp_path / "home"  # (no key of its own, no ssh-agent: only -i is offered)
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(cluster.known_hosts, home / ".ssh" / "known_hosts")
    (home / ".ssh" / "config").write_text("Host *\n    User root\n")
    env = {k: v for k, v in cluster.env(HOME=str(home)).items() if k != "SSH_AUTH_SOCK"}
    result = cluster.hvdrun("-i", str(key), "-H", f"{node1.address}:1", "true", env=env)
    assert result.returncode == 255
    assert (
        f"authentication failed for user root; the server accepted none of: key {key}"
    ) in result.stderr, result.stderr
    assert "expected OPENSSH key" not in result.stderr
    hint = "a key needs its passphrase: load it into ssh-agent"
    assert (hint in result.stderr) == (kind == "rsa-encrypted"), result.stderr
