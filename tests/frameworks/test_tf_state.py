"""Elastic state of the TensorFlow frontend in a job of size 1: ``TensorFlowState`` and
``TensorFlowKerasState`` keep the values of the last commit, give them back on restore and
keep them through a sync, a Keras model built at its first batch included (Keras 3's
``KerasState`` too). One process of its own (TensorFlow stays out of pytest's)."""

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

    # A model built at its first batch (Horovod's elastic Keras example): the state made
    # before fit leaves the optimizer unbuilt; its sync, commit and restore cover the
    # model's and the optimizer's variables once they exist.
    import collectives.keras as hvd_keras
    x, y = np.ones((8, 3), np.float32), np.ones((8, 1), np.float32)
    for make in (TensorFlowKerasState, hvd_keras.elastic.KerasState):
        model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        state = make(model, batch=0, epoch=0)
        state.sync()
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        state.restore()  # (variables created since the commit stay as they are)
        synced = []
        state._broadcast_variables = synced.extend
        state.sync()  # (a sync ends with a commit)
        every = list(model.variables) + list(model.optimizer.variables)
        assert len(every) > 6 and [id(v) for v in synced] == [id(v) for v in every], synced
        committed = [keras.ops.convert_to_numpy(v).copy() for v in every]
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        trained = [keras.ops.convert_to_numpy(v).copy() for v in every]
        state.restore()
        now = [keras.ops.convert_to_numpy(v) for v in every]
        assert all(np.array_equal(a, b) for a, b in zip(now, committed)), make
        changed = [not np.array_equal(a, b) for a, b in zip(trained, committed)]
        assert changed[:5] == [True] * 5 and changed[6:] == [True] * 8, changed  # (not lr)

    # A state made before model.compile covers the optimizer compile gives the model.
    for make in (TensorFlowKerasState, hvd_keras.elastic.KerasState):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        state = make(model, epoch=0)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        state.commit()
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
        state.restore()
        steps = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        assert state.optimizer is model.optimizer and steps == 2, (make, steps)
    hvd.shutdown()
    print("STATE OK")
    """
)


def test_tensorflow_states_commit_restore_and_sync() -> None:
    run_alone(SCRIPT, "STATE OK")
