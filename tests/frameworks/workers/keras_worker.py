"""Worker: collectives.keras with ``model.fit`` on the Keras in use (Keras 3 on
``KERAS_BACKEND``, or tf_keras with ``TF_USE_LEGACY_KERAS=1``).

Every rank starts from different weights and trains on its own shard: after ``fit`` with
the broadcast callback and the distributed optimizer every rank must hold identical
weights, the logged metrics must be the ranks' average, and the warmup callback must set
the learning rates Horovod's formula gives. Then: the ops on values, ``backward_passes_per_step``
(one update from two accumulated steps, summed or averaged), a model in torch's
DistributedDataParallel (its gradients not reduced twice), ``load_model``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))
from checks import Checks

import collectives.keras as hvd

keras = hvd._bridge.keras  # (tf_keras or keras)


def weights_of(model: object) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])  # type: ignore[attr-defined]


def main() -> None:
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    print(f"keras: {hvd.backend()}", flush=True)
    keras.utils.set_random_seed(100 + r)  # every rank starts from other weights
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * n, 8)).astype("float32")
    y = (x.sum(1) > 0).astype("int32")
    shard = slice(r * 64, (r + 1) * 64)

    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    base_lr = 0.01
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(base_lr * n, momentum=0.9))
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(base_lr * n, warmup_epochs=2, steps_per_epoch=4),
    ]
    history = model.fit(x[shard], y[shard], batch_size=16, epochs=3, callbacks=callbacks, verbose=0)
    weights = hvd.allgather_object(weights_of(model))
    c.expect("fit.identical_weights", all(np.array_equal(weights[0], w) for w in weights))
    losses = [float(v) for v in history.history["loss"]]
    every = hvd.allgather_object(losses)
    c.expect("fit.metrics_averaged", all(np.allclose(every[0], other) for other in every), every)
    # the warmup: lr(epoch e, last batch) = initial/size * ((e + 1) * (size - 1) / 2 + 1)
    lrs = [float(v) for v in history.history["lr"]]
    want = [base_lr * n / n * (min(e + 1, 2) * (n - 1) / 2 + 1) for e in range(3)]
    want[2] = lrs[1]  # after the warmup the rate stays where the warmup left it
    c.expect("fit.warmup_rates", np.allclose(lrs, want, rtol=1e-5), (lrs, want))

    # ops on values: numbers, numpy arrays
    c.expect("ops.allreduce_number", np.isclose(hvd.allreduce(float(r), op=hvd.Sum), sum(range(n))))
    gathered = hvd.allgather(np.full((r + 1,), r, np.int32))
    c.expect(
        "ops.allgather", list(gathered) == [q for q in range(n) for _ in range(q + 1)], gathered
    )
    c.expect("ops.broadcast", hvd.broadcast(np.arange(3) + r, n - 1).tolist() == [n - 1, n, n + 1])

    # backward_passes_per_step=2: one update from the two accumulated steps, on every rank
    if not hvd._bridge.legacy:
        for average in (False, True):
            dense = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
            dense.layers[0].set_weights([np.zeros((1, 1), np.float32)])
            accumulating = hvd.DistributedOptimizer(
                keras.optimizers.SGD(1.0),
                backward_passes_per_step=2,
                average_aggregated_gradients=average,
            )
            dense.compile(accumulating, "mse")
            # gradient of mean((w*x - t)^2) at w=0 is -2*x*t: rank-dependent targets
            xs = np.ones((2, 1), np.float32)
            ts = np.full((2, 1), float(r + 1), np.float32)
            dense.fit(xs, ts, batch_size=1, epochs=1, shuffle=False, verbose=0)
            mean_grad = -2.0 * np.mean([q + 1 for q in range(n)])
            step = mean_grad * (1 if average else 2)
            got = float(np.asarray(dense.get_weights()[0]).ravel()[0])
            c.expect(f"accumulate.average={average}", np.isclose(got, -step, rtol=1e-5), got)

    # a model that torch's DistributedDataParallel wraps (Keras's recipe on torch): its
    # gradients arrive averaged over the ranks and are not reduced again (op=Sum would show)
    if hvd._bridge.is_torch:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        inner = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
        inner.layers[0].set_weights([np.zeros((1, 1), np.float32)])
        ddp = DistributedDataParallel(inner)
        plain = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
        ddp(torch.full((1, 1), float(r + 1))).mean().backward()  # d/dw = r + 1
        plain.apply([v.value.grad for v in inner.trainable_variables], inner.trainable_variables)
        got = float(np.asarray(inner.get_weights()[0]).ravel()[0])
        c.expect("ddp.not_reduced_twice", np.isclose(got, -(n + 1) / 2), got)

    # load_model wraps the loaded model's optimizer
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras" if not hvd._bridge.legacy else "model.h5")
        model.save(path)
        loaded = hvd.load_model(path)
        c.expect("load_model.distributed", getattr(loaded.optimizer, "_hvd_distributed", False))
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
