"""The digits example (pytorch_digits.py) as an elastic job: hosts may fail, join or leave.

Run it with a discovery script that lists the usable hosts::

    hvdrun -np 2 --min-np 1 --max-np 4 \\
        --host-discovery-script examples/elastic_discovery.sh \\
        python examples/pytorch_elastic_digits.py

Everything that must survive a reset lives in one ``elastic.TorchState``: the model, the
optimizer, the sampler (which knows which samples of the epoch are done) and the epoch. The
state is committed every ``--batches-per-commit`` batches; when a host dies the survivors
roll back to the last commit, when hosts join or leave everyone switches at the next commit,
and either way training goes on with the new number of workers from where it was.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import collectives.torch as hvd
from collectives.torch import elastic


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data split and model")
    parser.add_argument(
        "--batches-per-commit", type=int, default=5, help="how often the state is committed"
    )
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


def evaluate(model: torch.nn.Module, test_set: TensorDataset) -> float:
    """Test accuracy over this rank's shard, averaged over all ranks."""
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        test_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False
    )
    model.eval()
    correct, count = 0, 0
    with torch.no_grad():
        for x, y in DataLoader(test_set, batch_size=256, sampler=sampler):
            correct += int((model(x).argmax(dim=1) == y).sum())
            count += len(y)
    return metric_average(correct / max(count, 1), "test_accuracy")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    train_set, test_set = load_data(args.seed)
    # Splits the epoch's remaining samples over however many workers there are.
    sampler = elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=args.lr),
        named_parameters=model.named_parameters(),
    )
    # The first sync (inside elastic.run) gives every rank rank 0's weights and state.
    state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=1)
    state.register_reset_callbacks(
        [lambda: print(f"rank {hvd.rank()}: now {hvd.size()} worker(s)", flush=True)]
    )

    @elastic.run
    def train(state: elastic.TorchState) -> float:
        accuracy = 0.0
        while state.epoch <= args.epochs:
            model.train()
            loss_sum, batches = 0.0, 0
            # After a reset the loader yields this rank's share of what is left of the epoch.
            for batch_idx, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                sampler.record_batch(batch_idx, args.batch_size)
                loss_sum += loss.item()
                batches += 1
                if (batch_idx + 1) % args.batches_per_commit == 0:
                    state.commit()
            train_loss = metric_average(loss_sum / max(batches, 1), "train_loss")
            accuracy = evaluate(model, test_set)
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch:2d} on {hvd.size()} worker(s): train loss "
                    f"{train_loss:.4f}, test accuracy {accuracy:.4f}",
                    flush=True,
                )
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
        return accuracy

    accuracy = train(state)
    if hvd.rank() == 0:
        elapsed = time.perf_counter() - started
        print(f"trained in {elapsed:.1f} s; final test accuracy: {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
