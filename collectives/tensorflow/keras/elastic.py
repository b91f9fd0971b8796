"""``collectives.tensorflow.keras.elastic``: Horovod's ``horovod.tensorflow.keras.elastic``
(elastic Keras training, :mod:`collectives.keras.elastic`)."""

from __future__ import annotations

from collectives.keras.elastic import *  # noqa: F403
from collectives.keras.elastic import __all__ as _elastic_all

__all__ = list(_elastic_all)
