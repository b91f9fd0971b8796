"""Moving variables and Python objects between ranks (Horovod's ``horovod.tensorflow``
helpers): ``broadcast_variables``, ``broadcast_global_variables``, ``broadcast_object`` and
``allgather_object``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import tensorflow as tf

from collectives import objects
from collectives.common import ProcessSet, global_process_set
from collectives.tensorflow import graph
from collectives.tensorflow.mpi_ops import broadcast_

__all__ = [
    "BroadcastGlobalVariablesHook",
    "allgather_object",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
]


def broadcast_variables(
    variables: Iterable[tf.Variable],
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> Any:
    """Overwrites every variable with root_rank's value (one grouped broadcast). In a
    graph it returns the op that does it (``tf.group``); eagerly it does it at once."""
    assigned = broadcast_(list(variables), root_rank, process_set=process_set)
    if graph.in_graph():
        return tf.group(*assigned)
    return None


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1: the op that broadcasts every global variable from root_rank."""
    if not graph.in_graph():
        raise RuntimeError(
            "hvd.broadcast_global_variables() is for TF1 graphs (it broadcasts "
            "tf.compat.v1.global_variables()); in TF2 use hvd.broadcast_variables("
            "model.variables, root_rank)"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """root_rank's object on every rank of the process set (pickled; ``session`` is
    accepted for Horovod compatibility: it runs eagerly)."""
    return objects.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """A function that broadcasts an object from root_rank each time it is called
    (Horovod's TF1 helper; ``session`` is accepted: it runs eagerly)."""

    def broadcast(obj: Any) -> Any:
        return objects.broadcast_object(obj, root_rank, name, process_set)

    return broadcast


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 ``SessionRunHook`` (``MonitoredTrainingSession``): broadcasts every global
    variable from ``root_rank`` once the session is created."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)


def allgather_object(
    obj: Any,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Every rank's object, in rank order (pickled)."""
    return objects.allgather_object(obj, name, process_set)
