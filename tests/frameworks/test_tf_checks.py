"""Checks of the TensorFlow frontend that need no peers, in one job of size 1 (a process of
its own: TensorFlow stays out of pytest's): arguments refused where the tape or optimizer
is made; in an elastic job, averages in a traced ``tf.function`` divide by the size the job
has when the function runs; elastic states refused in TF1 graphs."""

from __future__ import annotations

import textwrap

from tests.frameworks.conftest import run_alone

SCRIPT = textwrap.dedent(
    """
    import keras
    import tensorflow as tf
    import collectives.tensorflow as hvd

    hvd.init()

    def refused(make, name="groups"):
        try:
            make()
        except ValueError as error:
            return str(error).startswith(f"{name} should be")
        return False

    # groups: None, a number above 0 or lists of variables, as Horovod accepts
    tape = tf.GradientTape()
    for bad in (0, -1, "2", 1.5):
        assert refused(lambda: hvd.DistributedGradientTape(tape, groups=bad)), bad
        assert refused(lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), groups=bad)), bad
        tf1 = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        assert refused(lambda: hvd.DistributedOptimizer(tf1, groups=bad)), bad
    assert refused(lambda: hvd.DistributedGradientTape(tape, num_groups=-2), "num_groups")
    hvd.DistributedGradientTape(tape, groups=2)
    hvd.DistributedGradientTape(tape, num_groups=0, groups=[[tf.Variable(1.0)]])
    hvd.DistributedOptimizer(keras.optimizers.SGD(), num_groups=3)
    import collectives.keras as hvd_keras  # (Keras's own DistributedOptimizer, too)
    assert refused(lambda: hvd_keras.DistributedOptimizer(keras.optimizers.SGD(), groups=0))
    print("groups-ok")

    # In an elastic job, a traced tf.function divides by the size when it runs (a reset may
    # change it): a sparse gradient's average and a local gradient's scaling.
    import numpy as np
    from collectives import runtime
    from collectives.tensorflow import mpi_ops

    @tf.function
    def sparse_average(values):
        rows = tf.IndexedSlices(values, tf.constant([0, 1]), tf.constant([4, 1], tf.int64))
        return hvd.allreduce(rows, op=hvd.Average).values

    w = tf.Variable([[2.0]])

    @tf.function
    def local_gradient():
        with tf.GradientTape() as raw:
            loss = tf.reduce_sum(w * 3.0)
        tape = hvd.DistributedGradientTape(raw)
        tape.register_local_source(w)
        return tape.gradient(loss, [w])[0]

    job, set_size = runtime.state.require(), mpi_ops._set_size
    job.elastic = True
    try:
        x = tf.constant([[4.0], [8.0]])
        assert np.allclose(sparse_average(x), [[4.0], [8.0]]) and np.allclose(local_gradient(), 3)
        mpi_ops._set_size = lambda process_set_id: 2  # (as if the job had grown to 2)
        got = (sparse_average(x).numpy(), local_gradient().numpy())
        assert np.allclose(got[0], [[2.0], [4.0]]) and np.allclose(got[1], 1.5), got
    finally:
        job.elastic, mpi_ops._set_size = False, set_size
    print("elastic-size-ok")

    # Elastic states need eager execution (TF1 sessions are not supported in elastic mode)
    from collectives.tensorflow.elastic import TensorFlowKerasState, TensorFlowState
    with tf.Graph().as_default():
        graph_variable = tf.compat.v1.get_variable("v", initializer=1.0)
        for make in (lambda: TensorFlowState([graph_variable]), lambda: TensorFlowState(),
                     lambda: TensorFlowKerasState(keras.Sequential())):
            try:
                make()
                raise AssertionError("an elastic state made in a TF1 graph")
            except ValueError as error:
                assert "needs eager execution" in str(error), error
    print("elastic-eager-ok")

    hvd.shutdown()
    print("CHECKS OK")
    """
)


def test_tensorflow_frontend_checks_of_size_1() -> None:
    run_alone(SCRIPT, "CHECKS OK")
