"""Horovod's Keras callbacks: keep the ranks' weights in sync, average the metrics, warm the
learning rate up and schedule it (``horovod.keras.callbacks``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import objects, runtime
from collectives.common import global_process_set, optimizer_variables, variable_key
from collectives.keras import backend as keras_backend

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "KerasCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "optimizer_variables",
]

logger = logging.getLogger(__name__)
_bridge = keras_backend.current()
#: The Keras in use's callback base class.
KerasCallback: Any = _bridge.keras.callbacks.Callback


class BroadcastGlobalVariablesCallback(KerasCallback):
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` before
    training starts, so that every rank starts from the same state (the optimizer's
    variables included: Keras 3 creates them lazily, they are built here first); a model
    that is not built before its first batch is broadcast at the end of that batch.
    ``local_variables`` (a variable or a list of them, Keras or backend variables) are
    each rank's own and never broadcast."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, list | tuple | set):
            local_variables = [local_variables]
        for variable in local_variables:
            self.register_local_var(variable)

    def register_local_var(self, var: Any) -> None:
        """A variable each worker keeps for itself (never broadcast)."""
        self._local.add(variable_key(var))

    def _variables(self) -> list[Any]:
        model = self.model
        variables = [v for v in model.variables if variable_key(v) not in self._local]
        return variables + optimizer_variables(getattr(model, "optimizer", None), model)

    def _broadcast(self) -> None:
        _bridge.broadcast_variables(self._variables(), self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        # Broadcast now if every rank's model is built and holds as many variables; else at
        # the end of the first batch, as Horovod does, once every rank's weights and
        # optimizer slots exist (a model without an input shape, built at its first batch;
        # a model built on some ranks only; an optimizer loaded with its slots on rank 0,
        # as Horovod's resume recipe makes it, and built at the first step elsewhere). The
        # ranks decide together (one small gather), so that they all broadcast alike.
        if self.broadcast_done:
            return
        count = len(self._variables()) if getattr(self.model, "built", True) else -1
        counts = objects.allgather_object(count, "BroadcastGlobalVariablesCallback")
        if min(counts) >= 0 and len(set(counts)) == 1:
            self._broadcast()

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if not self.broadcast_done:  # (a model whose variables appeared only now)
            self._broadcast()


class MetricAverageCallback(KerasCallback):
    """Averages every metric in the epoch's logs over the ranks (put it before callbacks
    that read the logs, such as checkpoints and TensorBoard).

    Every rank's logs travel in one gather per epoch, so ranks whose logs differ cannot
    stall each other: a metric that is None on a rank, or that a rank does not log, is
    averaged over the ranks that have a value (None where none has); a metric whose values
    cannot be averaged together (not a number on some rank, arrays of different shapes) is
    left as each rank has it, with a warning."""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self._warned: set[str] = set()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = {} if logs is None else logs  # (every rank takes part in the gather)
        mine = {metric: _as_array(value) for metric, value in logs.items()}
        every = objects.allgather_object(mine, f"metrics.{epoch}", global_process_set)
        for metric in sorted(logs):
            values = [ranks_logs.get(metric) for ranks_logs in every]
            held = [v for v in values if v is not None]
            if not held:
                logs[metric] = None
                continue
            odd = [isinstance(v, str) for v in held]
            if any(odd) or len({v.shape for v in held}) > 1:
                if metric not in self._warned and not all(odd):
                    self._warned.add(metric)
                    logger.warning(
                        "MetricAverageCallback: metric %r is left as each rank has it: %s",
                        metric,
                        _describe(values),
                    )
                continue
            averaged = sum(held[1:], held[0]) / len(held)  # (in rank order: alike everywhere)
            value = logs[metric]
            if averaged.ndim == 0:
                logs[metric] = float(averaged)
            elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
                logs[metric] = averaged.astype(value.dtype)
            else:
                logs[metric] = averaged


#: What a logged value that is not a number nor an array of numbers gathers as.
_NOT_A_NUMBER = "not a number"


def _as_array(value: Any) -> Any:
    """A logged value as float64 numbers (None stays None, others :data:`_NOT_A_NUMBER`)."""
    if value is None:
        return None
    try:  # a number, or an array (a per-class metric such as F1Score(average=None))
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        try:  # (a device tensor of one value)
            return np.asarray(float(value))
        except (TypeError, ValueError):
            return _NOT_A_NUMBER


def _describe(values: list[Any]) -> str:
    """What each rank logged, for the warning (``rank 0: a number, rank 1: not a number``)."""

    def kind(value: Any) -> str:
        if value is None:
            return "none"
        if isinstance(value, str):
            return value
        return "a number" if value.ndim == 0 else f"an array of shape {value.shape}"

    return ", ".join(f"rank {rank}: {kind(value)}" for rank, value in enumerate(values))


def _get(optimizer: Any, attr: str) -> float:
    value = getattr(optimizer, attr)
    if _bridge.legacy and hasattr(value, "assign"):  # (a TF1 session's variable, too)
        return float(_bridge.keras.backend.get_value(value))
    if hasattr(value, "numpy"):
        return float(value.numpy())
    if hasattr(value, "item"):
        return float(value.item())
    return float(value)


def _set(optimizer: Any, attr: str, value: float) -> None:
    current = getattr(optimizer, attr)
    if _bridge.legacy and hasattr(current, "assign"):  # runs in a TF1 session, too
        _bridge.keras.backend.set_value(current, value)
    elif hasattr(current, "assign"):
        current.assign(value)
    else:
        setattr(optimizer, attr, value)


def _with_momentum(optimizer: Any) -> Any:
    """The optimizer that holds the momentum: a ``LossScaleOptimizer``'s inner one (Keras 3's
    has no ``momentum`` of its own; mixed precision's ``model.compile`` makes one)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return inner if inner is not None and not hasattr(optimizer, "momentum") else optimizer


