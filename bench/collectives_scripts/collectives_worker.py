"""The worker side of bench/collectives.py: runs under ``hvdrun -np 2``.

Each variant is timed on both ranks after a barrier on a Gloo group of its own (neither
torch's default group, which dist.all_reduce uses, nor the engine's); a sample is the slower
rank's time. Variants alternate round-robin, every other round in reverse order, and each
sample follows WARMUP_RUNS untimed runs of the same variant: a sample measures the steady
state of a loop that repeats the variant (as a training loop does), not the switch from
another variant. A latency sample is the median of its 200 calls' times (the steady state of a loop
of small ops, without the first call after the barrier); a metrics sample likewise, of its
turns' times divided by the metrics in a turn (100 turns of 2, 10 of 20); a gradient-groups
sample is a whole step (three groups of async
allreduces, a sleep before each that differs by rank). Rank 0 prints one ``RESULT <json>``
line with every variant's samples in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import collectives.torch as hvd

SMALL_COUNT = 100
SMALL_NUMEL = 1024  # 4 KB of float32
LARGE_NUMEL = 16 * 1024 * 1024  # 64 MiB of float32
LATENCY_REPEATS = 200  # calls per latency sample; the sample is their median (as in issue 15)
LARGE_REPEATS = 2  # a 64 MiB allreduce varies by +-15% run to run here: average two
#: Untimed runs of a variant before its sample: a loop's steady state, which the response
#: cache reaches once a pattern repeated (predicted from the third repetition on).
WARMUP_RUNS = 3
GROUPS, GROUP_SIZE, GROUP_NUMEL = 3, 10, 256  # a step's gradients, in groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--only", default="", help="comma-separated variant prefixes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    # Barriers and the timing reduction run on a group of their own: on torch's default
    # group (the one dist.all_reduce uses) they would leave dist's connections and threads
    # warm at every sample's start and the engine's idle.
    timing = dist.new_group(backend="gloo")
    small = [torch.randn(SMALL_NUMEL) for _ in range(SMALL_COUNT)]
    large = torch.randn(LARGE_NUMEL)
    scalar = torch.zeros(1)  # (stays finite however often it is summed)
    calls: list[float] = []  # each latency call's time, in ms
    names = [f"bench.grad.{i}" for i in range(SMALL_COUNT)]

    def dist_small() -> None:
        for tensor in small:
            dist.all_reduce(tensor)

    flat_small = torch.empty(SMALL_COUNT * SMALL_NUMEL)
    flat_views = list(flat_small.split(SMALL_NUMEL))

    def dist_small_fused() -> None:
        # A hand-written bucket: the burst's data in one allreduce, copied in and out, with
        # no per-op work at all (an engine that sums 400 KB otherwise can beat it).
        torch.cat(small, out=flat_small)
        dist.all_reduce(flat_small)
        torch._foreach_copy_(small, flat_views)

    def hvd_small() -> None:
        handles = [hvd.allreduce_async(tensor, op=hvd.Sum) for tensor in small]
        for handle in handles:
            hvd.synchronize(handle)

    def hvd_small_named() -> None:
        handles = [
            hvd.allreduce_async_(tensor, op=hvd.Sum, name=name)
            for tensor, name in zip(small, names, strict=True)
        ]
        for handle in handles:
            hvd.synchronize(handle)

    def dist_large() -> None:
        for _ in range(LARGE_REPEATS):
            dist.all_reduce(large)

    def hvd_large() -> None:
        for _ in range(LARGE_REPEATS):
            hvd.allreduce_(large, op=hvd.Sum)

    def hvd_large_out() -> None:
        for _ in range(LARGE_REPEATS):
            hvd.allreduce(large, op=hvd.Sum)

    def hvd_large_average() -> None:
        for _ in range(LARGE_REPEATS):
            hvd.allreduce(large, op=hvd.Average)

    def dist_scalar() -> None:
        calls.clear()
        for _ in range(LATENCY_REPEATS):
            start = time.perf_counter()
            dist.all_reduce(scalar)
            calls.append((time.perf_counter() - start) * 1e3)

    def hvd_scalar() -> None:
        calls.clear()
        for _ in range(LATENCY_REPEATS):
            start = time.perf_counter()
            hvd.allreduce_(scalar, op=hvd.Sum)
            calls.append((time.perf_counter() - start) * 1e3)

    def metrics_in_turn(count: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """``count`` metrics averaged one by one, in turn (as a loop logging its loss and
        accuracy does: the ops take turns, A, B, A, B): dist's loop and hvd's, each
        sample the median call."""
        tensors = [torch.ones(1) for _ in range(count)]
        names = [f"bench.metric.{count}.{i}" for i in range(count)]

        def dist_loop() -> None:
            calls.clear()
            for _ in range(LATENCY_REPEATS // count):
                start = time.perf_counter()
                for tensor in tensors:
                    dist.all_reduce(tensor)
                calls.append((time.perf_counter() - start) * 1e3 / count)
            for tensor in tensors:
                tensor.fill_(1.0)

        def hvd_loop() -> None:
            calls.clear()
            for _ in range(LATENCY_REPEATS // count):
                start = time.perf_counter()
                for tensor, name in zip(tensors, names, strict=True):
                    hvd.allreduce(tensor, name=name)
                calls.append((time.perf_counter() - start) * 1e3 / count)

        return dist_loop, hvd_loop

    dist_metrics, hvd_metrics = metrics_in_turn(2)
    dist_metrics20, hvd_metrics20 = metrics_in_turn(20)

    # Gradients as a backward pass hands them over: three groups of ten 1 KB tensors, 0.5 to
    # 1.5 ms of "compute" before each (a sleep, as a GPU's or torch's own kernels leave the
    # GIL free; the same on both ranks, about the cycle time), plus up to 0.2 ms that
    # differs by rank: the ranks' cycles split the step differently. A sample is the step.
    grads = [[torch.zeros(GROUP_NUMEL) for _ in range(GROUP_SIZE)] for _ in range(GROUPS)]
    grad_names = [[f"bench.group.{g}.{k}" for k in range(GROUP_SIZE)] for g in range(GROUPS)]
    shared, jitter = random.Random(0), random.Random(hvd.rank())

    def compute() -> None:
        time.sleep(shared.uniform(0.0005, 0.0015) + jitter.uniform(0.0, 0.0002))

    def dist_groups() -> None:
        works = []
        for group in grads:
            compute()
            works += [dist.all_reduce(tensor, async_op=True) for tensor in group]
        for work in works:
            work.wait()

    def hvd_groups() -> None:
        handles = []
        for group, group_names in zip(grads, grad_names, strict=True):
            compute()
            handles += [
                hvd.allreduce_async_(tensor, op=hvd.Sum, name=name)
                for tensor, name in zip(group, group_names, strict=True)
            ]
        for handle in handles:
            hvd.synchronize(handle)

    variants: dict[str, tuple[Callable[[], None], int]] = {
        "small.dist": (dist_small, 1),
        "small.dist_fused": (dist_small_fused, 1),
        "small.hvd": (hvd_small, 1),
        "small.hvd_named": (hvd_small_named, 1),
        "large.dist": (dist_large, LARGE_REPEATS),
        "large.hvd": (hvd_large, LARGE_REPEATS),
        "large.hvd_out": (hvd_large_out, LARGE_REPEATS),
        "large.hvd_average": (hvd_large_average, LARGE_REPEATS),
        "scalar.dist": (dist_scalar, LATENCY_REPEATS),
        "scalar.hvd": (hvd_scalar, LATENCY_REPEATS),
        "metrics.dist": (dist_metrics, LATENCY_REPEATS),
        "metrics.hvd": (hvd_metrics, LATENCY_REPEATS),
        "metrics20.dist": (dist_metrics20, LATENCY_REPEATS),
        "metrics20.hvd": (hvd_metrics20, LATENCY_REPEATS),
        "groups.dist": (dist_groups, 1),
        "groups.hvd": (hvd_groups, 1),
    }
    if args.only:
        wanted = tuple(args.only.split(","))
        variants = {name: v for name, v in variants.items() if name.startswith(wanted)}
    for fn, _ in variants.values():  # warm up: buffers, caches, connections
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants.items())
    for round_ in range(args.rounds):
        # In-place Sum variants (dist's and hvd's; three of the small ones) double the
        # tensors every call (2 ranks), each WARMUP_RUNS + 1 times a round; keep them finite.
        runs = WARMUP_RUNS + 1
        large.mul_(1.0 / 2 ** (2 * runs * LARGE_REPEATS))
        torch._foreach_mul_(small, 1.0 / 2 ** (3 * runs))
        # Alternate the direction, so no variant always follows the same other one.
        for name, (fn, repeats) in order if round_ % 2 == 0 else order[::-1]:
            for _ in range(WARMUP_RUNS):
                fn()
            dist.barrier(group=timing)
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([(time.perf_counter() - start) * 1e3 / repeats])
            if name.startswith(("scalar.", "metrics")):  # latency: the median call, not the mean
                elapsed[0] = statistics.median(calls)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=timing)
            samples[name].append(float(elapsed.item()))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(samples), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
