"""Worker for the names of unnamed ops on 2 ranks (see test_unnamed_ops.py).

``refused``: issue 28's scenario. Rank 0 joins at once; rank 1 runs unnamed ops while it has
joined (an allreduce and a barrier that run, an allgather refused with the join error) and
an unnamed grouped allreduce refused on rank 1 alone (tensors on two devices), then joins.
Both ranks then run unnamed ops, which must match across ranks (their counters stayed in
step), and the object collectives, with None on the ranks that receive a broadcast.

``diverged`` (run last: it stops the job's collectives): rank 1's allgather counter moves on
by one (as an op refused on one rank only after drawing its counter used to do), so the
ranks' next unnamed allgathers are called ``allgather.noname.N`` on rank 0 and
``allgather.noname.N+1`` on rank 1. Each rank must get the stall inspector's error saying
that unnamed op counters diverged, within the stall check time the test sets, instead of
waiting forever.
"""

from __future__ import annotations

import functools
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd
from collectives import runtime
from collectives.engine.requests import Kind


def refused(c: Checks, r: int) -> None:
    if r == 0:
        last = hvd.join()
    else:
        alone = hvd.allreduce(torch.tensor([5.0]), op=hvd.Sum)  # rank 0 adds zeros
        c.equal("joined.allreduce", alone, torch.tensor([5.0]))
        hvd.barrier()  # passes: rank 0 has joined
        try:
            hvd.allgather(torch.ones(1))
            c.expect("joined.allgather_refused", False, "no error")
        except hvd.NotSupportedWithJoinError as error:
            c.expect("joined.allgather_refused", "allgather" in str(error), str(error))
        try:
            hvd.grouped_allreduce([torch.ones(1), torch.ones(1, device="meta")])
            c.expect("local.refused", False, "no error")
        except ValueError as error:
            c.expect("local.refused", "same device" in str(error), str(error))
        last = hvd.join()
    # Horovod's join returns the last rank to join, the same on every rank.
    lasts = hvd.allgather_object(last)
    c.expect("join.same_on_every_rank", lasts == [1, 1], lasts)
    # Unnamed ops after all that get the same names on both ranks, so they run.
    total = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum)
    c.equal("after.allreduce", total, torch.tensor([3.0]))
    gathered = hvd.allgather(torch.tensor([r * 10]))
    c.equal("after.allgather", gathered, torch.tensor([0, 10]))
    hvd.barrier()
    got = hvd.broadcast(torch.tensor([r + 7]), root_rank=1)
    c.equal("after.broadcast", got, torch.tensor([8]))
    # The object collectives' names do not depend on the object (None off the root).
    received = hvd.broadcast_object({"epoch": 3} if r == 1 else None, root_rank=1)
    c.expect("after.broadcast_object", received == {"epoch": 3}, received)
    everyone = hvd.allgather_object(r if r == 0 else float(r))  # an int and a float
    c.expect("after.allgather_object", everyone == [0, 1.0], everyone)


def diverged(c: Checks, r: int) -> None:
    if r == 1:
        runtime.engine("test").next_counter(Kind.ALLGATHER, 0)
    try:
        hvd.allgather(torch.ones(1))
        c.expect("diverged.raises", False, "no error")
    except hvd.HorovodInternalError as error:
        text = str(error)
        c.expect("diverged.raises", True)
        names = re.search(
            r"allgather 'noname\.(\d+)' .* waits for rank 1, which has already submitted "
            r"allgather 'noname\.(\d+)'",
            text,
        )
        c.expect(
            "diverged.message",
            "unnamed op counters diverged" in text
            and "name=" in text
            and names is not None
            and int(names[2]) == int(names[1]) + 1,
            text,
        )


def main() -> None:
    hvd.init()
    c = Checks()
    r = hvd.rank()
    for name in sys.argv[1:]:
        scenario = {"refused": refused, "diverged": diverged}[name]
        c.run(name, functools.partial(scenario, c, r))
    c.finish(r)


if __name__ == "__main__":
    main()
