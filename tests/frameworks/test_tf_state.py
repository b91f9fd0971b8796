"""Elastic state of the TensorFlow frontend in a job of size 1: ``TensorFlowState`` and
``TensorFlowKerasState`` keep the values of the last commit, give them back on restore and
keep them through a sync. One process of its own (TensorFlow stays out of pytest's)."""

from __future__ import annotations

import textwrap

from tests.frameworks.conftest import run_alone

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import tensorflow as tf
    import collectives.tensorflow as hvd
    from collectives.tensorflow.elastic import TensorFlowKerasState, TensorFlowState

    hvd.init()
    v = tf.Variable([1.0, 2.0])
    state = TensorFlowState([v], epoch=3)
    v.assign([5.0, 6.0]); state.epoch = 4
    state.restore()
    assert np.array_equal(v.numpy(), [1.0, 2.0]) and state.epoch == 3, (v.numpy(), state.epoch)
    v.assign([7.0, 8.0]); state.epoch = 5
    state.commit()
    v.assign([0.0, 0.0]); state.epoch = 0
    state.restore()
    assert np.array_equal(v.numpy(), [7.0, 8.0]) and state.epoch == 5, (v.numpy(), state.epoch)
    state.sync()
    assert np.array_equal(v.numpy(), [7.0, 8.0])

    import keras
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    keras_state = TensorFlowKerasState(model, batch=0)
    before = [w.copy() for w in model.get_weights()]
    model.fit(np.ones((4, 3)), np.zeros((4, 2)), epochs=1, verbose=0)
    assert not np.array_equal(model.get_weights()[0], before[0])
    keras_state.restore()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    hvd.shutdown()
    print("STATE OK")
    """
)


def test_tensorflow_states_commit_restore_and_sync() -> None:
    run_alone(SCRIPT, "STATE OK")
