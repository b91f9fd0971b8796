"""``collectives.tensorflow.keras``: the Keras frontend under the name Horovod gives it
(``horovod.tensorflow.keras``); see :mod:`collectives.keras`."""

from __future__ import annotations

from collectives.keras import *  # noqa: F403
from collectives.keras import __all__ as _keras_all

__all__ = list(_keras_all)
