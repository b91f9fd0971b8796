"""A real Slurm cluster on the test hosts: ``slurmctld`` here, one ``slurmd`` per host.

Built on :mod:`tests.cluster`'s network-namespace hosts from Debian's packages (``slurmctld
slurmd slurm-client munge``), with nothing installed system-wide touched:

* one ``munged`` with a fresh 1024-byte key and its own socket (``AuthInfo=socket=...``);
  the socket is a path, so the hosts' namespaces reach it through the shared filesystem;
* ``slurmctld`` in this machine's network namespace (the "login host", at the bridge's
  address) under a UTS hostname of its own, which must equal ``SlurmctldHost``; it listens on
  a port free here, so two test runs never collide;
* one ``slurmd`` per host, in the host's network namespace under its own UTS hostname
  (``hvdh1``, ``hvdh2``, ... = the Slurm node names). ``NodeAddr=`` spares every daemon a DNS
  lookup: the node names resolve nowhere, as the hosts' own names do.
  ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` need no cgroups, so
  slurmd starts inside a namespace.

The daemons die with the test process (``PR_SET_PDEATHSIG``), so a killed pytest leaves
none behind; :func:`tests.cluster.remove_stale` removes the rest. Client commands
(``srun``, ``salloc``, ``sbatch``, ``scancel``...) run through :meth:`SlurmCluster.argv`,
with ``SLURM_CONF`` set and DNS pointed at loopback like hvdrun in the SSH tests.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cluster import Cluster, ClusterHost, cluster_for_tests, dying_with_parent, free_port

_FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "salloc", "sbatch", "scancel", "scontrol", "munged")


def slurm_unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be built here, or None."""
    for tool in SLURM_TOOLS:
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"'{tool}' is missing (apt-get install slurmctld slurmd slurm-client munge)"
    return None


@dataclass
class SlurmCluster:
    hosts: Cluster
    nodes: list[ClusterHost]
    root: Path
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def node_name(self, host: ClusterHost) -> str:
        """The host's Slurm node name, which is also its hostname under slurmd."""
        return f"hvdh{host.index}"

    @property
    def node_names(self) -> list[str]:
        return [self.node_name(host) for host in self.nodes]

    def env(self, **extra: str) -> dict[str, str]:
        """The test environment (see Cluster.env) with this cluster's SLURM_CONF, and none
        of the caller's own Slurm or job variables."""
        env = {
            k: v
            for k, v in self.hosts.env().items()
            if not k.startswith(("SLURM_", "HVDRUN_", "OMPI_", "PMI"))
        }
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def argv(self, *args: str) -> list[str]:
        """A command run on the login host (this machine) with DNS pointed at loopback."""
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        return ["unshare", "--mount", "--", "sh", "-c", script, str(self.hosts.resolv_conf), *args]

    def run(
        self,
        *args: str,
        timeout: float = 120,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or self.env(),
            stdin=subprocess.DEVNULL,
            cwd=cwd,
        )

    def sbatch(
        self,
        script: str,
        *args: str,
        options: Sequence[str] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 300,
    ) -> tuple[int, str]:
        """Submits a batch job and waits for it; returns its exit code and its output.

        Polls the job itself: ``sbatch --wait`` sleeps ever longer between its checks and
        would add up to half a minute to a ten-second job."""
        log = self.root / f"sbatch-{time.monotonic_ns()}.out"
        submitted = self.run(
            "sbatch", "--parsable", "-o", str(log), *options, script, *args, env=env, cwd=cwd
        )
        if submitted.returncode != 0:
            raise AssertionError(f"sbatch failed: {submitted.stderr}")
        job = submitted.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            shown = self.run("scontrol", "show", "job", "-o", job, timeout=30).stdout
            state = re.search(r"\bJobState=(\S+)", shown)
            if state is not None and state.group(1) in _FINISHED:
                code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
                assert code is not None, shown
                status, signal_number = int(code.group(1)), int(code.group(2))
                exit_code = 128 + signal_number if signal_number else status
                return exit_code, log.read_text() if log.exists() else ""
            if time.monotonic() > deadline:
                self.run("scancel", job, timeout=30)
                raise AssertionError(f"batch job {job} did not finish in {timeout:g} s: {shown}")
            time.sleep(0.25)

    def python_argv(self, *args: str) -> list[str]:
        """``python ARGS`` with this interpreter (the hosts share the filesystem)."""
        return [sys.executable, *args]

    def jobs(self) -> list[str]:
        """The ids of the jobs slurmctld still knows as pending or running."""
        result = self.run("squeue", "-h", "-o", "%i", timeout=30)
        return result.stdout.split()

    def cancel_all(self) -> None:
        for job in self.jobs():
            self.run("scancel", job, timeout=30)

    def wait_idle(self, within: float = 60.0) -> None:
        """Waits until no job is left running (a test's jobs must not delay the next)."""
        deadline = time.monotonic() + within
        while self.jobs():
            if time.monotonic() > deadline:
                raise AssertionError(f"Slurm jobs still running: {self.jobs()}")
            time.sleep(0.2)

    # ---- lifetime ---------------------------------------------------------------------

    def _start(self, argv: Sequence[str], log: str, netns: str | None = None) -> None:
        command = list(argv)
        if netns is not None:
            command = ["ip", "netns", "exec", netns, *command]
        with open(self.root / log, "wb") as out:
            proc = subprocess.Popen(
                dying_with_parent(command),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                start_new_session=True,
            )
        self.daemons.append(proc)

    def _wait_nodes_idle(self, within: float) -> None:
        deadline = time.monotonic() + within
        states = ""
        while time.monotonic() < deadline:
            for proc in self.daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited: {self._logs()}")
            result = self.run("sinfo", "-h", "-N", "-o", "%N %t", timeout=30)
            states = result.stdout
            lines = [line.split() for line in states.splitlines() if line.strip()]
            if len(lines) == len(self.nodes) and all(state == "idle" for _, state in lines):
                return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm nodes did not come up: {states!r} {self._logs()}")

    def _logs(self) -> str:
        texts = []
        for path in sorted(self.root.glob("*.log")):
            texts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(texts)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.cancel_all()
        for proc in self.daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        self.daemons.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def _slurm_conf(slurm: SlurmCluster, controller: str, port: int, cpus: int) -> str:
    root = slurm.root
    gateway = slurm.hosts.gateway
    lines = [
        "ClusterName=hvdtest",
        f"SlurmctldHost={controller}({gateway})",
        f"SlurmctldPort={port}",
        "SlurmdPort=6818",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.socket'}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'spool'}/%n.pid",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'spool'}/%n.log",
        f"PlugStackConfig={root / 'plugstack.conf'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SlurmdParameters=config_overrides",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        # A cancelled job's processes get SIGTERM, then SIGKILL this many seconds later.
        "KillWait=5",
        "UnkillableStepTimeout=30",
    ]
    for host in slurm.nodes:
        name = slurm.node_name(host)
        lines.append(f"NodeName={name} NodeAddr={host.address} CPUs={cpus} State=UNKNOWN")
    nodes = ",".join(slurm.node_names)
    lines.append(f"PartitionName=hvd Nodes={nodes} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def _with_hostname(hostname: str, *argv: str) -> list[str]:
    """``argv`` in a UTS namespace of its own, under ``hostname``."""
    return ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]


