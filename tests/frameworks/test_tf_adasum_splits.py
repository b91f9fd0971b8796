"""collectives.tensorflow in a job of size 1: an ``op=hvd.Adasum`` allreduce has Horovod's
gradient (the Adasum of the incoming gradients, not None), eagerly and in a tf.function; and
alltoall splits that are not integers are refused, not truncated into other row counts, and
alltoall without splits returns the rows alone.
One process of its own (TensorFlow stays out of pytest's)."""

from __future__ import annotations

import textwrap

from tests.frameworks.conftest import run_alone

SCRIPT = textwrap.dedent(
    """
    import tensorflow as tf
    import collectives.tensorflow as hvd

    hvd.init()
    x = tf.Variable([1.0, 2.0, 3.0])
    weights = tf.constant([1.0, 4.0, 9.0])

    def gradient(op_kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allreduce(x, **op_kwargs) * weights)
        return tape.gradient(loss, x)

    adasum = {"op": hvd.Adasum}
    scaled = {"op": hvd.Adasum, "postscale_factor": 2.0}
    for got in (gradient(adasum), tf.function(lambda: gradient(adasum))()):
        assert got is not None and got.numpy().tolist() == [1.0, 4.0, 9.0], got
    assert gradient(scaled).numpy().tolist() == [2.0, 8.0, 18.0]

    for splits in ([3.7], [True], tf.constant([3.0])):
        for call in (hvd.alltoall, tf.function(hvd.alltoall)):
            try:
                out = call(tf.range(3), splits=splits)
            except hvd.InvalidSplitsError as error:
                assert "splits must be integers" in str(error), error
            else:
                raise AssertionError(f"splits={splits!r} ran: {out}")
    out, received = hvd.alltoall(tf.range(3), splits=tf.constant([3], tf.int64))
    assert out.numpy().tolist() == [0, 1, 2] and received.numpy().tolist() == [3]
    # Without splits, the rows alone (as Horovod): a tuple of two same-shaped tensors fed
    # into tf.reshape or tf.concat made one tensor of the rows and the counts.
    for call in (hvd.alltoall, tf.function(hvd.alltoall)):
        alone = call(tf.range(3))
        assert isinstance(alone, tf.Tensor) and alone.numpy().tolist() == [0, 1, 2], alone
    hvd.shutdown()
    print("ADASUM SPLITS OK")
    """
)


def test_adasum_gradient_and_non_integer_splits() -> None:
    run_alone(SCRIPT, "ADASUM SPLITS OK")
