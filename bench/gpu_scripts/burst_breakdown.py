"""Where the time of a burst of 100 x 4 KB ``allreduce_async_`` goes at size 1, and how the
burst fares depending on what ran before it (docs/gpu.md, "The GPU check").

Prints, per variant, the median of many bursts split into submitting the 100 ops, their
``synchronize`` calls and the GPU's tail (``torch.cuda.synchronize()``), with the fused
buckets per burst and the time they took to run; then the same 100 tensors as one grouped
op and torch's per-tensor loop; then the burst right after other work (a latency loop and a
barrier, an idle pause, a large op). ``--device cpu`` runs it on int32 CPU tensors, which
take the CUDA ops' path through the engine (float32 ones would ride the negotiation round).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import collectives.torch as hvd
from collectives.engine import execute

COUNT, NUMEL = 100, 1024


class BucketClock:
    """Counts the engine's bucket runs and their time (wrapping ``Executor.run``)."""

    def __init__(self) -> None:
        self.runs = 0
        self.seconds = 0.0
        original = execute.Executor.run

        def run(executor: Any, bucket: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(executor, bucket)
            finally:
                self.runs += 1
                self.seconds += time.perf_counter() - start

        execute.Executor.run = run  # type: ignore[method-assign,assignment]

    def reset(self) -> None:
        self.runs, self.seconds = 0, 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--bursts", type=int, default=150)
    args = parser.parse_args()
    hvd.init()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    gpu_sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = torch.float32 if cuda else torch.int32
    small = [torch.zeros(NUMEL, device=args.device, dtype=dtype) for _ in range(COUNT)]
    names = [f"burst.{i}" for i in range(COUNT)]
    clock = BucketClock()

    def timed(submit: Callable[[], list[int]]) -> tuple[float, float, float]:
        """(start, submitted, synchronized) of ``submit`` and a synchronize of its handles."""
        start = time.perf_counter()
        handles = submit()
        submitted = time.perf_counter()
        for handle in handles:
            hvd.synchronize(handle)
        synchronized = time.perf_counter()
        gpu_sync()
        return start, submitted, synchronized

    def burst() -> tuple[float, float, float]:
        pairs = zip(small, names, strict=True)
        return timed(lambda: [hvd.allreduce_async_(t, op=hvd.Sum, name=n) for t, n in pairs])

    def grouped() -> tuple[float, float, float]:
        return timed(lambda: [hvd.grouped_allreduce_async_(small, op=hvd.Sum, name="grouped")])

    def each() -> list[int]:
        for tensor in small:
            dist.all_reduce(tensor)
        return []  # (nothing to synchronize: torch's own calls return when queued)

    def loop() -> tuple[float, float, float]:
        return timed(each)

    print(f"{'':<34}{'submit':>9}{'sync':>9}{'gpu':>9}{'total ms':>10}{'buckets':>9}{'run ms':>8}")
    for label, fn in (("torch's loop", loop), ("hvd burst", burst), ("hvd grouped op", grouped)):
        for _ in range(20):
            fn()
        clock.reset()
        parts = []
        for _ in range(args.bursts):
            start, submitted, synchronized = fn()
            end = time.perf_counter()
            parts.append((submitted - start, synchronized - submitted, end - synchronized))
        submit, sync, tail = (statistics.median(p) * 1e3 for p in zip(*parts, strict=True))
        total = statistics.median(sum(p) for p in parts) * 1e3
        print(
            f"{label:<34}{submit:9.3f}{sync:9.3f}{tail:9.3f}{total:10.3f}"
            f"{clock.runs / args.bursts:9.2f}{clock.seconds / args.bursts * 1e3:8.3f}"
        )

    timing = dist.new_group(backend="gloo")
    scalar = torch.zeros(1, device=args.device, dtype=dtype)
    large = torch.zeros(1 << 24, device=args.device, dtype=dtype)

    def latency_loop() -> None:
        for _ in range(100):
            hvd.allreduce_(scalar, op=hvd.Sum)
            gpu_sync()

    def settled_loop() -> None:
        latency_loop()
        dist.barrier(group=timing)

    def large_op() -> None:
        hvd.allreduce_(large, op=hvd.Sum)
        gpu_sync()

    before: dict[str, Callable[[], None]] = {
        "after a latency loop and a barrier": settled_loop,
        "after a 10 ms pause": lambda: time.sleep(0.01),
        "after a 64 MB op": large_op,
    }
    print("\nthe burst right after other work (one burst between them), total ms")
    for label, first in before.items():
        samples = []
        for _ in range(30):
            first()
            burst()
            start = time.perf_counter()
            burst()
            samples.append((time.perf_counter() - start) * 1e3)
        low, high = min(samples), max(samples)
        print(f"  {label:<40}{statistics.median(samples):8.3f} ({low:.3f}-{high:.3f})")
    hvd.shutdown()


if __name__ == "__main__":
    main()
