"""Accelerate trains with its own DDP on 2 CPU processes; hvd's ops carry the metrics.

Started by ``accelerate launch --multi_gpu --num_processes 2`` (torchrun underneath);
``Accelerator(cpu=True)`` makes torch.distributed's default group (Gloo), and
``hvd.init()`` joins that job. Each step, each rank's loss averaged with ``hvd.allreduce``
must equal Accelerate's own ``reduce``, and ``hvd.allgather`` must return what
``accelerator.gather`` does; ``hvd.broadcast_object`` carries rank 0's summary. After
training, the ranks' weights must be identical (Accelerate's DDP kept them in step) and
Accelerate's group must outlive ``hvd.shutdown()``.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, say

import collectives.torch as hvd


def main() -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    hvd.init()
    say(
        f"ID rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
        f"cross={hvd.cross_rank()}/{hvd.cross_size()} host={socket.gethostname()}"
    )
    checks = Checks()
    checks.expect(
        "hvd places this process as Accelerate does",
        (hvd.rank(), hvd.size(), hvd.local_rank())
        == (accelerator.process_index, accelerator.num_processes, accelerator.local_process_index),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (inputs, targets) in enumerate(loader):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        local = loss.detach().reshape(1)
        average = hvd.allreduce(local, op=hvd.Average, name=f"loss.{step}")
        checks.close(
            f"step {step}: hvd.allreduce", average, accelerator.reduce(local, "mean"), 1e-6
        )
        gathered = hvd.allgather(local, name=f"losses.{step}")
        checks.equal(f"step {step}: hvd.allgather", gathered, accelerator.gather(local))
        checks.expect(f"step {step}: each rank its own data", gathered.unique().numel() == 2)
        summary = hvd.broadcast_object({"step": step, "from": hvd.rank(), "loss": local.item()})
        checks.expect(
            f"step {step}: broadcast_object",
            summary == {"step": step, "from": 0, "loss": gathered[0].item()},
            summary,
        )
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvd.allgather(weights.unsqueeze(0), name="weights")
    checks.expect(
        "Accelerate's DDP kept the weights identical",
        all(torch.equal(rows[0], row) for row in rows),
        rows,
    )
    rank = hvd.rank()
    hvd.shutdown()
    checks.expect("Accelerate's group outlives hvd.shutdown()", dist.is_initialized())
    accelerator.wait_for_everyone()
    checks.finish(rank)


if __name__ == "__main__":
    main()
