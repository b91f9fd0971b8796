"""Adasum's two ways against each other: gathering (one allgather, the whole tree on every
rank) and vector halving (an alltoall and a small allreduce per level, an allgather of the
parts), ``hvd.allreduce(op=hvd.Adasum)`` of one float32 tensor of 4, 16 and 32 MiB.

Runs ``hvdrun -np 4`` on bench/collectives_scripts/adasum_worker.py (Gloo, CPU, one torch
thread each); the two ways alternate round by round in one job, each sample the slower
rank's time. The table shows medians, ranges and the halving's time over the gathering's:
the figures behind ``collectives.ops.HALVING_MIN_BYTES`` (docs/engine.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "collectives_scripts" / "adasum_worker.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--np", type=int, default=4)
    args = parser.parse_args()
    hvdrun = shutil.which("hvdrun", path=str(Path(sys.executable).parent)) or "hvdrun"
    command = [hvdrun, "-np", str(args.np), sys.executable, str(WORKER)]
    result = subprocess.run(
        [*command, "--rounds", str(args.rounds)], capture_output=True, text=True, timeout=900
    )
    found = [line.partition("RESULT ")[2] for line in result.stdout.splitlines()]
    texts = [text for text in found if text]
    if not texts:
        raise SystemExit(f"the benchmark job failed:\n{result.stdout}\n{result.stderr}")
    samples: dict[str, list[float]] = json.loads(texts[0])
    print(f"Adasum allreduce, {args.np} ranks, ms: median (range), {args.rounds} rounds")
    print("| tensor | gathering | vector halving | halving / gathering |")
    print("| --- | --- | --- | --- |")
    sizes = dict.fromkeys(label.rsplit(" ", 1)[0] for label in samples)
    for size in sizes:
        row = []
        for way in ("gathering", "halving"):
            ms = sorted(1000 * s for s in samples[f"{size} {way}"])
            row.append((statistics.median(ms), ms[0], ms[-1]))
        cells = [f"{m:.1f} ({lo:.1f}-{hi:.1f})" for m, lo, hi in row]
        print(f"| {size} | {cells[0]} | {cells[1]} | {row[1][0] / row[0][0]:.2f}x |")


if __name__ == "__main__":
    main()
