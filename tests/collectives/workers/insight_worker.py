"""A training-like loop in which one rank is slow (or none is), for the job insight tests.

Every step reduces a "gradient" (in place) and a "loss"; the slow rank first sleeps or spins
(a CPU-bound busy loop, holding the GIL) for ``--delay`` seconds, while the others work for a
tenth of that. ``--report FILE``: rank 0 prints ``hvd.report()`` at the end and writes its
JSON to FILE (jobs of other launchers). ``--fail CODE``: the last rank exits with CODE after
the loop (its ``hvd.shutdown()`` runs at exit).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import collectives.torch as hvd


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end:
        count += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slow", type=int, default=-1, help="the slow rank (-1: none)")
    parser.add_argument("--how", choices=("sleep", "spin"), default="sleep")
    parser.add_argument("--delay", type=float, default=0.04)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--report", default=None)
    parser.add_argument("--fail", type=int, default=0)
    args = parser.parse_args()
    hvd.init()
    rank = hvd.rank()
    grad = torch.ones(1000)
    for step in range(args.steps):
        if rank == args.slow:
            (spin if args.how == "spin" else time.sleep)(args.delay)
        else:
            time.sleep(args.delay / 10)
        hvd.allreduce_(grad, name="grad")
        hvd.allreduce(torch.tensor([float(step)]), name="loss")
    if args.report is not None and rank == 0:
        report = hvd.report(file=args.report)
        print(report)
    print(f"DONE rank {rank}")
    if args.fail and rank == hvd.size() - 1:
        sys.exit(args.fail)


if __name__ == "__main__":
    main()
