"""BroadcastGlobalVariablesCallback with a model that has no weights before its first batch
(a Sequential without an input shape, as Horovod's Keras examples build it): training runs
and the broadcast covers the weights once they exist, on Keras 3 and on tf_keras."""

from __future__ import annotations

import pytest

from tests.frameworks.conftest import run_alone

SCRIPT = """
import numpy as np
import tensorflow as tf
import collectives.keras as hvd
from collectives.keras import callbacks

hvd.init()
sizes = []
broadcast = callbacks._bridge.broadcast_variables
def spy(variables, root_rank):
    sizes.append(len(variables))
    return broadcast(variables, root_rank)
callbacks._bridge.broadcast_variables = spy
model = tf.keras.Sequential([tf.keras.layers.Dense(4), tf.keras.layers.Dense(2)])
model.compile(loss="mse", optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), epochs=1, batch_size=4,
          verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
assert len(sizes) == 1 and sizes[0] >= len(model.variables) == 4, sizes
print("unbuilt-ok")
"""


@pytest.mark.parametrize("legacy", ["0", "1"], ids=["keras3", "tf_keras"])
def test_broadcast_callback_with_a_model_built_at_its_first_batch(
    legacy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", legacy)
    run_alone(SCRIPT, "unbuilt-ok")
