"""Elastic recovery: from losing a host to the first committed step after re-rendezvous.

One elastic job (``-np 3 --min-np 2``) on three hosts of the test cluster (tests/cluster.py:
network namespaces with their own sshd, so this needs root and openssh-server), Gloo, a
step every 0.1 s (tests/elastic/workers/elastic_steps.py: allreduce, SGD step, commit).
Each round takes the third host away at a random moment of a step, measures from then to
the first step the two survivors commit together in the new generation, and lets the host
come back (a 1-2 s blacklist cooldown) before the next round:

* killed host: every process of the host (agent, workers, sshd) gets SIGKILL;
* cut link: the host's cable is pulled (no RST); detection is bounded by the elastic
  failure timeout (5 s: the workers' Gloo timeout and the agents' heartbeat timeout).

For comparison, the torchrun way: after a failure every worker starts again from scratch.
That is measured as the time from starting a fresh 2-host job of the same script to its
first committed step (a lower bound: it leaves out noticing the failure and tearing the old
workers down). Without root or sshd it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.cluster import (  # noqa: E402
    Cluster,
    kill_host,
    start_cluster,
    unavailable_reason,
    write_hosts,
)

WORKER = HERE.parent / "tests" / "elastic" / "workers" / "elastic_steps.py"
COMMITTED = re.compile(r"committed step=(\d+) rank=(\d+) size=(\d+) generation=(\d+) time=(\S+)")


class Commits:
    """Reads a job's output; ``next(size)`` waits for the next commit made at that size."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.queue: queue.Queue[tuple[int, int, float]] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            match = COMMITTED.search(line)
            if match:
                step, _, size, _, stamp = match.groups()
                self.queue.put((int(step), int(size), float(stamp)))

    def drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.queue.get_nowait()

    def next(self, size: int, timeout: float = 120) -> tuple[int, float]:
        """(step, wall time) of the next commit at ``size`` workers."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                tail = "".join(self.lines[-20:])
                raise RuntimeError(f"no commit at size {size}; job output:\n{tail}")
            with contextlib.suppress(queue.Empty):
                step, got, stamp = self.queue.get(timeout=min(remaining, 0.5))
                if got == size:
                    return step, stamp


def measure_elastic(
    cluster: Cluster, hosts_file: Path, kills: int, cuts: int
) -> dict[str, list[float]]:
    node3 = cluster.hosts[2]
    argv = cluster.hvdrun_argv(
        "-np", "3", "--min-np", "2", "--blacklist-cooldown-range", "1", "2",
        "--host-discovery-script", f"cat {hosts_file}",
        "-x", "STEPS=100000", "-x", "STEP_INTERVAL=0.1",
        sys.executable, str(WORKER),
    )  # fmt: skip
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=cluster.env(),
    )
    commits = Commits(proc)
    results: dict[str, list[float]] = {"killed host": [], "cut link": []}
    try:
        plan = ["killed host"] * kills + ["cut link"] * cuts
        for what in plan:
            for _ in range(5):  # a few steps on three hosts first
                commits.next(3)
            commits.drain()
            # A host dies at any moment of a step, not just after a commit.
            time.sleep(random.uniform(0.0, 0.1))
            lost = time.time()
            if what == "killed host":
                kill_host(cluster, node3, sshd=True)
            else:
                cluster.set_link(node3, up=False)
            try:
                _, stamp = commits.next(2)
            finally:
                if what == "cut link":
                    cluster.set_link(node3, up=True)
                else:  # the host reboots: it may come back after its cooldown
                    cluster.stop_sshd(node3)
                    cluster.start_sshd(node3)
            results[what].append(stamp - lost)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return results


def measure_restart(cluster: Cluster, rounds: int) -> list[float]:
    node1, node2 = cluster.hosts[:2]
    costs = []
    for _ in range(rounds):
        argv = cluster.hvdrun_argv(
            "-H", f"{node1.alias}:1,{node2.alias}:1",
            "-x", "STEPS=1", "-x", "STEP_INTERVAL=0.1",
            sys.executable, str(WORKER),
        )  # fmt: skip
        start = time.time()
        result = subprocess.run(
            argv, capture_output=True, text=True, env=cluster.env(), timeout=120, check=False
        )
        stamps = [float(m.group(5)) for m in COMMITTED.finditer(result.stdout)]
        if result.returncode != 0 or not stamps:
            raise RuntimeError(f"restart job failed ({result.returncode}): {result.stderr[-2000:]}")
        costs.append(min(stamps) - start)
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--kills", type=int, default=7)
    parser.add_argument("--cuts", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=5)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"elastic_recovery: skipped: {reason}")
        return 0
    cluster = start_cluster(hosts=3, sshd_hosts=3)
    try:
        hosts_file = cluster.root / "elastic-hosts"
        write_hosts(hosts_file, *cluster.hosts)
        measure_restart(cluster, 1)  # warm caches and record host keys, unmeasured
        elastic = measure_elastic(cluster, hosts_file, args.kills, args.cuts)
        restart = measure_restart(cluster, args.restarts)
    finally:
        cluster.close()
    print("elastic_recovery: 3 -> 2 hosts, Gloo, a step every 0.1 s; seconds from losing the")
    print("host to the first step committed in the new generation (restart: to the first step)")
    print(f"{'variant':<44}{'runs':>5}{'median s':>10}{'min s':>8}{'max s':>8}")
    rows = {
        "elastic, killed host": elastic["killed host"],
        "elastic, cut link (5 s failure timeout)": elastic["cut link"],
        "restart every worker from scratch (torchrun)": restart,
    }
    for name, values in rows.items():
        if values:
            print(
                f"{name:<44}{len(values):>5}{statistics.median(values):>10.3f}"
                f"{min(values):>8.3f}{max(values):>8.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
