"""Worker for test_elastic_bootstrap.py: joins an elastic job, runs one allreduce, leaves.

Prints ``joined rank=R size=S generation=G sum=X`` (each rank contributes rank + 1).
"""

from __future__ import annotations

import torch

import collectives.torch as hvd
from collectives import runtime

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), name="sum", op=hvd.Sum)
print(
    f"joined rank={hvd.rank()} size={hvd.size()} generation={runtime.generation()} "
    f"sum={total.item():g}",
    flush=True,
)
hvd.shutdown()
