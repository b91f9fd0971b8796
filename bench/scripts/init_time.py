"""Prints ``init_seconds RANK SECONDS``: from this process's start (the kernel's clock) until
its job's init returned, and ``init_done_at RANK EPOCH``: when. ``hvd``: ``hvd.init()``;
``dist``: torch.distributed's ``init_process_group("gloo")`` with the ``env://`` method, fed
from srun's variables."""

from __future__ import annotations

import os
import sys
import time

import psutil

started = psutil.Process().create_time()

if sys.argv[1] == "hvd":
    import collectives.torch as hvd

    hvd.init()
    done = time.time()
    rank = hvd.rank()
    hvd.allreduce(__import__("torch").zeros(1), name="ready")
    hvd.shutdown()
else:
    import torch.distributed as dist

    os.environ.setdefault("RANK", os.environ.get("SLURM_PROCID", "0"))
    os.environ.setdefault("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    dist.init_process_group("gloo")
    done = time.time()
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
print(f"init_seconds {rank} {done - started:.3f}", flush=True)
print(f"init_done_at {rank} {done:.3f}", flush=True)
