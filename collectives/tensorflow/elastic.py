"""Elastic training for TensorFlow (Horovod's ``horovod.tensorflow.elastic``): ``run`` and
the states that survive a reset, on hvdrun's elastic jobs.

``TensorFlowKerasState(model, optimizer, **attrs)`` keeps a Keras model's (and its
optimizer's) variables; ``TensorFlowState(variables, **attrs)`` any list of variables. A
commit copies the variables' values to host memory, a restore assigns them back, a sync
broadcasts them from rank 0 (plus the picklable attributes, see :mod:`collectives.elastic`).
The model's variables are looked up at each of them, so a model built at its first batch
is covered once it is; a restore leaves the variables created since the commit as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import tensorflow as tf

from collectives import elastic
from collectives.common import ModelVariables
from collectives.elastic import ObjectState, State, VariablesState
from collectives.errors import HorovodInternalError, HostsUpdatedInterrupt
from collectives.tensorflow import graph
from collectives.tensorflow.functions import broadcast_variables

__all__ = [
    "HorovodInternalError",  # (Horovod's module has it too: scripts import it from there)
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
]


_R = TypeVar("_R")


def run(func: Callable[..., _R]) -> Callable[..., _R]:
    """Decorates ``func(state, *args, **kwargs)`` to survive peer failures and host changes
    (see :func:`collectives.elastic.run`); a collective that failed inside a ``tf.function``
    or a Keras ``fit`` reaches it as the ``tf.errors.OpError`` TensorFlow raised, and counts
    as the ``HorovodInternalError`` (or ``HostsUpdatedInterrupt``) behind it."""

    @functools.wraps(func)
    def unwrapping(state: State, *args: Any, **kwargs: Any) -> _R:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as error:
            failure = graph.collective_failure(error)
            if failure is None:
                raise
            raise failure from error

    return elastic.run(unwrapping)


def check_eager(what: str) -> None:
    """A ValueError where ``what`` (an elastic state) is made without eager execution: TF1
    graphs and sessions are not supported in elastic mode."""
    if not tf.executing_eagerly():
        raise ValueError(
            f"{what} needs eager execution: TF1 graphs and sessions "
            "(tf.compat.v1.disable_eager_execution(), tf.Graph().as_default()) are not "
            "supported in elastic mode; train eagerly or in a tf.function (TensorFlow 2's "
            "default), and make the state outside any graph or tf.function"
        )


class TensorFlowState(VariablesState):
    """Variables (``variables``, e.g. ``model.variables``) and picklable attributes. Needs
    eager execution (TF1 sessions are not supported in elastic mode): made in a graph, it
    is a ValueError, where Horovod would read the variables through a session."""

    def __init__(
        self, variables: Sequence[tf.Variable] | None = None, session: Any = None, **kwargs: Any
    ) -> None:
        check_eager(f"hvd.elastic.{type(self).__name__}")
        self._tf_variables = list(variables or [])
        super().__init__(**kwargs)

    def _variables(self) -> list[tf.Variable]:
        return self._tf_variables

    def _broadcast_variables(self, variables: list[Any]) -> None:
        broadcast_variables(variables, root_rank=0)


class TensorFlowKerasState(ModelVariables, TensorFlowState):
    """A Keras model, its optimizer (optional) and picklable attributes (``epoch``...).
    The optimizer's variables are created (built) first, so that every rank holds the same
    ones to sync; not before the model has variables (a ``Sequential`` without an input
    shape has none before its first batch): an optimizer built on none would refuse the
    model's at its first step. Both are looked up again at each sync, commit and restore."""

    def __init__(
        self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(model, optimizer, variables=None, **kwargs)
