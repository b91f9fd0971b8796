"""Worker for the tuning/timeline job: reports the engine's configuration as the hvdrun flags
and environment set it, runs ops of every kind, checks that the timeline file parses while
it is being written, and records a second timeline with start_timeline/stop_timeline.

Usage: tuning_worker.py RUNTIME_TIMELINE_PATH (may contain {rank})
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd
from collectives import runtime


def run_ops(prefix: str, r: int, n: int) -> None:
    # 20 x 32 KB: fused (under the 1 MB threshold), too much to ride with the negotiation.
    handles = [
        hvd.allreduce_async(torch.full((8192,), float(i)), op=hvd.Sum, name=f"{prefix}.small.{i}")
        for i in range(20)
    ]
    for handle in handles:
        hvd.synchronize(handle)
    for i in range(5):  # tiny: their data rides with the negotiation
        hvd.allreduce(torch.ones(3), name=f"{prefix}.tiny.{i}")
    for _ in range(6):  # one name again and again: the response cache's rounds
        hvd.allreduce(torch.ones(3), name=f"{prefix}.repeat")
    hvd.allreduce(torch.ones(400_000), name=f"{prefix}.large")  # 1.6 MB: over 1 MB, in place
    hvd.grouped_allreduce([torch.ones(3), torch.ones(4)], name=f"{prefix}.grouped")
    hvd.allgather(torch.ones(r + 1, 2), name=f"{prefix}.gather")
    hvd.broadcast(torch.ones(5), root_rank=0, name=f"{prefix}.bcast")
    hvd.alltoall(torch.ones(n, 2), name=f"{prefix}.a2a")
    hvd.reducescatter(torch.ones(n * 2), name=f"{prefix}.rs")
    hvd.barrier()


def main() -> None:
    torch.set_num_threads(1)
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    cfg = runtime.config()
    print(
        "CONFIG "
        + json.dumps(
            {
                "fusion_threshold": cfg.fusion_threshold,
                "cycle_time_ms": cfg.cycle_time_ms,
                "timeline": cfg.timeline,
                "timeline_mark_cycles": cfg.timeline_mark_cycles,
                "stall_check": cfg.stall_check,
                "stall_warning_seconds": cfg.stall_warning_seconds,
                "stall_shutdown_seconds": cfg.stall_shutdown_seconds,
                "collective_timeout_seconds": cfg.collective_timeout_seconds,
            }
        ),
        flush=True,
    )
    run_ops("first", r, n)
    if r == 0 and cfg.timeline:
        with open(cfg.timeline) as file:
            events = json.load(file)  # raises if the file is not valid JSON right now
        c.expect("timeline.valid_while_written", len(events) > 10, len(events))
    second = sys.argv[1]
    hvd.start_timeline(second, mark_cycles=False)
    run_ops("second", r, n)
    hvd.stop_timeline()
    run_ops("third", r, n)  # not recorded in the second file
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
