"""Checks of the TensorFlow frontend that need no peers, in one job of size 1 (a process of
its own: TensorFlow stays out of pytest's): arguments refused where the tape or optimizer
is made."""

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
    print("groups-ok")

    hvd.shutdown()
    print("CHECKS OK")
    """
)


def test_tensorflow_frontend_checks_of_size_1() -> None:
    run_alone(SCRIPT, "CHECKS OK")
