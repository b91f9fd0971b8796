"""Launch overhead: wall time of a 2-rank job that inits, allreduces one scalar and exits.

Compares ``hvdrun -np 2`` with ``torchrun --standalone --nproc-per-node 2`` running the
equivalent torch.distributed script, and with two bare ``python`` processes doing the same
(the floor: what any launcher must pay for two interpreters that import torch). Runs are
round-robin so that machine noise hits every variant alike; the table shows medians and
ranges, and the medians of the per-round ratios ("paired", in which slow drifts of the load
cancel). Targets (issue 2): hvdrun <= 1.25x bare, <= 0.7x torchrun.

Run it where Python may write its bytecode caches (``PYTHONDONTWRITEBYTECODE`` unset), as a
user's machine does: without them every hvdrun, agent and worker process compiles the
project's modules from source at each start, which the bare processes (torch only, compiled
at install) never pay.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_hvdrun() -> None:
    hvdrun = shutil.which("hvdrun", path=str(BIN)) or "hvdrun"
    subprocess.run(
        [hvdrun, "-np", "2", sys.executable, str(SCRIPTS / "hvd_allreduce.py")],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run_torchrun() -> None:
    torchrun = shutil.which("torchrun", path=str(BIN)) or "torchrun"
    subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "torch_allreduce.py")],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run_bare() -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
        }
        procs.append(
            subprocess.Popen([sys.executable, str(SCRIPTS / "torch_allreduce.py")], env=env)
        )
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"bare processes failed: {codes}")


VARIANTS: dict[str, Callable[[], None]] = {
    "bare python x2": run_bare,
    "hvdrun -np 2": run_hvdrun,
    "torchrun --nproc-per-node 2": run_torchrun,
}


def measure(rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for fn in VARIANTS.values():  # warm the page cache once, unmeasured
        fn()
    for _ in range(rounds):
        for name, fn in VARIANTS.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set: every process compiles hvdrun's modules")
    times = measure(args.rounds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    bare, torchrun = medians["bare python x2"], medians["torchrun --nproc-per-node 2"]
    hvd = medians["hvdrun -np 2"]
    print(f"launch: 2-rank init + allreduce + exit, median of {args.rounds} round-robin runs")
    print(f"{'variant':<30}{'median s':>10}{'range s':>15}{'vs bare':>10}{'vs torchrun':>13}")
    for name, median in medians.items():
        spread = f"{min(times[name]):.2f}-{max(times[name]):.2f}"
        print(
            f"{name:<30}{median:>10.3f}{spread:>15}"
            f"{median / bare:>9.2f}x{median / torchrun:>12.2f}x"
        )
    rounds = range(args.rounds)
    hvd_runs, bare_runs = times["hvdrun -np 2"], times["bare python x2"]
    torchrun_runs = times["torchrun --nproc-per-node 2"]
    paired_bare = statistics.median(hvd_runs[i] / bare_runs[i] for i in rounds)
    paired_torchrun = statistics.median(hvd_runs[i] / torchrun_runs[i] for i in rounds)
    print(
        f"targets: hvdrun/bare = {hvd / bare:.2f} (paired {paired_bare:.2f}; <= 1.25), "
        f"hvdrun/torchrun = {hvd / torchrun:.2f} (paired {paired_torchrun:.2f}; <= 0.70)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
