"""Data-parallel training with TensorFlow 2 and a custom loop on scikit-learn's digits.

Run it alone (``python examples/tensorflow2_digits.py``) or on several processes
(``hvdrun -np 2 python examples/tensorflow2_digits.py``). Each process trains on its shard of
the training set inside a ``tf.function``; ``hvd.DistributedGradientTape`` averages the
gradients over all processes, ``hvd.broadcast_variables`` starts every process from rank 0's
weights (and, after the first step, its optimizer state), and rank 0 reports the loss and
the test accuracy averaged over all ranks. Moving from Horovod is the import line:
``import horovod.tensorflow as hvd`` becomes ``import collectives.tensorflow as hvd``.

``--fp16-allreduce`` sends the gradients as float16. The data ships with scikit-learn, so
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import collectives.tensorflow as hvd


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    parser.add_argument("--lr", type=float, default=0.001, help="Adam learning rate (per rank)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data split and model")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    return parser.parse_args()


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=seed, stratify=y
    )
    return x_train, x_test, y_train, y_test


def metric_average(value: float, name: str) -> float:
    """The mean of a scalar over all ranks."""
    return float(hvd.allreduce(tf.constant(value), name=name).numpy())


def main() -> None:
    args = parse_args()
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    tf.random.set_seed(args.seed + hvd.rank())  # rank 0's weights win: see the broadcast
    started = time.perf_counter()

    x_train, x_test, y_train, y_test = load_data(args.seed)
    # This rank's shards: every size()-th sample.
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shard(hvd.size(), hvd.rank())
        .shuffle(len(x_train), seed=args.seed)
        .batch(args.batch_size)
    )
    x_test, y_test = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]

    model = tf.keras.Sequential(
        [
            tf.keras.Input((64,)),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Horovod's advice: scale the learning rate by the number of processes.
    optimizer = tf.keras.optimizers.Adam(args.lr * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor, first: bool) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        # The tape averages the gradients over every rank before they are returned.
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        # After the first step (which builds the optimizer's slots) every rank takes rank 0's
        # weights and optimizer state.
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)
        return loss

    accuracy = 0.0
    first = True
    for epoch in range(1, args.epochs + 1):
        loss_sum, batches = 0.0, 0
        for x, y in train:
            loss_sum += float(train_step(x, y, first))  # (a Python bool: two traces)
            first = False
            batches += 1
        logits = model(x_test, training=False)
        test_loss = metric_average(float(loss_fn(y_test, logits)), "test_loss")
        correct = np.mean(np.argmax(logits.numpy(), axis=1) == y_test)
        accuracy = metric_average(float(correct), "test_accuracy")
        train_loss = metric_average(loss_sum / max(batches, 1), "train_loss")
        if hvd.rank() == 0:
            print(
                f"epoch {epoch:2d}: train loss {train_loss:.4f}, test loss {test_loss:.4f}, "
                f"test accuracy {accuracy:.4f}",
                flush=True,
            )
    # Every rank holds the same weights: compare a checksum.
    checksum = float(sum(float(tf.reduce_sum(v)) for v in model.trainable_variables))
    checksums = hvd.allgather_object(checksum, name="checksums")
    if hvd.rank() == 0:
        elapsed = time.perf_counter() - started
        print(f"trained on {hvd.size()} process(es) in {elapsed:.1f} s", flush=True)
        print(f"weights identical on every rank: {len(set(checksums)) == 1}", flush=True)
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
