"""``SyncBatchNormalization``: batch normalisation whose training statistics span every
rank's batch (Horovod's ``hvd.SyncBatchNormalization``), on the Keras in use: Keras 3 on
TensorFlow or torch, or tf_keras.

Each rank computes its batch's mean and variance as Keras does; the layer then averages the
means and the means of squares over the ranks (one allreduce that carries the gradient
back), as Horovod's layer does: every rank weighs the same, so the ranks' batches should be
of one size. Horovod's constructor arguments are taken: ``fused=False`` (the default; the
fused kernel cannot be synchronised, so ``fused=True`` is refused as in Horovod). Unnamed
layers take Keras's unique names from the class (``sync_batch_normalization``,
``sync_batch_normalization_1``, ...), so that a model holds several (Horovod gives them all
one name, and a second one in a model fails). On one rank it is BatchNormalization.
"""

from __future__ import annotations

from typing import Any

from collectives import runtime
from collectives.keras import backend as keras_backend

__all__ = ["SyncBatchNormalization"]

_bridge = keras_backend.current()
#: The Keras in use's BatchNormalization layer.
BatchNormalization: Any = _bridge.keras.layers.BatchNormalization


def _math() -> Any:
    """The array functions of the Keras in use (``stack``, ``square``)."""
    if _bridge.legacy:
        import tensorflow as tf

        return tf
    return _bridge.keras.ops


class SyncBatchNormalization(BatchNormalization):
    """BatchNormalization with statistics over every rank's batch in training."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if _bridge.legacy:  # (Keras 3's layer has no fused kernel, nor the argument)
            kwargs["fused"] = False
        super().__init__(**kwargs)

    def _moments(self, *args: Any, **kwargs: Any) -> Any:
        mean, variance = super()._moments(*args, **kwargs)
        size = runtime.size()
        if size <= 1:
            return mean, variance
        math = _math()
        stacked = math.stack([mean, variance + math.square(mean)])
        summed = _bridge.sum_over_ranks(stacked) / size
        mean, mean_of_squares = summed[0], summed[1]
        return mean, mean_of_squares - math.square(mean)
