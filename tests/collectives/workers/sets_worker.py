"""Worker: a process set's ops never wait for a rank outside the set.

Run on 3 ranks. Rank 0 is not a member of the set {1, 2}; it stops itself (SIGSTOP) and is
continued (SIGCONT) by rank 1 only after the set's ops have completed. If an op on the set
needed rank 0 in any way (a global negotiation round, as before sets negotiated alone), it
could never complete while rank 0 is stopped, and the job would fail after the collectives'
timeout instead of printing ALL OK. Nothing here is timed.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from checks import Checks

import collectives.torch as hvd


def stopped(pid: int) -> bool:
    """Whether a process is stopped (state T in /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as file:
        return file.read().rpartition(")")[2].split()[0] in ("T", "t")


def main() -> None:
    torch.set_num_threads(1)
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert n == 3, "run on 3 ranks"
    pair = hvd.add_process_set([1, 2])
    pids = hvd.allgather_object(os.getpid())
    hvd.barrier()
    if r == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # continued by rank 1 once the set is done
    else:
        while not stopped(pids[0]):  # rank 0 stops itself right after the barrier
            time.sleep(0.01)
        hvd.barrier(process_set=pair)
        out = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=pair)
        c.equal("set.allreduce", out, torch.tensor([3.0]))
        gathered = hvd.allgather(torch.tensor([r]), process_set=pair)
        c.equal("set.allgather", gathered, torch.tensor([1, 2]))
        for step in range(10):  # repeated: the set's response cache and its lanes
            x = torch.full((4,), float(r + step))
            hvd.allreduce_(x, op=hvd.Sum, process_set=pair, name="repeat")
            c.equal(f"set.repeat.{step}", x, torch.full((4,), float(3 + 2 * step)))
        c.expect("set.while_rank0_stopped", stopped(pids[0]))
        hvd.barrier(process_set=pair)
        if r == 1:
            os.kill(pids[0], signal.SIGCONT)
    total = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="after")
    c.equal("global.after", total, torch.tensor([3.0]))
    c.expect("remove", hvd.remove_process_set(pair))
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
