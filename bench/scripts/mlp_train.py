"""One rank of bench/training.py: SGD on a 16-layer, 512-wide MLP, batch 64 per rank.

``--mode hvd`` runs under hvdrun with hvd.DistributedOptimizer; ``--mode ddp`` runs as a
bare process (env:// rendezvous) with torch DistributedDataParallel. Rank 0 prints one
line ``result steps_per_s=... peak_rss_mb=... cpu_ms_per_step=...`` (peak RSS is the max
over ranks, CPU time per step the mean).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


def build_model(width: int = 512, depth: int = 16) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["hvd", "ddp"], required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    model = build_model()
    optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if args.mode == "hvd":
        import collectives.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        net: nn.Module = model
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        net = nn.parallel.DistributedDataParallel(model)

    generator = torch.Generator().manual_seed(rank)
    data = torch.randn(args.batch_size, 512, generator=generator)
    target = torch.randn(args.batch_size, 512, generator=generator)

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(net(data), target).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    cpu_start = time.process_time()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    # CPU time of all the process's threads: what a step costs, whatever else the machine runs.
    cpu_ms = torch.tensor([(time.process_time() - cpu_start) / args.steps * 1000])

    rss_mb = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    rate = torch.tensor([args.steps / elapsed])
    if args.mode == "hvd":
        rss_mb = hvd.allreduce(rss_mb, op=hvd.Max)
        rate = hvd.allreduce(rate, op=hvd.Min)
        cpu_ms = hvd.allreduce(cpu_ms, op=hvd.Average)
        hvd.shutdown()
    else:
        dist.all_reduce(rss_mb, op=dist.ReduceOp.MAX)
        dist.all_reduce(rate, op=dist.ReduceOp.MIN)
        dist.all_reduce(cpu_ms)
        cpu_ms /= size
        dist.destroy_process_group()
    if rank == 0:
        print(
            f"result steps_per_s={rate.item():.3f} peak_rss_mb={rss_mb.item():.1f} "
            f"cpu_ms_per_step={cpu_ms.item():.1f} size={size}"
        )
    if args.mode == "ddp":
        # Tearing down DDP's reducer at exit can deadlock in torch (its Gloo group is
        # destroyed with the GIL held while a Gloo thread waits for the GIL to free a
        # tensor); the measurement is done, so leave without the teardown.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
