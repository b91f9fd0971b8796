"""Data-parallel training of a small MLP on scikit-learn's bundled digits data set.

Run it alone (``python examples/pytorch_digits.py``) or on several processes
(``hvdrun -np 2 python examples/pytorch_digits.py``): each process trains on its shard of the
training set, ``hvd.DistributedOptimizer`` averages the gradients while the backward pass
runs, ``hvd.SyncBatchNorm`` normalises over the whole job's batch, and rank 0 reports the
loss and the test accuracy averaged over all ranks. The data ships with scikit-learn, so
nothing is downloaded.

Horovod's options are there too: ``--fp16-allreduce`` (gradients travel as float16),
``--use-adasum`` (Adasum instead of averaging), ``--batches-per-allreduce`` (gradient
accumulation) and ``--checkpoint`` (rank 0 saves after every epoch; a restart resumes from
it, every rank getting the weights, optimizer state and epoch from rank 0).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import collectives.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data split and model")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--use-adasum", action="store_true", help="combine gradients with Adasum")
    parser.add_argument(
        "--batches-per-allreduce",
        type=int,
        default=1,
        help="backward passes (of --batch-size samples) accumulated per allreduce",
    )
    parser.add_argument("--checkpoint", help="file to save to after every epoch and resume from")
    return parser.parse_args()


def load_data(seed: int) -> tuple[TensorDataset, TensorDataset]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    return TensorDataset(x_train, y_train), TensorDataset(x_test, y_test)


def metric_average(value: float, name: str) -> float:
    """The mean of a scalar over all ranks."""
    return float(hvd.allreduce(torch.tensor(value), name=name).item())


def evaluate(model: torch.nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Loss and accuracy on this rank's shard, averaged over all ranks."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            logits = model(x)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
            count += len(y)
    return (
        metric_average(loss_sum / max(count, 1), "test_loss"),
        metric_average(correct / max(count, 1), "test_accuracy"),
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    train_set, test_set = load_data(args.seed)
    train_sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed
    )
    test_sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    # One step takes batches_per_allreduce sub-batches, accumulated before the allreduce.
    step_batch = args.batch_size * args.batches_per_allreduce
    train_loader = DataLoader(train_set, batch_size=step_batch, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        hvd.SyncBatchNorm(128),  # statistics over every rank's batch
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    # Rank 0 alone reads the checkpoint; the others get the epoch, weights and state from it.
    saved = None
    if hvd.rank() == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
    resume = hvd.broadcast_object(
        {"epoch": saved["epoch"], "scheduler": saved["scheduler"]} if saved else None,
        root_rank=0,
        name="resume",
    )
    # Every rank starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=args.batches_per_allreduce,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )
    # Annealing the learning rate to zero makes the last epochs' accuracy stable. (LR
    # schedulers go on the wrapped optimizer, whose step() they count.)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    first_epoch = 1
    if resume is not None:
        scheduler.load_state_dict(resume["scheduler"])
        first_epoch = resume["epoch"] + 1
        if hvd.rank() == 0:
            print(f"resuming from {args.checkpoint} after epoch {first_epoch - 1}", flush=True)

    accuracy = 0.0
    seen = 0
    for epoch in range(first_epoch, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        loss_sum, batches = 0.0, 0
        for x, y in train_loader:
            optimizer.zero_grad()
            # A short last batch may hold fewer sub-batches: always run exactly
            # batches_per_allreduce backward passes, so every rank reduces once per step.
            # (A sum, not a mean, so that an empty sub-batch adds 0 rather than NaN.)
            for part in torch.tensor_split(torch.arange(len(y)), args.batches_per_allreduce):
                loss = F.cross_entropy(model(x[part]), y[part], reduction="sum") / len(y)
                loss.backward()
                loss_sum += loss.item()
            optimizer.step()
            batches += 1
            seen += len(y)
        scheduler.step()
        if hvd.rank() == 0 and args.checkpoint:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "epoch": epoch,
                },
                args.checkpoint,
            )
        train_loss = metric_average(loss_sum / max(batches, 1), "train_loss")
        test_loss, accuracy = evaluate(model, test_loader)
        if hvd.rank() == 0:
            print(
                f"epoch {epoch:2d}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
                f"test accuracy {accuracy:.4f}",
                flush=True,
            )
    per_rank = hvd.allgather_object(seen, name="samples_per_rank")
    if hvd.rank() == 0:
        elapsed = time.perf_counter() - started
        print(f"trained on {hvd.size()} process(es) in {elapsed:.1f} s", flush=True)
        print(f"training samples per rank: {per_rank}", flush=True)
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
