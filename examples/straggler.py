"""One slow rank, and how hvdrun finds it (docs/insight.md).

    hvdrun -np 2 --timeline-filename trace.json --timeline-all-ranks \\
        python examples/straggler.py --slow-rank 1

A small MLP trains with ``hvd.DistributedOptimizer`` on random data; the slow rank sleeps
(``--how spin``: computes) for ``--delay`` seconds each step, as a rank on a throttled GPU or
on a host with a noisy neighbour would. hvdrun's end-of-job table names it, its warning says
so while the job runs, and ``trace.json`` (every rank's timeline, merged) shows it late for
every step. ``--report FILE`` has rank 0 print ``hvd.report()`` and write its JSON, as a job
of another launcher (torchrun, srun, mpirun) would.
"""

from __future__ import annotations

import argparse
import time

import torch

import collectives.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--slow-rank", type=int, default=1, help="-1: none")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--how", choices=("sleep", "spin"), default="sleep")
    parser.add_argument("--report", metavar="FILE", help="rank 0 prints hvd.report()")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(hvd.rank())
    for _ in range(args.steps):
        x = torch.randn(64, 64, generator=data)
        y = torch.randint(0, 10, (64,), generator=data)
        if hvd.rank() == args.slow_rank:
            if args.how == "sleep":
                time.sleep(args.delay)
            else:
                end = time.perf_counter() + args.delay
                while time.perf_counter() < end:
                    pass
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        loss = hvd.allreduce(loss.detach(), name="loss")
    if hvd.rank() == 0:
        print(f"trained {args.steps} steps on {hvd.size()} ranks; last loss {loss.item():.3f}")
        if args.report:
            print(hvd.report(file=args.report))


if __name__ == "__main__":
    main()
