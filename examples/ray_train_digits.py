"""Horovod-style training inside Ray Train: ``TorchTrainer`` starts the workers, ``hvd.init()``
joins the job it made.

Ray Train's ``TorchTrainer`` places its workers and creates their ``torch.distributed``
process group before the training function runs; ``hvd.init()`` inside that function adopts
that group (rank and size from it, local rank from Ray's ``LOCAL_RANK``), so a training
function written for Horovod's ``HorovodTrainer`` -- ``hvd.DistributedOptimizer``,
``hvd.broadcast_parameters``, ``hvd.allreduce`` for metrics -- runs unchanged. Rank 0 reports
the metrics to Ray with a checkpoint of the model.

    python examples/ray_train_digits.py --num-workers 2 --epochs 5

It starts a local Ray instance unless one is running (``ray.init(address="auto")`` first to
use a cluster). The data (scikit-learn's digits) ships with scikit-learn.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
from typing import Any

import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import collectives.torch as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=int, default=2, help="Ray Train workers")
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data split and model")
    parser.add_argument("--storage-path", help="where Ray Train keeps results (default: a tmp dir)")
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
    """The mean of a scalar over all workers."""
    return float(hvd.allreduce(torch.tensor(value), name=name).item())


def weights_digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def train_func(config: dict[str, Any]) -> None:
    """Runs on every Ray Train worker, after Ray created the process group."""
    torch.set_num_threads(1)
    hvd.init()  # joins the process group TorchTrainer created
    context = ray.train.get_context()
    places = hvd.allgather_object(
        {
            "hvd": (hvd.rank(), hvd.size(), hvd.local_rank()),
            "ray": (context.get_world_rank(), context.get_world_size(), context.get_local_rank()),
        },
        name="places",
    )
    torch.manual_seed(config["seed"])
    train_set, test_set = load_data(config["seed"])
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=config["seed"]
    )
    loader = DataLoader(train_set, batch_size=config["batch_size"], sampler=sampler)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    for epoch in range(1, config["epochs"] + 1):
        model.train()
        sampler.set_epoch(epoch)
        loss_sum, batches = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item()
            batches += 1
        train_loss = metric_average(loss_sum / max(batches, 1), "train_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}", flush=True)

    # Every worker scores its half of the test set; hvd.allreduce averages the accuracies.
    model.eval()
    x_test, y_test = test_set.tensors
    mine = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        correct = (model(x_test[mine]).argmax(dim=1) == y_test[mine]).float().mean().item()
    accuracy = metric_average(correct, "test_accuracy")
    digests = hvd.allgather_object(weights_digest(model), name="weights")
    metrics = {
        "test_accuracy": accuracy,
        "train_loss": train_loss,
        "weights_identical": len(set(digests)) == 1,
        "places": places,
    }
    if hvd.rank() == 0:
        with tempfile.TemporaryDirectory() as directory:
            torch.save(model.state_dict(), f"{directory}/model.pt")
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
    else:
        ray.train.report(metrics)
    hvd.shutdown()  # hvd's own groups; Ray's process group stays Ray's to destroy


def main() -> None:
    args = parse_args()
    if not ray.is_initialized():
        ray.init()
    trainer = TorchTrainer(
        train_func,
        train_loop_config={
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
        },
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=False),
        run_config=RunConfig(
            name="ray_train_digits", storage_path=args.storage_path or tempfile.mkdtemp()
        ),
    )
    result = trainer.fit()
    metrics = result.metrics or {}
    for place in metrics.get("places", []):
        print(f"hvd (rank, size, local rank) {place['hvd']}, Ray Train's {place['ray']}")
    print(f"weights identical on every rank: {metrics.get('weights_identical')}")
    print(f"final test accuracy: {metrics.get('test_accuracy', 0.0):.4f}")


if __name__ == "__main__":
    main()
