"""A plain ``torch.distributed`` DDP script (no hvdrun import): runs under hvdrun as under torchrun.

``hvdrun -np 2 python examples/pytorch_ddp.py`` (or ``-H a:2,b:2``, or inside a Slurm
allocation): every worker gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` (an address of rank 0's host that the other hosts route to) and ``MASTER_PORT``
(a port free there), so ``init_process_group`` with its default ``env://`` just works. It trains
a small MLP on scikit-learn's bundled digits data, each rank on its shard, and rank 0 prints the
test accuracy; every rank checks that its weights equal rank 0's at the end.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    # NCCL needs a GPU per process: with fewer GPUs than processes on a host, train on the
    # CPU with Gloo instead.
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= local_size else "gloo"
    dist.init_process_group(backend)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    torch.manual_seed(42)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=42)
    train = TensorDataset(x_train, y_train)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train, num_replicas=size, rank=rank, seed=42
    )
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
    ).to(device)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(data.to(device)), target.to(device))
            loss.backward()
            optimizer.step()

    with torch.no_grad():
        correct = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = weights.clone()
    dist.broadcast(reference, src=0)
    in_sync = bool(torch.equal(weights, reference))
    if rank == 0:
        print(f"ddp: {size} ranks, test accuracy {correct.item():.3f}", flush=True)
    print(f"ddp rank {rank}: weights equal rank 0's: {in_sync}", flush=True)
    # DDP holds the process group in reference cycles: free it first, so that destroying the
    # group really ends it now and not during the interpreter's shutdown (where tearing down
    # Gloo's threads can abort the process).
    del ddp, optimizer
    gc.collect()
    dist.destroy_process_group()
    if not in_sync:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
