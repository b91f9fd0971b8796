"""The worker side of bench/tensorflow_keras.py's Keras table: one process of a 2-process
``model.fit`` on scikit-learn's digits (Dense 128 relu, Dense 10; Adam), 32 samples per
process and step.

``--mode hvd`` runs under ``hvdrun -np 2`` with ``collectives.keras`` (Keras 3 on
``KERAS_BACKEND``, or tf_keras with ``TF_USE_LEGACY_KERAS=1``): each process fits its half
of the data, ``hvd.DistributedOptimizer`` averages the gradients, the broadcast and metric
callbacks as in the example.
``--mode mwms`` is TensorFlow's own way, ``tf.distribute.MultiWorkerMirroredStrategy``
(its collective all-reduce), with ``TF_CONFIG`` set by the caller: the model is built in the
strategy's scope and ``fit`` gets the whole data at the global batch of 64, which the
strategy splits into 32 per process. (Keras 3.15's ``fit`` fails under this strategy: its
first step reduces a batch of per-worker values, which the strategy refuses; run it on
tf_keras, Keras 2, which TensorFlow's own guides for the strategy use.)

The first epoch (tracing, the first collectives) is left out: the steps of the others and
their time give steps per second. The first process prints ``RESULT <steps per second>``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from sklearn.datasets import load_digits

if os.environ.get("TF_USE_LEGACY_KERAS") == "1":
    import tf_keras as keras
else:
    import keras

BATCH = 32  # per process and step


class Timer(keras.callbacks.Callback):
    """Steps and seconds of every epoch after the first."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.seconds = 0.0
        self.started = 0.0
        self.epoch = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch = epoch
        self.started = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.epoch > 0:
            self.steps += 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch > 0:
            self.seconds += time.perf_counter() - self.started


def build() -> Any:
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["hvd", "mwms"], required=True)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    timer = Timer()
    keras.utils.set_random_seed(0)
    if args.mode == "hvd":
        import collectives.keras as hvd

        hvd.init()
        first = hvd.rank() == 0
        model = build()
        model.compile(
            hvd.DistributedOptimizer(keras.optimizers.Adam(0.002)), loss, metrics=["accuracy"]
        )
        callbacks = [
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            timer,
        ]
        shard = slice(hvd.rank(), None, hvd.size())
        model.fit(
            x[shard], y[shard], batch_size=BATCH, epochs=args.epochs, callbacks=callbacks, verbose=0
        )
    else:
        import tensorflow as tf

        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        first = strategy.cluster_resolver.task_id == 0
        with strategy.scope():
            model = build()
            model.compile(keras.optimizers.Adam(0.002), loss, metrics=["accuracy"])
        # The whole data at the global batch; the strategy shards it by data and splits each
        # batch between the processes.
        workers = strategy.num_replicas_in_sync
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH * workers)
        model.fit(data, epochs=args.epochs, callbacks=[timer], verbose=0)
    if first:
        print(f"RESULT {timer.steps / timer.seconds:.3f} steps={timer.steps}", flush=True)


if __name__ == "__main__":
    main()
