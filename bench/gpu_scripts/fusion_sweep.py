"""Training throughput against DDP for several fusion thresholds (docs/gpu.md, "Fusion on
the GPU"): for each threshold, ``hvdrun -np 2 --cuda-backend gloo`` runs ResNet-18 steps
with DistributedOptimizer, DDP and plain torch, alternating round by round, and one line
per threshold gives the medians and hvd's throughput over DDP's. "default" runs without
``--fusion-threshold-mb`` (CUDA reductions then fuse up to 4 MiB).

``--device cpu`` tries it on CPU tensors (a small model; figures of no interest).
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

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--thresholds", default="default,128,16,4", help="MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", metavar="LABEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args)
    hvdrun = shutil.which("hvdrun", path=str(Path(sys.executable).parent)) or "hvdrun"
    for threshold in args.thresholds.split(","):
        flags = [] if threshold == "default" else ["--fusion-threshold-mb", threshold]
        command = [hvdrun, "-np", "2", "--cuda-backend", "gloo", "--no-report", *flags]
        command += [sys.executable, __file__, "--device", args.device]
        command += ["--rounds", str(args.rounds), "--worker", threshold]
        # (the threshold is this script's to choose: none inherited from the shell)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDRUN_", "HOROVOD_"))}
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        lines = [line for line in result.stdout.splitlines() if "SWEEP " in line]
        if result.returncode or not lines:
            failed = f"{threshold}: the job failed (exit {result.returncode})"
            print(f"{failed}:\n{result.stderr[-3000:]}")
            return 1
        print(lines[0].partition("SWEEP ")[2], flush=True)
    return 0


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    import collectives.torch as hvd

    sys.path.insert(0, str(HERE))
    from gpu_worker import joined, training_variants

    device, sync = joined(args.device)
    cpu = device.type == "cpu"
    settings = argparse.Namespace(
        model="convnet" if cpu else "resnet18",
        batch_size=8 if cpu else 64,
        train_steps=2 if cpu else 10,
    )
    timing = dist.new_group(backend="gloo")
    variants = training_variants(settings, device, sync)
    for fn in variants.values():
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for round_ in range(args.rounds):
        for name, fn in order if round_ % 2 == 0 else order[::-1]:
            dist.barrier(group=timing)
            start = time.perf_counter()
            fn()
            slowest = torch.tensor([(time.perf_counter() - start) * 1e3])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=timing)
            samples[name].append(float(slowest.item()))
    if hvd.rank() == 0:
        median = {name: statistics.median(values) for name, values in samples.items()}
        label = "default" if args.worker == "default" else f"{args.worker} MiB"
        print(
            f"SWEEP threshold {label:<9} hvd {median['train.hvd']:8.1f} ms  "
            f"DDP {median['train.ddp']:8.1f} ms  plain {median['train.plain']:8.1f} ms  "
            f"hvd/DDP {median['train.ddp'] / median['train.hvd']:.3f}x",
            flush=True,
        )
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
