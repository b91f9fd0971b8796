"""What a training script does beside its collectives after ``hvd.init()``: DataLoader
workers (forked), an ``os.fork()`` child that asks the rank and tries an op, then exits
normally, and a child process that calls ``hvd.init()`` itself. Run by test_fork.py
under ``hvdrun -np 2``."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd

LENGTH = 20


def data_loader(checks: Checks) -> None:
    """Forked DataLoader workers, two epochs: every rank sees its own shard, together all."""
    dataset = TensorDataset(torch.arange(LENGTH, dtype=torch.float32))
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=3
    )
    loader = DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        seen = [int(x) for (batch,) in loader for x in batch]
        total = hvd.allreduce(torch.tensor(float(sum(seen))), op=hvd.Sum, name=f"sum{epoch}")
        every = sorted(x for part in hvd.allgather_object(seen) for x in part)
        checks.expect(f"dataloader epoch {epoch} shards", every == list(range(LENGTH)), every)
        checks.expect(f"dataloader epoch {epoch} sum", total.item() == sum(range(LENGTH)))


def forked_child(checks: Checks) -> None:
    """The child answers the rank queries, refuses collectives and a second ``init()``, and
    its normal exit (atexit) leaves the parent's runtime alone."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        said = [f"rank={hvd.rank()}/{hvd.size()}"]
        try:
            hvd.allreduce(torch.ones(1), name="in_child")
            said.append("op ran")
        except RuntimeError as error:
            said.append(f"op refused: {error}")
        hvd.shutdown()  # forgets the parent's runtime, touches nothing of it
        try:
            hvd.init()
            said.append("init joined")
        except RuntimeError as error:
            said.append(f"init refused: {error}")
        os.write(write, "\n".join(said).encode())
        os.close(write)
        sys.exit(0)  # a normal exit runs atexit, and with it hvd's exit handler
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read().splitlines()
    # (It ran hvd's exit handler, which shut down the parent's engine from the child and
    # hung there. Its exit status is torch's: a forked child of a process with Gloo groups
    # may crash in their destructors as the interpreter ends, with or without hvd.)
    os.waitpid(pid, 0)
    checks.expect("forked child rank", said[:1] == [f"rank={hvd.rank()}/2"], said)
    op = said[1] if len(said) > 1 else ""
    checks.expect("forked child op refused", "forked from rank" in op, op)
    init = said[2] if len(said) > 2 else ""
    checks.expect("forked child init refused", "cannot join the job" in init, init)
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after_fork")
    checks.equal("op after the child exited", out, torch.full((2,), 2.0))


def child_process_init(checks: Checks) -> None:
    """A child started with the worker's environment must not register for its slot."""
    code = "import collectives.torch as hvd; hvd.init()"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    checks.expect("child init fails", child.returncode != 0, child.returncode)
    checks.expect("child init says why", "cannot join the job" in child.stderr, child.stderr)


def main() -> None:
    hvd.init()
    checks = Checks()
    checks.run("dataloader", lambda: data_loader(checks))
    checks.run("forked child", lambda: forked_child(checks))
    checks.run("child process", lambda: child_process_init(checks))
    hvd.shutdown()
    checks.finish(int(os.environ["HVDRUN_RANK"]))


if __name__ == "__main__":
    main()
