"""Elastic Keras training (Horovod's ``horovod.keras.elastic``): ``run``, ``KerasState`` and
the callbacks that keep the state's epoch and batch current and commit it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from collectives import elastic
from collectives.common import ModelVariables
from collectives.elastic import VariablesState
from collectives.keras import backend as keras_backend
from collectives.keras.callbacks import KerasCallback

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "TensorFlowKerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


_R = TypeVar("_R")


def run(func: Callable[..., _R]) -> Callable[..., _R]:
    """Decorates ``func(state, *args, **kwargs)`` to survive peer failures and host changes
    (see :func:`collectives.elastic.run`), a ``model.fit`` inside it included: on
    TensorFlow (Keras 3's TensorFlow backend, tf_keras) a collective that failed in the
    compiled train step counts as the Horovod error behind TensorFlow's."""
    if keras_backend.current().is_torch:
        return elastic.run(func)
    from collectives.tensorflow.elastic import run as run_on_tensorflow

    return run_on_tensorflow(func)


class KerasState(ModelVariables, VariablesState):
    """A Keras model, its optimizer and picklable attributes (``epoch``, ``batch``...):
    commit copies the variables' values to host memory, restore assigns them back, sync
    broadcasts them from rank 0. The variables are looked up at each of them: a model
    built at its first batch (a ``Sequential`` without an input shape) is covered once it
    is, and its optimizer is built only then; a restore leaves the variables created
    since the commit as they are. On TensorFlow it needs eager execution (tf_keras in a
    TF1 session is refused, as Horovod refuses it)."""

    def __init__(
        self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any
    ) -> None:
        if not keras_backend.current().is_torch:  # (tf_keras in a TF1 session: refused)
            from collectives.tensorflow.elastic import check_eager

            check_eager("hvd.elastic.KerasState")
        super().__init__(model, optimizer, **kwargs)

    def _value_of(self, variable: Any) -> Any:
        import numpy as np

        keras = keras_backend.current().keras
        if hasattr(keras, "ops"):  # Keras 3, any backend
            return np.array(keras.ops.convert_to_numpy(variable), copy=True)
        return np.array(variable.numpy(), copy=True)

    def _broadcast_variables(self, variables: list[Any]) -> None:
        keras_backend.current().broadcast_variables(variables, root_rank=0)


#: Horovod's Keras frontends export it too (their ``KerasState`` is a subclass of it); here
#: one class serves every Keras backend.
TensorFlowKerasState = KerasState


class CommitStateCallback(KerasCallback):
    """Commits the state every ``batches_per_commit`` batches and at the end of each epoch."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(KerasCallback):
    """Keeps ``state.batch`` current, and after a reset lowers the epoch's ``steps`` by the
    batches done, as Horovod's does. Keras 3's ``fit`` counts its own steps, so there an
    epoch interrupted by a reset runs whole again from the last commit."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        params = self.params or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params["steps"]
            params["steps"] = self.steps_per_epoch - self.state.batch

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(KerasCallback):
    """Keeps ``state.epoch`` current."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1
