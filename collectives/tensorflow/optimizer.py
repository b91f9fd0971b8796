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
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from collectives.common import ProcessSet, ReduceOp, checked_groups, global_process_set
from collectives.tensorflow.compression import Compression, Compressor
from collectives.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
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
    groups, num_groups = checked_groups(groups, num_groups), 0
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
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