def _scale_momentum_buffers(optimizer: Any, factor: float) -> None:
    """Momentum correction where the optimizer holds the momentum as a Python number (Keras
    3's optimizers, tf_keras's non-legacy ones): a compiled train step reads it once, when
    it is traced, so a per-batch change of it would stay at its first value for the whole of
    training. Scaling the momentum buffers (which carry the learning rate in them in SGD and
    RMSprop) by ``new_lr / old_lr`` is the same step as scaling the momentum for that batch
    (with Nesterov momentum, all but its look-ahead term). Other optimizers are left
    uncorrected."""
    keras = _bridge.keras
    if isinstance(optimizer, keras.optimizers.SGD):
        buffers = getattr(optimizer, "momentums", None) or []
    elif isinstance(optimizer, keras.optimizers.RMSprop):
        buffers = getattr(optimizer, "_momentums", None) or []
    else:
        global _warned_uncorrected
        if not _warned_uncorrected:
            _warned_uncorrected = True
            logger.warning(
                "momentum_correction: %s's momentum cannot be corrected (only SGD's and "
                "RMSprop's, or a legacy optimizer's); its momentum is left as it is",
                type(optimizer).__name__,
            )
        return
    for buffer in buffers:
        if buffer is not None:
            buffer.assign(buffer * factor)


_warned_uncorrected = False


class LearningRateScheduleCallback(KerasCallback):
    """Sets the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to
    ``end_epoch`` (per epoch with ``staircase``, else per batch with a fractional epoch);
    ``momentum_correction`` scales the momentum with the change for the batch."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: float | Callable[[float], float],
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
    ) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: float | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)

    def _steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError(
            f"{type(self).__name__}: could not tell the number of steps per epoch; pass "
            "steps_per_epoch="
        )

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = _get(optimizer, "learning_rate")
        new = self.initial_lr * self.multiplier(epoch)
        _set(optimizer, "learning_rate", new)
        optimizer = _with_momentum(optimizer)
        if not (self.momentum_correction and hasattr(optimizer, "momentum") and old):
            return
        if hasattr(optimizer.momentum, "assign"):  # a tf_keras legacy optimizer's variable
            self.restore_momentum = _get(optimizer, "momentum")
            _set(optimizer, "momentum", self.restore_momentum * new / old)
        else:
            _scale_momentum_buffers(optimizer, new / old)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self.current_epoch = epoch

    def on_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
            self.end_epoch is not None and self.current_epoch >= self.end_epoch
        ):
            return
        if self.staircase:
            if batch == 0:
                self._adjust(self.current_epoch)
        else:
            assert self.steps_per_epoch
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        if self.restore_momentum is not None:
            _set(_with_momentum(self.model.optimizer), "momentum", self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if logs is not None:
            logs["lr"] = _get(self.model.optimizer, "learning_rate")


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warmup: over ``warmup_epochs`` the learning rate rises from
    ``initial_lr / size`` to ``initial_lr`` (pass the rate scaled by the number of ranks),
    one step per batch."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ) -> None:
        def multiplier(epoch: float) -> float:
            assert self.steps_per_epoch
            epoch += 1.0 / self.steps_per_epoch
            size = runtime.size()
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        done = self.end_epoch is not None and epoch == self.end_epoch - 1
        if done and self.verbose > 0 and runtime.rank() == 0:
            new = _get(self.model.optimizer, "learning_rate")
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {new:g}.")
