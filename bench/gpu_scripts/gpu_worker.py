"""The worker side of bench/gpu_check.py: the CUDA hot path against torch.distributed.

Run alone (size 1: NCCL, torch's default group beside the engine's) or under ``hvdrun -np 2
--cuda-backend gloo`` (two ranks on one GPU, CUDA tensors through Gloo on both sides).
Every timed call ends with ``torch.cuda.synchronize()``, as a training step waits for its
results. Variants alternate round by round (every other round in reverse) after warm-up
runs; a sample is the slower rank's time. Rank 0 prints one ``RESULT <json>`` line: each
variant's samples in milliseconds (latency samples: the median call of their loop).

``--device cpu`` runs the same code on CPU tensors (the harness, without a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from pytorch_synthetic_benchmark import MODELS

SMALL_COUNT, SMALL_NUMEL = 100, 1024  # 100 x 4 KB of float32
LATENCY_CALLS = 100
SIZES = {"4B": 1, "4KB": 1024, "4MB": 1 << 20, "64MB": 1 << 24, "256MB": 1 << 26}
WARMUP_RUNS = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=10)
    parser.add_argument("--max-bytes", type=int, default=1 << 28)
    args = parser.parse_args()
    device, sync = joined(args.device)
    cuda = device.type == "cuda"
    timing = dist.new_group(backend="gloo")  # barriers and the slowest-rank reduction

    calls: list[float] = []
    scalar = torch.zeros(1, device=device)

    def latency(op: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            calls.clear()
            for _ in range(LATENCY_CALLS):
                start = time.perf_counter()
                op()
                sync()
                calls.append((time.perf_counter() - start) * 1e3)

        return run

    hvd_burst, dist_burst = bursts(device, sync)
    variants: dict[str, Callable[[], None]] = {
        "latency.hvd": latency(lambda: hvd.allreduce_(scalar, op=hvd.Sum)),
        "latency.dist": latency(lambda: dist.all_reduce(scalar)),
        "burst.hvd": hvd_burst,
        "burst.dist": dist_burst,
    }
    for label, numel in SIZES.items():
        if numel * 4 > args.max_bytes:
            continue
        tensor = torch.zeros(numel, device=device)

        def hvd_size(t: torch.Tensor = tensor) -> None:
            hvd.allreduce_(t, op=hvd.Sum)
            sync()

        def dist_size(t: torch.Tensor = tensor) -> None:
            dist.all_reduce(t)
            sync()

        variants[f"size.{label}.hvd"] = hvd_size
        variants[f"size.{label}.dist"] = dist_size
    variants.update(training_variants(args, device, sync))

    for fn in variants.values():
        for _ in range(WARMUP_RUNS):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for round_ in range(args.rounds):
        for name, fn in order if round_ % 2 == 0 else order[::-1]:
            fn()
            dist.barrier(group=timing)
            start = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - start) * 1e3
            if name.startswith("latency."):
                elapsed = statistics.median(calls)
            slowest = torch.tensor([elapsed])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=timing)
            samples[name].append(float(slowest.item()))
    if hvd.rank() == 0:
        facts = {"device": torch.cuda.get_device_name() if cuda else "cpu", "size": hvd.size()}
        print("RESULT " + json.dumps({"facts": facts, "samples": samples}), flush=True)
    hvd.shutdown()


def joined(kind: str) -> tuple[torch.device, Callable[[], None]]:
    """``hvd.init()``, then this rank's device (``kind``: "cuda", the GPU of its local rank
    in turn, or "cpu") and the synchronize every timed call ends with."""
    hvd.init()
    if kind == "cpu":
        return torch.device("cpu"), lambda: None
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize


def bursts(
    device: torch.device, sync: Callable[[], None]
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A burst of 100 x 4 KB: hvd's ``allreduce_async_`` of each then ``synchronize`` of
    each, and torch's per-tensor loop of ``dist.all_reduce``; each ends with ``sync``."""
    small = [torch.zeros(SMALL_NUMEL, device=device) for _ in range(SMALL_COUNT)]
    names = [f"gpu.burst.{i}" for i in range(SMALL_COUNT)]

    def hvd_burst() -> None:
        pairs = zip(small, names, strict=True)
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=n) for t, n in pairs]
        for handle in handles:
            hvd.synchronize(handle)
        sync()

    def dist_burst() -> None:
        for tensor in small:
            dist.all_reduce(tensor)
        sync()

    return hvd_burst, dist_burst


def training_variants(
    args: argparse.Namespace, device: torch.device, sync: Callable[[], None]
) -> dict[str, Callable[[], None]]:
    """Training steps of one model: plain torch (no communication), hvd's
    DistributedOptimizer, and DDP on torch's default group; each variant runs
    ``--train-steps`` steps on the same synthetic batch."""
    size = 32 if device.type == "cpu" else 224
    data = torch.randn(args.batch_size, 3, size, size, device=device)
    target = torch.randint(0, 1000, (args.batch_size,), device=device)

    def trainer(kind: str) -> Callable[[], None]:
        torch.manual_seed(0)
        model = MODELS[args.model]().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
        net: torch.nn.Module = model
        if kind == "hvd":
            optimizer = hvd.DistributedOptimizer(
                optimizer, named_parameters=model.named_parameters()
            )
        elif kind == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)

        def steps() -> None:
            for _ in range(args.train_steps):
                optimizer.zero_grad()
                F.cross_entropy(net(data), target).backward()
                optimizer.step()
            sync()

        return steps

    return {f"train.{kind}": trainer(kind) for kind in ("plain", "hvd", "ddp")}


if __name__ == "__main__":
    main()