def start_slurm(hosts: Cluster, nodes: Sequence[ClusterHost], cpus: int = 4) -> SlurmCluster:
    """Starts munged, slurmctld and one slurmd per node; returns once every node is idle."""
    root = hosts.root / "slurm"
    root.mkdir(mode=0o755)
    slurm = SlurmCluster(hosts=hosts, nodes=list(nodes), root=root)
    try:
        for directory in ("state", "spool", "munge"):
            (root / directory).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (root / "plugstack.conf").write_text("")
        (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        port = free_port(hosts.gateway)
        controller = f"hvdctl{os.getpid()}"
        slurm.conf.write_text(_slurm_conf(slurm, controller, port, cpus))
        munge = root / "munge"
        slurm._start(
            [
                "munged",
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={root / 'munge.socket'}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            "munged.log",
        )
        # (generous: daemons start slowly on a loaded CI host; the waits end once they are up)
        deadline = time.monotonic() + 60
        while not (root / "munge.socket").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {slurm._logs()}")
            time.sleep(0.05)
        slurm._start(
            _with_hostname(controller, "slurmctld", "-D", "-i", "-f", str(slurm.conf)),
            "slurmctld.out.log",
        )
        for host in slurm.nodes:
            name = slurm.node_name(host)
            slurm._start(
                _with_hostname(name, "slurmd", "-D", "-N", name, "-f", str(slurm.conf)),
                f"slurmd-{name}.out.log",
                netns=host.netns,
            )
        slurm._wait_nodes_idle(within=90)
    except BaseException:
        slurm.close()
        raise
    return slurm


def slurm_for_tests(hosts: int = 2) -> Iterator[SlurmCluster]:
    """The body of a Slurm fixture: a namespace cluster of ``hosts`` hosts (all with sshd)
    and Slurm on them; where either cannot be built, the tests skip and say why."""
    reason = slurm_unavailable_reason()
    if reason is not None:
        pytest.skip(f"Slurm tests skipped: {reason}")
    for built in cluster_for_tests(hosts=hosts, sshd_hosts=hosts, tests="Slurm tests"):
        try:
            slurm = start_slurm(built, built.hosts)
        except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
            pytest.fail(f"cannot start the Slurm test cluster: {exc}")
        try:
            yield slurm
        finally:
            slurm.close()


# ---- Open MPI over the hosts' sshd ---------------------------------------------------------


def mpi_unavailable_reason() -> str | None:
    """Why Open MPI's mpirun cannot be used here, or None."""
    if shutil.which("mpirun") is None:
        return "'mpirun' is missing (apt-get install openmpi-bin)"
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    if "Open MPI" not in version and "OpenRTE" not in version:
        return f"mpirun is not Open MPI's: {version.splitlines()[:1]}"
    return None


def mpirun_argv(
    cluster: Cluster, hosts: Sequence[tuple[ClusterHost, int]], *args: str
) -> list[str]:
    """Open MPI's ``mpirun`` over the hosts' sshd with the test key, TCP on the test subnet.

    Hosts are given by address: mpirun resolves host names itself, and the test hosts'
    names resolve nowhere."""
    subnet = f"{cluster.subnet}.0/24"
    host_list = ",".join(f"{host.address}:{slots}" for host, slots in hosts)
    ssh = f"-F {cluster.home / '.ssh' / 'config'} -o StrictHostKeyChecking=no"
    return [
        "mpirun",
        "--allow-run-as-root",
        "-np",
        str(sum(slots for _, slots in hosts)),
        "-H",
        host_list,
        "--mca",
        "plm_rsh_args",
        ssh,
        "--mca",
        "btl_tcp_if_include",
        subnet,
        "--mca",
        "oob_tcp_if_include",
        subnet,
        *args,
    ]
