"""One job of bench/adasum.py: Adasum allreduces of one float32 tensor per size, gathering
and vector halving alternating round by round; prints RESULT {label: [seconds, ...]}."""

from __future__ import annotations

import argparse
import json
import time

import torch

import collectives.torch as hvd
from collectives import ops

WAYS = {"gathering": (1 << 62, 1 << 30), "halving": (0, 2)}  # (HALVING_MIN_BYTES, _RANKS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--mib", type=int, nargs="+", default=[4, 16, 32])
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    samples: dict[str, list[float]] = {}
    for mib in args.mib:
        tensor = torch.randn(mib << 18, generator=torch.Generator().manual_seed(hvd.rank()))
        for round_ in range(args.rounds + 1):
            for way, (min_bytes, min_ranks) in WAYS.items():
                ops.HALVING_MIN_BYTES, ops.HALVING_MIN_RANKS = min_bytes, min_ranks
                hvd.barrier()
                started = time.perf_counter()
                hvd.allreduce(tensor, op=hvd.Adasum, name=f"bench.{mib}")
                took = hvd.allreduce(torch.tensor(time.perf_counter() - started), op=hvd.Max)
                if round_:  # (the first round warms up)
                    samples.setdefault(f"{mib} MiB {way}", []).append(float(took))
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(samples), flush=True)


if __name__ == "__main__":
    main()
