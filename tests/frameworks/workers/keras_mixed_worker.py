"""Worker: mixed precision (``mixed_float16``) with ``hvd.DistributedOptimizer`` in
``model.fit``, where Keras wraps the optimizer in its LossScaleOptimizer.

Rank 1's first batch overflows float16 (its gradients are inf), rank 0's never does. As in
Horovod, where the gradients are reduced before the loss scale looks at them, every rank
must skip that step and halve its loss scale together, then train on: the job ends with the
same weights, loss scale and number of applied steps on every rank (without the agreement
rank 0 waited forever in its reduction of a step that rank 1 skipped).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))
from checks import Checks

import collectives.keras as hvd

keras = hvd._bridge.keras


def main() -> None:
    c = Checks()
    hvd.init()
    r = hvd.rank()
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    # (tf_keras's optimizers of TF 2.11 on, or its OptimizerV2 ones in optimizers.legacy)
    sgd = keras.optimizers.legacy.SGD if os.environ.get("OPTIMIZER_V2") else keras.optimizers.SGD
    inner = sgd(0.01)
    if os.environ.get("OWN_LOSS_SCALE"):  # (a LossScaleOptimizer made by the script, wrapped)
        inner = keras.mixed_precision.LossScaleOptimizer(inner)
    model.compile(hvd.DistributedOptimizer(inner), "mse")
    # (small values: no gradient overflows float16 at the initial scale 2**15 but rank 1's
    # first batch's)
    x = np.random.default_rng(r).normal(size=(32, 4)).astype("float32") * 0.01
    y = x.sum(1, keepdims=True)
    if r == 1:
        y[:8] = 6e4  # (float16's largest is 65504: this batch's loss is inf)
    model.fit(
        x,
        y,
        batch_size=8,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
    )
    optimizer = model.optimizer
    state = [
        np.concatenate([np.asarray(w, np.float64).ravel() for w in model.get_weights()]),
        float(np.asarray(optimizer.loss_scale if hvd._bridge.legacy else optimizer.dynamic_scale)),
        int(np.asarray(optimizer.inner_optimizer.iterations)),
    ]
    every = hvd.allgather_object(state)
    c.expect(
        "mixed.identical_weights",
        all(np.array_equal(every[0][0], other[0]) for other in every),
        every,
    )
    # (the scale starts at 2**15, is halved at every skipped step; of the 4 steps, tf_keras
    # counts the skipped one too)
    steps = 4 if hvd._bridge.legacy else 3
    c.expect("mixed.skipped_together", all(s[1:] == [2.0**14, steps] for s in every), every)
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
