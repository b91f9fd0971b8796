"""Mix-ups of the two Kerases, and of a saved model with this frontend's own layer: each
is refused or handled at once, where it used to train each rank alone without a word, or
fail far from its cause."""

from __future__ import annotations

from tests.frameworks.conftest import run_alone

OTHER_KERAS = """
import os
if os.environ.get("LEGACY"):
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
import keras, tf_keras
import collectives.tensorflow.keras as hvd
import collectives.tensorflow as hvd_tf
hvd.init()
other = keras if os.environ.get("LEGACY") else tf_keras
for make in (hvd.DistributedOptimizer, hvd_tf.DistributedOptimizer):
    try:
        make(other.optimizers.SGD(0.1))
        raise SystemExit("no error")
    except ValueError as error:
        print("refused:", error)
print("mixups-ok")
"""


def test_an_optimizer_of_the_other_keras_is_refused() -> None:
    """A tf_keras optimizer where Keras 3 is served (and the reverse) would train without
    its gradients ever being reduced: the hooks set are the served Keras's."""
    run_alone(OTHER_KERAS, "mixups-ok")
    run_alone("import os; os.environ['LEGACY'] = '1'\n" + OTHER_KERAS, "mixups-ok")


SAVED_SYNC_BN = """
import tempfile, keras
import collectives.keras as hvd
hvd.init()
model = keras.Sequential([keras.Input((3,)), hvd.SyncBatchNormalization(), keras.layers.Dense(1)])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
path = tempfile.mkdtemp() + "/m.keras"
model.save(path)
loaded = hvd.load_model(path)  # (no custom_objects)
assert type(loaded.layers[0]).__name__ == "SyncBatchNormalization", loaded.layers
assert getattr(loaded.optimizer, "_hvd_distributed", False)
print("load-ok")
"""


def test_load_model_knows_sync_batch_normalization() -> None:
    run_alone(SAVED_SYNC_BN, "load-ok")
