"""Worker for jobs another launcher started (srun, mpirun, torchrun, Kubernetes-style env).

Prints its identity as ``ID rank=R size=S local=L/LS cross=C/CS host=H`` and checks the job
works as one: allreduce, allgather and broadcast values, and a DistributedOptimizer step that
leaves identical parameters on every rank (each rank trains on its own data).

``die``: rank 1 SIGKILLs itself after init; the others' next allreduce must fail with
HorovodInternalError (printed as ``PEER LOST: ...``), and they exit 3.

``fail-connect``: rank 1's process group set-up raises, as a CUDA or NCCL error would,
after it joined; it exits 5, and the others' ``hvd.init()`` must fail naming it.

``late R``: rank R (the launcher's ``RANK`` or ``OMPI_COMM_WORLD_RANK``) sleeps 60 s
instead of calling ``hvd.init()``; the others' ``hvd.init()`` must give up.

``reinit``: three rounds of ``init()``, an allreduce and ``shutdown()``, back to back (rank 0
serves each round's rendezvous until the others left it); prints ``ROUND i rank r sum s``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, say

import collectives.torch as hvd


def identity() -> str:
    return (
        f"ID rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
        f"cross={hvd.cross_rank()}/{hvd.cross_size()} host={socket.gethostname()}"
    )


def train_step(checks: Checks) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    generator = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own data
    for _ in range(3):
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=generator)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="params")
    checks.expect(
        "optimizer step identical on every rank",
        all(torch.equal(gathered[0], row) for row in gathered),
        gathered,
    )
    moved = not torch.equal(
        flat, torch.cat([p.reshape(-1) for p in torch.nn.Linear(4, 2).parameters()])
    )
    checks.expect("optimizer trained", moved)


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1] if len(sys.argv) > 1 else "check"
    if mode == "reinit":
        for round_ in range(3):
            hvd.init()
            total = hvd.allreduce(torch.tensor([float(hvd.rank() + round_)]), op=hvd.Sum)
            say(f"ROUND {round_} rank {hvd.rank()} sum {total.item():g}")
            hvd.shutdown()
        return
    started = time.monotonic()
    launcher_rank = os.environ.get("RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    if mode == "late" and launcher_rank == sys.argv[2]:
        time.sleep(60)
        return
    if mode == "fail-connect":
        if os.environ.get("RANK") == "1":

            def broken(*args: object, **kwargs: object) -> None:
                raise RuntimeError("NCCL error: unhandled cuda error (simulated)")

            torch.distributed.init_process_group = broken  # type: ignore[assignment]
        try:
            hvd.init()
        except RuntimeError as error:
            say(f"INIT FAILED after {time.monotonic() - started:.1f} s: {error}")
            sys.exit(5)
        say("INIT SUCCEEDED")
        return
    hvd.init()
    say(f"{identity()} init_seconds={time.monotonic() - started:.3f}")
    rank, size = hvd.rank(), hvd.size()
    if mode == "die":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)
        try:
            for step in range(200):
                hvd.allreduce(torch.ones(4), name=f"after-death.{step}")
                time.sleep(0.05)
        except hvd.HorovodInternalError as error:
            say(f"PEER LOST: {error}")
            sys.exit(3)
        say("NO ERROR after a peer died")
        sys.exit(4)
    checks = Checks()
    summed = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, name="sum")
    checks.equal("allreduce", summed, torch.tensor([float(sum(range(size)))]))
    gathered = hvd.allgather(torch.tensor([rank]), name="gather")
    checks.equal("allgather", gathered, torch.arange(size))
    value = torch.tensor([rank * 10.0])
    hvd.broadcast_(value, root_rank=size - 1, name="bcast")
    checks.equal("broadcast", value, torch.tensor([(size - 1) * 10.0]))
    checks.run("training", lambda: train_step(checks))
    hvd.shutdown()
    checks.finish(rank)


if __name__ == "__main__":
    main()
