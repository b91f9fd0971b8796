"""A worker for test_rendezvous_store.py: Gloo process groups bootstrapped through the rendezvous.

Usage: python rdzv_gloo_worker.py ADDR JOB_ID HOST LOCAL_RANK   (the secret on stdin)

Registers, then twice (generations 0 and 1, each with its own key prefix, the second after
destroy_process_group) builds the default Gloo group on a RendezvousStore, runs an all_reduce,
a broadcast_object_list and an all_reduce on a new_group subgroup, and prints one JSON line
with what it saw. Exits 0 on success.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

from rendezvous.client import RendezvousClient
from rendezvous.store import RendezvousStore


def run_generation(client: RendezvousClient, rank: int, size: int, generation: int) -> dict:
    timeout = datetime.timedelta(seconds=60)
    store = RendezvousStore(client, prefix=f"job/gen{generation}/", timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    try:
        total = torch.tensor([float(rank + 1)]) * (generation + 1)
        dist.all_reduce(total)

        objects: list[object] = [{"generation": generation, "from": rank}]
        dist.broadcast_object_list(objects, src=0)

        # every rank creates every group, in the same order
        evens = dist.new_group([r for r in range(size) if r % 2 == 0])
        odds = dist.new_group([r for r in range(size) if r % 2 == 1])
        mine = evens if rank % 2 == 0 else odds
        sub = torch.tensor([float(rank)])
        dist.all_reduce(sub, group=mine)
        sub_size = dist.get_world_size(group=mine)
        dist.barrier()
        return {
            "sum": total.item(),
            "broadcast": objects[0],
            "subgroup_sum": sub.item(),
            "subgroup_size": sub_size,
        }
    finally:
        dist.destroy_process_group()
        del store  # only now: the store must outlive its process group


def main() -> int:
    addr, job_id, host, local_rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    secret = sys.stdin.readline().strip()
    client = RendezvousClient(addr, secret, job_id)
    try:
        info = client.register(host, local_rank)
        generations = [run_generation(client, info.rank, info.size, g) for g in (0, 1)]
        client.barrier("workers-done", info.size, timeout=60)
        print(json.dumps({"rank": info.rank, "size": info.size, "generations": generations}))
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
