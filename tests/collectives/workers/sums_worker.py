"""Worker for the small-sum test (2 ranks): a Sum through ``Sums`` gives the exact sum in
every dtype it gathers, on both sides of its thresholds, the same bits as Gloo's own
allreduce on 2 ranks and on every rank, and a NaN from one rank reaches every rank (the
response cache's mismatch marker). Callers hand it dense tensors (as Gloo needs)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd
from collectives.engine.execute import GATHER_BYTES, GATHER_MIN_ELEMENTS, Sums

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64]


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # A Gloo group of the test's own, like the engine's (which must not see foreign rounds).
    pg = dist.new_group(backend="gloo")
    sums = Sums()
    checks = Checks()

    def summed(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
        work = sums.start(pg, size, tensor)
        work.wait()
        return tensor, type(work).__name__ == "_GatheredSum"

    for dtype in DTYPES:
        most = GATHER_BYTES // ((size - 1) * dtype.itemsize)  # the largest that gathers
        for numel in (1, GATHER_MIN_ELEMENTS - 1, GATHER_MIN_ELEMENTS, 1000, most, most + 1):
            # Small integers: every dtype holds their sum exactly.
            mine = (torch.arange(numel) % 7 + rank).to(dtype)
            want = sum((torch.arange(numel) % 7 + r).to(torch.float64) for r in range(size))
            result, gathered = summed(mine.clone())
            name = f"{dtype}.{numel}"
            checks.expect(f"exact.{name}", bool((result.double() == want).all()), result[:4])
            expect_gather = GATHER_MIN_ELEMENTS <= numel <= most
            checks.expect(f"path.{name}", gathered == expect_gather, gathered)

    # Random floats: the gathered sum has Gloo's bits (2 ranks) and every rank's.
    gen = torch.Generator().manual_seed(rank)
    for numel in (5, 4096, 100_000):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            data = torch.randn(numel, generator=gen).to(dtype)
            ours, gathered = summed(data.clone())
            theirs = data.clone()
            dist.all_reduce(theirs)
            everyone = [torch.empty_like(ours) for _ in range(size)]
            dist.all_gather(everyone, ours)
            name = f"{dtype}.{numel}"
            expect_gather = numel * dtype.itemsize * (size - 1) <= GATHER_BYTES
            checks.expect(f"path.{name}", gathered == expect_gather, gathered)
            checks.expect(f"bits.gloo.{name}", torch.equal(ours, theirs), name)
            checks.expect(f"bits.ranks.{name}", all(torch.equal(ours, o) for o in everyone))

    # A NaN from one rank (the cache's "my ops differ") is NaN everywhere.
    marked = torch.zeros(64)
    if rank == size - 1:
        marked[0] = float("nan")
    result, gathered = summed(marked)
    checks.expect("nan", gathered and bool(result[0].isnan()) and bool((result[1:] == 0).all()))

    # Dense but not contiguous (transposed): Gloo's allreduce, exact.
    base = torch.arange(8.0).view(4, 2)
    result, gathered = summed((base + rank).t())
    want = (base * size + sum(range(size))).t()
    checks.expect("transposed", not gathered and torch.equal(result, want), result)
    hvd.shutdown()
    checks.finish(rank)


if __name__ == "__main__":
    main()
