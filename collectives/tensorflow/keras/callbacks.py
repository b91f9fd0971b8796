"""``collectives.tensorflow.keras.callbacks``: Horovod's ``horovod.tensorflow.keras.callbacks``
(the Keras callbacks of :mod:`collectives.keras.callbacks`)."""

from __future__ import annotations

from collectives.keras.callbacks import *  # noqa: F403
from collectives.keras.callbacks import __all__ as _callbacks_all

__all__ = list(_callbacks_all)
