"""Worker for a job whose script makes torch.distributed's default group before ``hvd.init()``
(as Lightning, Accelerate and Ray Train do): ``hvd.init()`` must join that job.

Started by torchrun or with a RANK/WORLD_SIZE/MASTER_ADDR environment. Prints its identity as
``ID rank=R size=S local=L/LS cross=C/CS host=H`` and checks, on every rank: hvd's ops with
real values, interleaved with collectives on the script's own default group (one of them
while an hvd op is in flight); after ``hvd.shutdown()`` the default group is still there and
works; ``hvd.init()`` joins it again.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, say

import collectives.torch as hvd


def framework_sum(value: float) -> float:
    """An allreduce on the script's default group, as a framework's DDP would run."""
    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return tensor.item()


def joined(checks: Checks) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    checks.expect("rank and size of the group", (hvd.rank(), hvd.size()) == (rank, size))
    ranks_sum = float(sum(range(size)))
    for step in range(3):
        summed = hvd.allreduce(torch.tensor([rank + step * 1.0]), op=hvd.Sum, name=f"s{step}")
        checks.equal(f"hvd allreduce {step}", summed, torch.tensor([ranks_sum + size * step]))
        mine = framework_sum(rank * 10.0 + step)
        checks.expect(f"group allreduce {step}", mine == 10 * ranks_sum + size * step, mine)
    handle = hvd.allreduce_async(torch.tensor([2.0 * rank]), op=hvd.Sum, name="in-flight")
    during = framework_sum(1.0)
    checks.equal("hvd op in flight", hvd.synchronize(handle), torch.tensor([2.0 * ranks_sum]))
    checks.expect("group op meanwhile", during == size, during)
    metrics = hvd.broadcast_object({"rank": rank, "loss": 0.5 * rank}, root_rank=size - 1)
    checks.expect("broadcast_object", metrics == {"rank": size - 1, "loss": 0.5 * (size - 1)})
    gathered = hvd.allgather(torch.tensor([[rank, rank * rank]]), name="gather")
    expected = torch.tensor([[r, r * r] for r in range(size)])
    checks.equal("allgather", gathered, expected)
    checks.expect("allgather_object", hvd.allgather_object(rank) == list(range(size)))


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hvd.init()
    say(
        f"ID rank={hvd.rank()} size={hvd.size()} local={hvd.local_rank()}/{hvd.local_size()} "
        f"cross={hvd.cross_rank()}/{hvd.cross_size()} host={socket.gethostname()}"
    )
    checks = Checks()
    checks.run("joined", lambda: joined(checks))
    hvd.shutdown()
    checks.expect("group kept after hvd.shutdown()", dist.is_initialized())
    size = dist.get_world_size()
    checks.run(
        "group works after hvd.shutdown()",
        lambda: checks.expect("group allreduce after", framework_sum(1.0) == size),
    )
    hvd.init()
    again = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="again")
    checks.equal("hvd.init() again", again, torch.tensor([float(size)]))
    hvd.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    checks.finish(rank)


if __name__ == "__main__":
    main()
