"""The GPU check: on a machine with one GPU (or more), the GPU tests and the CUDA
benchmarks in about five minutes, ending in one table (device, torch, NCCL, figures,
ratios against their targets). ``make gpu-check`` runs it; docs/gpu.md says how to read it.

1. The GPU tests: ``tests/gpu`` (every CUDA path with 2 and 4 ranks sharing the GPU
   through Gloo, NCCL jobs that end without an abort) and the CUDA test of
   ``tests/collectives/test_size1.py``.
2. Size 1 with NCCL (``bench/gpu_scripts/gpu_worker.py`` alone): one 4-byte
   ``allreduce_`` against ``dist.all_reduce`` on torch's NCCL group (target <= 2x);
   100 x 4 KB ``allreduce_async_`` then ``synchronize`` against the per-tensor loop
   (target <= 0.5x: fusion must win); in place from 4 B to 256 MB; training steps (ResNet-18,
   batch 64, 224 px) with DistributedOptimizer against plain torch (target >= 0.99x the
   throughput) and DDP (>= 1.05x).
3. Two ranks on one GPU through Gloo (``hvdrun -np 2 --cuda-backend gloo``): the same
   figures against torch.distributed on Gloo.

Every call is followed by ``torch.cuda.synchronize()``. Figures are medians of the
alternating rounds, with their range. Without a GPU it says so and exits 0; ``--device
cpu`` runs the whole harness on CPU tensors instead (figures of no interest, for trying it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "gpu_scripts" / "gpu_worker.py"

#: (what, hvd variant, baseline variant, target ratio, "<=" or ">="): ratios of times,
#: except training, whose ratio is of throughput (baseline time / hvd time).
COMPARISONS = (
    ("4 B allreduce_", "latency.hvd", "latency.dist", 2.0, "<="),
    ("100 x 4 KB async + sync", "burst.hvd", "burst.dist", 0.5, "<="),
    ("in place 4 B", "size.4B.hvd", "size.4B.dist", None, ""),
    ("in place 4 KB", "size.4KB.hvd", "size.4KB.dist", None, ""),
    ("in place 4 MB", "size.4MB.hvd", "size.4MB.dist", None, ""),
    ("in place 64 MB", "size.64MB.hvd", "size.64MB.dist", None, ""),
    ("in place 256 MB", "size.256MB.hvd", "size.256MB.dist", None, ""),
    ("training vs plain torch", "train.hvd", "train.plain", 0.99, ">="),
    ("training vs DDP", "train.hvd", "train.ddp", 1.05, ">="),
)


def versions() -> dict[str, str]:
    code = (
        "import json, torch; import torch.distributed as d\n"
        "gpu = torch.cuda.is_available()\n"
        "nccl = torch.cuda.nccl.version() if gpu and d.is_nccl_available() else None\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': str(torch.version.cuda),"
        " 'nccl': '.'.join(map(str, nccl)) if nccl else 'none',"
        " 'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0,"
        " 'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    facts: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    return facts


def run_tests(device: str) -> str:
    """The GPU tests; returns pytest's summary line."""
    targets = [
        "tests/gpu",
        "tests/collectives/test_size1.py::test_cuda_ops_at_size_1",
        # The tests that failed on the first GPU machine (issue 33): a stopped hvdrun, and
        # examples and frameworks that pick cuda:<local_rank> with fewer GPUs than ranks.
        "tests/elastic/test_elastic_limits.py::test_a_stopped_hvdrun_does_not_kill_its_workers",
        "tests/launcher/test_job.py::test_a_plain_ddp_script_trains_under_hvdrun",
        "tests/collectives/test_training.py::test_synthetic_benchmark_example_reports_rates",
        "tests/collectives/test_frameworks.py::test_accelerate_ddp_with_hvd_metrics",
        "tests/collectives/test_torch_semantics.py::test_torch_compile_trains_with_distributed_optimizer",
    ]
    env = {**os.environ}
    if device == "cpu":
        env["HVDRUN_GPU_TESTS_ON_CPU"] = "1"  # (tests/gpu/conftest.py)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0:
        print(result.stdout[-6000:], file=sys.stderr)
    return lines[-1] if lines else f"pytest exited {result.returncode}"


def run_worker(command: list[str], env: dict[str, str]) -> dict:
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    for line in result.stdout.splitlines():
        _, _, text = line.partition("RESULT ")
        if text:
            found: dict = json.loads(text)
            return found
    tail = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    raise RuntimeError(f"the benchmark job failed:\n{tail}")


def rows(samples: dict[str, list[float]], shared: bool = False) -> list[str]:
    """The table's rows; ``shared``: ranks sharing a GPU, where plain torch (no
    communication at all) is a reference without a target."""
    lines = []
    for what, mine, base, target, sense in COMPARISONS:
        if mine not in samples or base not in samples:
            continue
        if shared and base == "train.plain":
            target = None
        mine_ms, base_ms = statistics.median(samples[mine]), statistics.median(samples[base])
        training = mine.startswith("train.")
        ratio = base_ms / mine_ms if training else mine_ms / base_ms
        verdict = ""
        if target is not None:
            met = ratio <= target if sense == "<=" else ratio >= target
            verdict = f"{sense} {target:g}x {'met' if met else 'MISSED'}"
        lines.append(
            f"  {what:<26}{fmt(samples[mine]):>26}{fmt(samples[base]):>26}{ratio:>8.2f}x  {verdict}"
        )
    return lines


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    facts = versions()
    if args.device == "cuda" and not facts["gpus"]:
        why = "no GPU visible here"
        if facts["cuda"] == "None":  # (a GPU may be there: torch cannot use one)
            why = f"torch {facts['torch']} here is a CPU build (install a CUDA one: TORCH_SPEC)"
        print(f"gpu_check: {why}: nothing to check (--device cpu tries the harness)")
        return 0
    began = time.monotonic()
    print(
        f"device: {facts['gpu']} ({facts['gpus']} visible); torch {facts['torch']}, "
        f"CUDA {facts['cuda']}, NCCL {facts['nccl']}",
        flush=True,
    )
    tests = "skipped" if args.skip_tests else run_tests(args.device)
    print(f"GPU tests: {tests}", flush=True)
    worker = [sys.executable, str(WORKER), "--device", args.device, "--rounds", str(args.rounds)]
    if args.device == "cpu":
        worker += ["--model", "convnet", "--batch-size", "8", "--train-steps", "2"]
        worker += ["--max-bytes", str(1 << 22)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HVDRUN_", "HOROVOD_"))}
    size1 = run_worker(worker, env)
    hvdrun = shutil.which("hvdrun", path=str(Path(sys.executable).parent)) or "hvdrun"
    gloo_cmd = [hvdrun, "-np", "2", "--cuda-backend", "gloo", *worker]
    gloo2 = run_worker(gloo_cmd, env)
    header = f"  {'':<26}{'hvd ms (range)':>26}{'torch ms (range)':>26}{'ratio':>9}  target"
    backend = "NCCL" if args.device == "cuda" else "Gloo"
    print(f"\nsize 1, {backend} ({size1['facts']['device']}): hvd against dist.all_reduce")
    print(header)
    print("\n".join(rows(size1["samples"])))
    print("\n2 ranks on one GPU, CUDA tensors through Gloo: hvd against dist on Gloo")
    print(header)
    print("\n".join(rows(gloo2["samples"], shared=True)))
    took = time.monotonic() - began
    print(f"\n(training ratios are of throughput; {args.rounds} rounds; {took:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
