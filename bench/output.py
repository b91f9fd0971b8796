"""Worker output: how fast a worker's lines get through hvdrun, against the same worker
writing to /dev/null itself (the floor) and under ``mpirun --tag-output`` (Open MPI's own
prefixed forwarding, where mpirun is installed).

One worker writes ``--lines`` lines of 100 bytes as fast as it can; hvdrun (and mpirun) print
each with its rank prefix to /dev/null. The figure is the wall time of the whole command
(start-up included: a run of no lines is measured too and shown), the rate the lines per
second of the time beyond that start-up (the worker alone shows none: its wall time is the
floor). Variants run round-robin; medians and ranges.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
WRITER = (
    "import sys; n = int(sys.argv[1]); line = b'x' * 99 + b'\\n'; w = sys.stdout.buffer.write\n"
    "for _ in range(n // 1000): w(line * 1000)\n"
    "w(line * (n % 1000)); sys.stdout.flush()"
)


def commands(lines: int) -> dict[str, list[str]]:
    worker = [sys.executable, "-c", WRITER, str(lines)]
    found = {"worker alone": worker}
    hvdrun = shutil.which("hvdrun", path=str(BIN)) or "hvdrun"
    found["hvdrun -np 1"] = [hvdrun, "-np", "1", "--no-report", *worker]
    mpirun = shutil.which("mpirun")
    if mpirun:
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        found["mpirun --tag-output"] = [mpirun, *root, "-np", "1", "--tag-output", *worker]
    return found


def timed(argv: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    full, empty = commands(args.lines), commands(0)
    times: dict[str, list[float]] = {name: [] for name in full}
    starts: dict[str, list[float]] = {name: [] for name in full}
    for _ in range(args.rounds):
        for name in full:
            starts[name].append(timed(empty[name]))
            times[name].append(timed(full[name]))
    print(f"{args.lines} lines of 100 bytes, {args.rounds} rounds (medians, ranges)")
    print(f"{'variant':<22} {'wall s':>8} {'range':>13} {'start s':>8} {'lines/s':>10}")
    rates = {}
    for name in full:
        wall, start = statistics.median(times[name]), statistics.median(starts[name])
        rates[name] = args.lines / max(wall - start, 1e-9)
        spread = f"{min(times[name]):.2f}-{max(times[name]):.2f}"
        shown = "(floor)" if name == "worker alone" else f"{rates[name]:.0f}"
        print(f"{name:<22} {wall:8.3f} {spread:>13} {start:8.3f} {shown:>10}")
    if "mpirun --tag-output" in rates:
        ratio = rates["hvdrun -np 1"] / rates["mpirun --tag-output"]
        print(f"hvdrun's lines per second: {ratio:.2f}x mpirun's")


if __name__ == "__main__":
    main()
