"""Worker: tf_keras's ``hvd.DistributedOptimizer`` returns the gradients reduced over the
ranks from ``compute_gradients`` (and a legacy optimizer's ``_compute_gradients``), as
Horovod's does, and ``apply_gradients`` applies those without reducing them again; gradients
of a plain ``tf.GradientTape`` are reduced by ``apply_gradients``, once.

Each rank's gradient of ``sum(w * (rank + 1))`` is ``rank + 1`` in every element: their
average is ``(n + 1) / 2``, their sum (``op=hvd.Sum``, which shows a second reduction)
``n (n + 1) / 2``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))
from checks import Checks

import collectives.keras as hvd

keras = hvd._bridge.keras  # tf_keras


def gradients(optimizer: Any, w: tf.Variable, r: int, private: bool = False) -> Any:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(r + 1))
    if private:
        pairs = optimizer._compute_gradients(loss, [w], tape=tape)
    else:
        pairs = optimizer.compute_gradients(loss, [w], tape=tape)
    return pairs


def main() -> None:
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    mean, total = (n + 1) / 2, n * (n + 1) / 2

    # compute_gradients: reduced, the same on every rank, and applied as they are.
    w = tf.Variable(tf.zeros(3))
    summing = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
    pairs = gradients(summing, w, r)
    got = hvd.allgather_object(np.asarray(pairs[0][0]).tolist())
    c.expect("compute_gradients.reduced", np.allclose(got, total), got)
    summing.apply_gradients(pairs)
    c.expect("compute_gradients.applied_once", np.allclose(w.numpy(), -total), w.numpy())

    # A plain tape's gradients: reduced by apply_gradients, once.
    w.assign(tf.zeros(3))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * float(r + 1))
    summing.apply_gradients(zip(tape.gradient(loss, [w]), [w], strict=True))
    c.expect("plain_tape.reduced_once", np.allclose(w.numpy(), -total), w.numpy())

    # A legacy optimizer's: _compute_gradients (minimize's) and Horovod's compute_gradients.
    legacy = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(1.0))
    v = tf.Variable(tf.zeros(3))
    got = [np.asarray(gradients(legacy, v, r, private)[0][0]).tolist() for private in (True, False)]
    got = hvd.allgather_object(got)
    c.expect("legacy.compute_gradients.reduced", np.allclose(got, mean), got)

    # Inside tf.function, as model.fit runs it.
    step_w = tf.Variable(tf.zeros(3))
    stepper = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(step_w * float(r + 1))
        pairs = stepper.compute_gradients(loss, [step_w], tape=tape)
        stepper.apply_gradients(pairs)
        return pairs[0][0]

    seen = hvd.allgather_object(np.asarray(step()).tolist())
    ok = np.allclose(seen, total) and np.allclose(step_w.numpy(), -total)
    c.expect("tf_function.reduced_once", ok, (seen, step_w.numpy()))
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
