"""Worker: collectives.keras on tf_keras in TF1 graph mode (``disable_eager_execution``), the
way Horovod's older Keras scripts run: the callbacks and ``broadcast_global_variables`` must
act in the Keras session (an assignment built in a graph does nothing until it runs); an
elastic ``KerasState`` is refused (elastic mode needs eager execution)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))
from checks import Checks

import collectives.keras as hvd

keras = hvd._bridge.keras  # tf_keras


def main() -> None:
    tf.compat.v1.disable_eager_execution()
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    start = keras.initializers.Constant(float(r))  # every rank starts elsewhere
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, use_bias=False, kernel_initializer=start)]
    )
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(0.1)), loss="mse")
    x = np.full((4, 3), r + 1.0, "float32")
    y = np.ones((4, 1), "float32")
    # From rank 0's zeros, rank r's gradient is -2 (r + 1) per weight; one step of their mean.
    model.fit(
        x, y, batch_size=4, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
    )
    weights = hvd.allgather_object(model.get_weights()[0].ravel().tolist())
    want = 0.1 * sum(2 * (q + 1) for q in range(n)) / n
    c.expect("tf1.broadcast_callback", np.allclose(weights, want), (weights, want))

    warmup = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=2)
    history = model.fit(x, y, batch_size=4, verbose=0, callbacks=[warmup])
    rate = float(history.history["lr"][0])
    c.expect("tf1.warmup_callback", np.isclose(rate, 0.1 / n * ((n - 1) / 2 + 1)), rate)

    kernel = model.layers[0].kernel
    keras.backend.set_value(kernel, np.full((3, 1), float(r + 5), "float32"))
    hvd.broadcast_global_variables(0)
    got = keras.backend.get_value(kernel).ravel().tolist()
    c.expect("tf1.broadcast_global_variables", got == [5.0] * 3, got)
    try:  # (elastic mode needs eager execution)
        hvd.elastic.KerasState(model, epoch=0)
        refused = ""
    except ValueError as error:
        refused = str(error)
    c.expect("tf1.elastic_state_refused", "needs eager execution" in refused, refused)

    # backward_passes_per_step: the sums it keeps are variables the Keras session initializes.
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    optimizer = keras.optimizers.legacy.SGD(0.1)
    model.compile(
        optimizer=hvd.DistributedOptimizer(optimizer, backward_passes_per_step=2), loss="mse"
    )
    model.fit(x, y, batch_size=2, verbose=0)  # (two passes: one step of their summed gradients)
    got = model.get_weights()[0].ravel().tolist()
    want = 0.1 * sum(4 * (q + 1) for q in range(n)) / n
    c.expect("tf1.accumulation", np.allclose(got, want), (got, want))
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
