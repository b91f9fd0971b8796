"""``DistributedOptimizer`` for TensorFlow: gradients reduced over the ranks before the
optimizer applies them.

* A Keras optimizer (Keras 3's ``keras.optimizers.*``, or Keras 2's ``tf_keras``) is wrapped
  as :mod:`collectives.keras` wraps it (Horovod's ``horovod.tensorflow`` takes Keras
  optimizers the same way), with ``backward_passes_per_step`` and
  ``average_aggregated_gradients``.
* A TF1 optimizer (``tf.compat.v1.train.Optimizer``) reduces in ``compute_gradients``, so
  ``minimize`` and ``apply_gradients`` after it work as in Horovod; with
  ``backward_passes_per_step`` it accumulates as Horovod does
  (:mod:`.gradient_aggregation`); ``register_local_var`` keeps a variable's gradient local.
* A TF1 optimizer with ``op=hvd.Adasum`` combines model *deltas*, as Horovod's
  ``_DistributedAdasumOptimizer`` does (and :mod:`collectives.torch.optim.adasum_optimizer`):
  ``compute_gradients`` returns the local gradients; every ``apply_gradients`` steps the
  variables with them, and every ``backward_passes_per_step``-th the variables' changes since
  the last combination are combined with Adasum (see :func:`_distributed_tf1_adasum`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.tensorflow.compression import Compression, Compressor
from collectives.tensorflow.gradient_aggregation import (
    LocalGradientAggregationHelper,
    control_inputs,
)
from collectives.tensorflow.gradient_tape import GradientReducer

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] | Compressor = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Wraps ``optimizer`` so that it applies gradients averaged (``op``) over the ranks."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if ReduceOp(op) == ReduceOp.ADASUM and average_aggregated_gradients:  # (Horovod's)
            raise ValueError("Adasum does not support average_aggregated_gradients == True")
        reducer = GradientReducer(
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            num_groups,
            groups,
            process_set,
            scale_local_gradients,
        )
        if reducer.op == ReduceOp.ADASUM:
            return _distributed_tf1_adasum(optimizer, reducer, backward_passes_per_step)
        aggregation = None
        if backward_passes_per_step != 1:
            aggregation = LocalGradientAggregationHelper(
                backward_passes_per_step,
                reducer.reduce,
                sparse_as_dense,
                average_aggregated_gradients,
            )
        return _distributed_tf1(optimizer, reducer, aggregation)
    # Keras optimizers: the Keras frontend's wrapper (Keras on TensorFlow is built on this
    # frontend, as horovod.tensorflow.keras is on horovod.tensorflow).
    from collectives.keras.optimizer import create_distributed_optimizer

    return create_distributed_optimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        backward_passes_per_step=backward_passes_per_step,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        average_aggregated_gradients=average_aggregated_gradients,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )


def _distributed_tf1(
    optimizer: Any, reducer: GradientReducer, aggregation: LocalGradientAggregationHelper | None
) -> Any:
    """The TF1 optimizer, its class subclassed so that ``compute_gradients`` reduces (and,
    with ``backward_passes_per_step``, ``apply_gradients`` applies every k-th pass)."""
    base = type(optimizer)

    def compute_gradients(self: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = base.compute_gradients(self, *args, **kwargs)
        variables = [v for _, v in pairs]
        grads = [g for g, _ in pairs]
        if aggregation is None:
            grads = reducer.reduce(grads, variables)
        else:
            grads = aggregation.compute_gradients(grads, variables)
        return list(zip(grads, variables, strict=True))

    def apply_gradients(
        self: Any, grads_and_vars: Any, global_step: Any = None, name: Any = None
    ) -> Any:
        def apply() -> Any:
            return base.apply_gradients(self, grads_and_vars, global_step, name)

        if aggregation is None:
            return apply()
        return aggregation.apply_gradients(apply, self, global_step)

    def register_local_var(self: Any, var: Any) -> None:
        """A variable whose gradient each rank keeps for itself (never reduced)."""
        reducer.register_local(var)

    methods = {
        "compute_gradients": compute_gradients,
        "apply_gradients": apply_gradients,
        "register_local_var": register_local_var,
    }
    cls = type(f"Distributed{base.__name__}", (base,), methods)
    optimizer.__class__ = cls  # (re-classed in place: its state stays its own)
    return optimizer


#: The names of the Adasum optimizer's start copies (a slot of each variable, as Horovod's
#: ``delta_start``) and of its step counter (a non-slot variable of the optimizer).
START_SLOT = "delta_start"
START_NAME = "hvd_delta_start"
STEP_NAME = "hvd_adasum_step"


def _distributed_tf1_adasum(
    optimizer: Any, reducer: GradientReducer, backward_passes_per_step: int
) -> Any:
    """The TF1 optimizer, its class subclassed to combine model deltas with Adasum, as
    Horovod's ``_DistributedAdasumOptimizer``: ``compute_gradients`` is the optimizer's own
    (local gradients). ``apply_gradients`` applies them with the optimizer's own step on
    every pass; on the communication passes (the step counter modulo k is k - 1) each
    variable's change since its start copy is combined with Adasum over the process set
    (``reducer``: its compression, process set and groups), the start copy moves by the
    combination and the variable becomes it; then the counter advances.

    The start copies (the slot ``delta_start`` of each variable) and the counter are made
    when gradients are first applied, in the graph being built (or eagerly), as global,
    non-trainable variables (``global_variables_initializer`` initializes them, savers and
    ``BroadcastGlobalVariablesHook`` include them); the start copies take the variables'
    values on the first step (counter 0). A variable of ``register_local_var`` is stepped
    on its own gradient and never combined (no start copy, nothing divided: nothing is
    averaged here, so ``scale_local_gradients`` does not apply)."""
    k = backward_passes_per_step
    if k < 1:
        raise ValueError(f"backward_passes_per_step must be at least 1, got {k}")
    base = type(optimizer)

    def state(self: Any, variables: list[Any], shared: list[Any]) -> tuple[Any, list[Any]]:
        """The step counter and the start copies of ``shared``, made where missing."""
        with tf.init_scope():
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            counter = self._get_non_slot_variable(STEP_NAME, graph)
            if counter is None:  # (colocated with the first variable by name, as Adam's)
                first = min(variables, key=lambda v: v.name)
                self._create_non_slot_variable(tf.constant(0, tf.int64), STEP_NAME, first)
                counter = self._get_non_slot_variable(STEP_NAME, graph)
            starts = [self._zeros_slot(v, START_SLOT, START_NAME) for v in shared]
        return counter, starts

    def apply_gradients(
        self: Any, grads_and_vars: Any, global_step: Any = None, name: Any = None
    ) -> Any:
        pairs = list(grads_and_vars)
        shared = [v for g, v in pairs if g is not None and not reducer.is_local(v)]
        if not any(g is not None for g, _ in pairs):  # (the optimizer's own error)
            return base.apply_gradients(self, pairs, global_step, name)
        counter, starts = state(self, [v for g, v in pairs if g is not None], shared)

        def copy_starts() -> tf.Tensor:  # (the first step: start = var)
            copies = [s.assign(v.read_value()) for v, s in zip(shared, starts, strict=True)]
            with tf.control_dependencies(control_inputs(copies)):
                return tf.constant(True)

        first = tf.equal(counter.read_value(), 0)
        started = tf.cond(first, copy_starts, lambda: tf.constant(False))
        with tf.control_dependencies(control_inputs(started)):
            applied = base.apply_gradients(self, pairs, global_step, name)
        with tf.control_dependencies(control_inputs(applied)):
            communicate = tf.equal(counter.read_value() % k, k - 1)

        def combine() -> tf.Tensor:  # start += Adasum(var - start); var = start
            begun = [s.read_value() for s in starts]
            deltas = [v.read_value() - b for v, b in zip(shared, begun, strict=True)]
            combined = reducer.reduce(deltas, shared)
            updates = []
            for v, s, b, d in zip(shared, starts, begun, combined, strict=True):
                moved = b + d
                updates += [s.assign(moved), v.assign(moved)]
            with tf.control_dependencies(control_inputs(updates)):
                return tf.constant(True)

        combined = tf.cond(communicate, combine, lambda: tf.constant(False))
        with tf.control_dependencies(control_inputs(combined)):
            return tf.group(control_inputs(counter.assign_add(1)))

    def register_local_var(self: Any, var: Any) -> None:
        """A variable each rank trains alone: stepped on its own gradient, never combined."""
        reducer.register_local(var)

    methods = {"apply_gradients": apply_gradients, "register_local_var": register_local_var}
    cls = type(f"Distributed{base.__name__}", (base,), methods)
    optimizer.__class__ = cls  # (re-classed in place: its state stays its own)
    return optimizer
