"""Data-parallel ``model.fit`` with Keras on scikit-learn's digits (TensorFlow or torch backend).

Run it alone (``python examples/keras_digits.py``) or on several processes
(``hvdrun -np 2 python examples/keras_digits.py``); pick Keras 3's backend with
``KERAS_BACKEND=tensorflow`` (the default) or ``KERAS_BACKEND=torch``, or Keras 2 with
``TF_USE_LEGACY_KERAS=1`` (tf_keras). Each process fits on its shard of the training set:

- ``hvd.DistributedOptimizer`` averages the gradients over all processes,
- ``BroadcastGlobalVariablesCallback(0)`` starts every process from rank 0's weights and
  optimizer state,
- ``MetricAverageCallback`` makes the logged metrics the average over all ranks,
- ``LearningRateWarmupCallback`` ramps the learning rate up to ``size()`` times the base rate
  over the first epochs (the large-batch recipe of "Accurate, Large Minibatch SGD"),

and rank 0 alone prints progress and saves the model. Moving from Horovod is the import
line: ``import horovod.keras as hvd`` (or ``horovod.tensorflow.keras``) becomes
``import collectives.keras as hvd``. The data ships with scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import collectives.keras as hvd

# The Keras in use: Keras 3, or Keras 2 (tf_keras) with TF_USE_LEGACY_KERAS=1.
if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tf_keras as keras
else:
    import keras


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    parser.add_argument("--lr", type=float, default=0.001, help="Adam learning rate (per rank)")
    parser.add_argument("--warmup-epochs", type=int, default=2, help="epochs of the warmup")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data split and model")
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--save", help="rank 0 saves the trained model here (e.g. model.keras)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())  # rank 0's weights win: broadcast
    started = time.perf_counter()

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=args.seed, stratify=y
    )
    # This rank's shards: every size()-th sample.
    x_train, y_train = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    x_test, y_test = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]

    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    # Horovod's advice: scale the learning rate by the number of processes (the warmup
    # callback ramps up to it).
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.Adam(args.lr * hvd.size()),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    steps_per_epoch = int(np.ceil(len(x_train) / args.batch_size))
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=args.lr * hvd.size(),
            warmup_epochs=args.warmup_epochs,
            steps_per_epoch=steps_per_epoch,
            verbose=1 if hvd.rank() == 0 else 0,
        ),
    ]
    model.fit(
        x_train,
        y_train,
        batch_size=args.batch_size,
        epochs=args.epochs,
        callbacks=callbacks,
        validation_data=(x_test, y_test),
        verbose=2 if hvd.rank() == 0 else 0,
    )
    # The evaluation on each rank's test shard, averaged over the ranks.
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    accuracy = float(hvd.allreduce(float(accuracy), name="test_accuracy"))
    weights = np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])
    checksums = hvd.allgather_object(float(weights.sum()), name="checksums")
    if hvd.rank() == 0:
        elapsed = time.perf_counter() - started
        print(f"keras: {hvd.backend()}", flush=True)
        print(f"trained on {hvd.size()} process(es) in {elapsed:.1f} s", flush=True)
        print(f"weights identical on every rank: {len(set(checksums)) == 1}", flush=True)
        print(f"final test accuracy: {accuracy:.4f}", flush=True)
        if args.save:
            model.save(args.save)
            print(f"saved to {args.save} (hvd.load_model reads it back)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
