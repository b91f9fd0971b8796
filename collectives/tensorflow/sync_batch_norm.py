"""``collectives.tensorflow.sync_batch_norm``: Horovod's module of the name, whose
``SyncBatchNormalization`` (a Keras layer) is :mod:`collectives.keras.sync_batch_norm`'s."""

from __future__ import annotations

from collectives.keras.sync_batch_norm import SyncBatchNormalization

__all__ = ["SyncBatchNormalization"]
