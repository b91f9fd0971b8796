"""Joining a job another launcher started: process start -> init returned, 2 nodes x 2 tasks.

On the Slurm test cluster (tests/slurm.py: slurmctld and two slurmd hosts in network
namespaces; needs root and Debian's slurm packages) the same 4-process job is started four
ways, round-robin, and every process reports how long it took from its own start (the
kernel's clock, so Python's and torch's imports count) until its init returned:

* ``srun`` + ``hvd.init()``: rank 0 serves the rendezvous, the others find it on their own;
* the same with ``HVDRUN_SECRET`` exported, so that the rendezvous speaks TLS (every rank
  derives the certificate authority from the secret): what TLS costs;
* ``srun`` + ``torch.distributed.init_process_group("gloo", "env://")``, the baseline, given
  ``MASTER_ADDR``/``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME`` the way an sbatch script must;
* ``hvdrun -H a:2,b:2`` over SSH + ``hvd.init()``.

The table shows the median over runs of the slowest rank (when the job could start), its range,
and the median of all ranks. Without root or Slurm it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.cluster import unavailable_reason  # noqa: E402
from tests.slurm import SlurmCluster, slurm_for_tests, slurm_unavailable_reason  # noqa: E402

SCRIPT = str(HERE / "scripts" / "init_time.py")
STAMP = re.compile(r"init_seconds (\d+) ([0-9.]+)")


def stamps(result: subprocess.CompletedProcess[str]) -> list[float]:
    found = [float(m.group(2)) for m in STAMP.finditer(result.stdout)]
    if result.returncode != 0 or len(found) != 4:
        raise RuntimeError(f"job failed ({result.returncode}): {result.stderr[-2000:]}")
    return found


def variants(slurm: SlurmCluster) -> dict[str, Callable[[], list[float]]]:
    first = slurm.nodes[0]
    srun = ["srun", "-N2", "--ntasks-per-node=2", sys.executable, SCRIPT]
    dist_env = slurm.env(MASTER_ADDR=first.address, MASTER_PORT="29555", GLOO_SOCKET_IFNAME="eth0")
    tls_env = slurm.env(HVDRUN_SECRET="bench-secret-0123456789abcdef")
    hosts = ",".join(f"{host.address}:2" for host in slurm.nodes)
    hvdrun = [sys.executable, "-m", "hvdrun", "-H", hosts, sys.executable, SCRIPT, "hvd"]
    return {
        "srun + hvd.init()": lambda: stamps(slurm.run(*srun, "hvd")),
        "srun + hvd.init(), HVDRUN_SECRET (TLS)": lambda: stamps(
            slurm.run(*srun, "hvd", env=tls_env)
        ),
        "srun + init_process_group(env://)": lambda: stamps(slurm.run(*srun, "dist", env=dist_env)),
        "hvdrun over SSH + hvd.init()": lambda: stamps(slurm.run(*hvdrun)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = unavailable_reason() or slurm_unavailable_reason()
    if reason is not None:
        print(f"other_launchers: skipped: {reason}")
        return 0
    for slurm in slurm_for_tests(hosts=2):
        jobs = variants(slurm)
        for job in jobs.values():  # warm caches and record host keys, unmeasured
            job()
        slowest: dict[str, list[float]] = {name: [] for name in jobs}
        every: dict[str, list[float]] = {name: [] for name in jobs}
        for _ in range(args.rounds):
            for name, job in jobs.items():
                seconds = job()
                slowest[name].append(max(seconds))
                every[name].extend(seconds)
    baseline = statistics.median(slowest["srun + init_process_group(env://)"])
    print(
        "other_launchers: 2 nodes x 2 tasks, process start -> init returned, "
        f"median of {args.rounds} round-robin runs"
    )
    print(f"{'how':<40}{'slowest rank s':>15}{'range s':>12}{'all ranks s':>13}{'vs env://':>11}")
    for name in jobs:
        median = statistics.median(slowest[name])
        spread = f"{min(slowest[name]):.2f}-{max(slowest[name]):.2f}"
        print(
            f"{name:<40}{median:>15.3f}{spread:>12}{statistics.median(every[name]):>13.3f}"
            f"{median / baseline:>10.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
