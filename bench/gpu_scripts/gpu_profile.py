"""Where a CUDA op's time goes at size 1: the costs of the CUDA calls the engine makes
around a collective, then ``hvd.allreduce_`` of 4 bytes and a burst of 100 x 4 KB under
cProfile (the calling thread, which runs a synchronous op's cycle itself), printed as the
functions with the most time of their own. For the GPU machine (docs/gpu.md); ``--device
cpu`` runs it on CPU tensors (with ``--dtype int32`` the 4 B op takes the path of a CUDA op:
its data does not ride the negotiation round)."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import collectives.torch as hvd
from collectives import runtime

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_worker import bursts, joined


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def profile(label: str, fn: Callable[[], object], repeat: int, top: int) -> None:
    for _ in range(20):
        fn()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(repeat):
        fn()
    prof.disable()
    took = (time.perf_counter() - start) / repeat * 1e6
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    print(f"==== {label}: {took:.1f} us per call under the profiler")
    print("\n".join(out.getvalue().splitlines()[4:]))


def then(first: Callable[[], object], second: Callable[[], object]) -> Callable[[], None]:
    """A call of ``first`` followed by ``second`` (a synchronize)."""

    def both() -> None:
        first()
        second()

    return both


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "int32"),
        help="the 4 B op's dtype (int32 on CPU: the path of ops that do not ride a round, "
        "which CUDA ops take)",
    )
    args = parser.parse_args()
    device, sync = joined(args.device)
    cuda = device.type == "cuda"

    scalar = torch.zeros(1, device=device, dtype=getattr(torch, args.dtype))
    if cuda:
        side = torch.cuda.Stream()
        current = torch.cuda.current_stream()
        recorded = torch.cuda.Event()
        recorded.record(current)
        costs: dict[str, Callable[[], object]] = {
            "torch.cuda.Event()": torch.cuda.Event,
            "Event() + record(current)": lambda: torch.cuda.Event().record(current),
            "current_stream()": torch.cuda.current_stream,
            "with torch.cuda.stream(side)": lambda: torch.cuda.stream(side).__enter__(),
            "side.wait_event(recorded)": lambda: side.wait_event(recorded),
            "tensor.record_stream(side)": lambda: scalar.record_stream(side),
            "recorded.synchronize()": recorded.synchronize,
            "recorded.query()": recorded.query,
            "torch.cuda.synchronize() idle": torch.cuda.synchronize,
            "scalar.add_(1) launch": lambda: scalar.add_(1),
            "scalar.add_(1) + synchronize": then(lambda: scalar.add_(1), torch.cuda.synchronize),
            "dist.all_reduce(scalar) + synchronize": then(
                lambda: dist.all_reduce(scalar), torch.cuda.synchronize
            ),
        }
        nccl = dist.new_group(backend="nccl")
        opts = dist.AllreduceOptions()

        def on_side() -> None:
            with torch.cuda.stream(side):
                nccl.allreduce([scalar], opts).wait()
            torch.cuda.synchronize()

        costs["group.allreduce(scalar).wait() + synchronize"] = then(
            lambda: nccl.allreduce([scalar], opts).wait(), torch.cuda.synchronize
        )
        costs["the same on a side stream"] = on_side
        # The engine's data group is one group with a backend per device type: is a call
        # through it dearer than through a group of NCCL alone?
        mixed = dist.new_group(backend="cpu:gloo,cuda:nccl")
        costs["the same, cpu:gloo,cuda:nccl group"] = then(
            lambda: mixed.allreduce([scalar], opts).wait(), torch.cuda.synchronize
        )
        engine_pg = runtime.engine().controller(0).runner.dispatch.executor.process_group
        costs["the same, the engine's data group"] = then(
            lambda: engine_pg.allreduce([scalar], opts).wait(), torch.cuda.synchronize
        )
        print("==== CUDA call costs (us per call, median of 5 x 2000)")
        for what, fn in costs.items():
            print(f"  {what:<40}{per_call_us(fn):>9.2f}")
        sync()
    print("==== hvd (us per call)")
    timed: dict[str, Callable[[], object]] = {
        "hvd.allreduce_(4 B) + sync": then(lambda: hvd.allreduce_(scalar, op=hvd.Sum), sync),
        "dist.all_reduce(4 B) + sync": then(lambda: dist.all_reduce(scalar), sync),
    }
    for what, fn in timed.items():
        print(f"  {what:<40}{per_call_us(fn, 500):>9.2f}")

    burst, dist_burst = bursts(device, sync)

    print(f"  {'hvd burst 100 x 4 KB':<40}{per_call_us(burst, 20):>9.2f}")
    print(f"  {'dist burst 100 x 4 KB':<40}{per_call_us(dist_burst, 20):>9.2f}")
    profile("hvd.allreduce_(4 B) + sync", timed["hvd.allreduce_(4 B) + sync"], 2000, args.top)
    profile("hvd burst 100 x 4 KB", burst, 50, args.top)
    hvd.shutdown()


if __name__ == "__main__":
    main()
