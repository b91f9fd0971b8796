"""SSH launch: time from hvdrun's start until all 4 workers have registered.

Compares ``hvdrun -H a:2,b:2`` over SSH (two hosts of the test cluster in tests/cluster.py:
network namespaces with their own sshd, so this needs root and openssh-server) with
``hvdrun -np 4`` on this host. Workers either register with the bare rendezvous client
(what the launcher costs: SSH, agents, worker start) or call ``hvd.init()`` (plus importing
torch and building the Gloo group). Runs are round-robin so that machine noise hits every
variant alike; the table shows medians (and the range of the registration times). Without
root or sshd it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.cluster import Cluster, start_cluster, unavailable_reason  # noqa: E402

WORKER = HERE / "scripts" / "registered_at.py"


def run_job(cluster: Cluster, hosts: str, init: bool) -> tuple[float, float]:
    """(seconds until the last worker registered, seconds until hvdrun exited)."""
    extra = ["--init"] if init else []
    argv = cluster.hvdrun_argv("-H", hosts, sys.executable, str(WORKER), *extra)
    start = time.time()
    result = subprocess.run(
        argv, capture_output=True, text=True, env=cluster.env(), timeout=300, check=False
    )
    done = time.time()
    stamps = [
        float(line.rsplit(" ", 1)[1])
        for line in result.stdout.splitlines()
        if "registered_at " in line
    ]
    if result.returncode != 0 or len(stamps) != 4:
        raise RuntimeError(f"job failed ({result.returncode}): {result.stderr[-2000:]}")
    return max(stamps) - start, done - start


LOCAL = "4 slots on this host"
REMOTE = "2 hosts x 2 slots over SSH"
CLIENT = "rendezvous client"
INIT = "hvd.init()"


def variants(cluster: Cluster) -> dict[tuple[str, str], Callable[[], tuple[float, float]]]:
    a, b = cluster.hosts[:2]
    hosts = {LOCAL: "localhost:4", REMOTE: f"{a.address}:2,{b.address}:2"}
    return {
        (where, worker): functools.partial(run_job, cluster, hosts[where], worker == INIT)
        for worker in (CLIENT, INIT)
        for where in (LOCAL, REMOTE)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"ssh_launch: skipped: {reason}")
        return 0
    cluster = start_cluster(hosts=2, sshd_hosts=2)
    try:
        jobs = variants(cluster)
        for job in jobs.values():  # warm caches and record host keys, unmeasured
            job()
        registered: dict[tuple[str, str], list[float]] = {key: [] for key in jobs}
        total: dict[tuple[str, str], list[float]] = {key: [] for key in jobs}
        for _ in range(args.rounds):
            for key, job in jobs.items():
                until_registered, until_exit = job()
                registered[key].append(until_registered)
                total[key].append(until_exit)
    finally:
        cluster.close()
    print(
        f"ssh_launch: hvdrun start -> all 4 workers registered, "
        f"median of {args.rounds} round-robin runs"
    )
    print(
        f"{'where':<28}{'workers use':<20}{'registered s':>13}{'range s':>12}{'job s':>8}"
        f"{'vs here':>9}"
    )
    medians = {key: statistics.median(values) for key, values in registered.items()}
    for where, worker in jobs:
        median = medians[(where, worker)]
        ratio = median / medians[(LOCAL, worker)]
        job_s = statistics.median(total[(where, worker)])
        runs = registered[(where, worker)]
        spread = f"{min(runs):.2f}-{max(runs):.2f}"
        print(f"{where:<28}{worker:<20}{median:>13.3f}{spread:>12}{job_s:>8.3f}{ratio:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
