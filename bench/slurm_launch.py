"""Launch time of a 2 nodes x 2 tasks job inside a Slurm allocation: srun vs SSH vs bare srun.

On the Slurm test cluster (tests/slurm.py; needs root and Debian's slurm packages), inside
one ``salloc -N2 --ntasks-per-node=2`` per run, the same 4-process ``hvd.init()`` job starts
three ways, round-robin:

* ``hvdrun python init_time.py`` - the allocation is the host list, agents start with srun;
* ``hvdrun --launcher ssh -H a:2,b:2 ...`` - the same job, agents over SSH;
* ``srun -N2 --ntasks-per-node=2 python init_time.py`` - the baseline: no hvdrun, each process
  joins through ``hvd.init()`` under srun (issue 8's runtime).

Launch time is from the moment the command starts in the allocation until the last rank's
init returned (wall clock, all processes on this machine); total is until the command exited.
The table shows medians (and the range of the launch times) and the ratio against bare
srun. Without root or Slurm it prints why and exits 0.
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
DONE = re.compile(r"init_done_at (\d+) ([0-9.]+)")
MARKS = re.compile(r"launch_(start|end) ([0-9.]+)")
#: Stamps the command's start and end inside the allocation, around the command itself.
TIMED = (
    'echo launch_start $(date +%s.%N); "$@"; code=$?; echo launch_end $(date +%s.%N); exit $code'
)


def measure(result: subprocess.CompletedProcess[str]) -> tuple[float, float]:
    done = [float(m.group(2)) for m in DONE.finditer(result.stdout)]
    marks = {m.group(1): float(m.group(2)) for m in MARKS.finditer(result.stdout)}
    if result.returncode != 0 or len(done) != 4 or len(marks) != 2:
        raise RuntimeError(f"job failed ({result.returncode}): {result.stderr[-2000:]}")
    return max(done) - marks["start"], marks["end"] - marks["start"]


def variants(slurm: SlurmCluster) -> dict[str, Callable[[], tuple[float, float]]]:
    salloc = ["salloc", "-N2", "--ntasks-per-node=2", "sh", "-c", TIMED, "sh"]
    hvdrun = [sys.executable, "-m", "hvdrun"]
    hosts = ",".join(f"{host.address}:2" for host in slurm.nodes)
    return {
        "hvdrun via srun": lambda: measure(
            slurm.run(*salloc, *hvdrun, sys.executable, SCRIPT, "hvd")
        ),
        "hvdrun via SSH": lambda: measure(
            slurm.run(
                *salloc, *hvdrun, "--launcher", "ssh", "-H", hosts, sys.executable, SCRIPT, "hvd"
            )
        ),
        "bare srun + hvd.init()": lambda: measure(
            slurm.run(*salloc, "srun", "-N2", "--ntasks-per-node=2", sys.executable, SCRIPT, "hvd")
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    reason = unavailable_reason() or slurm_unavailable_reason()
    if reason is not None:
        print(f"slurm_launch: skipped: {reason}")
        return 0
    for slurm in slurm_for_tests(hosts=2):
        jobs = variants(slurm)
        for job in jobs.values():  # warm caches and record host keys, unmeasured
            job()
        launch: dict[str, list[float]] = {name: [] for name in jobs}
        total: dict[str, list[float]] = {name: [] for name in jobs}
        for _ in range(args.rounds):
            for name, job in jobs.items():
                ready, finished = job()
                launch[name].append(ready)
                total[name].append(finished)
    baseline = statistics.median(launch["bare srun + hvd.init()"])
    print(
        "slurm_launch: 2 nodes x 2 tasks inside salloc, command start -> last init returned "
        f"(and -> command exited), median of {args.rounds} round-robin runs"
    )
    print(f"{'how':<26}{'launch s':>10}{'range s':>12}{'total s':>10}{'vs bare srun':>14}")
    for name in jobs:
        median = statistics.median(launch[name])
        spread = f"{min(launch[name]):.2f}-{max(launch[name]):.2f}"
        print(
            f"{name:<26}{median:>10.3f}{spread:>12}{statistics.median(total[name]):>10.3f}"
            f"{median / baseline:>13.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
