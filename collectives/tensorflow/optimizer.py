"""``DistributedOptimizer`` for TensorFlow: gradients reduced over the ranks before the
optimizer applies them.

* A Keras optimizer (Keras 3's ``keras.optimizers.*``, or Keras 2's ``tf_keras``) is wrapped
  as :mod:`collectives.keras` wraps it (Horovod's ``horovod.tensorflow`` takes Keras
  optimizers the same way), with ``backward_passes_per_step`` and
  ``average_aggregated_gradients``.
* A TF1 optimizer (``tf.compat.v1.train.Optimizer``) reduces in ``compute_gradients``, so
  ``minimize`` and ``apply_gradients`` after it work as in Horovod.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.tensorflow.compression import Compression, Compressor
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
        if backward_passes_per_step != 1:
            raise NotImplementedError(
                "backward_passes_per_step > 1 is for Keras optimizers; with a TF1 optimizer "
                "accumulate the gradients yourself"
            )
        reducer = GradientReducer(
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            num_groups,
            groups,
            process_set,
        )
        return _distributed_tf1(optimizer, reducer)
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
    )


def _distributed_tf1(optimizer: Any, reducer: GradientReducer) -> Any:
    """The TF1 optimizer, its class subclassed so that ``compute_gradients`` reduces."""
    base = type(optimizer)

    def compute_gradients(self: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = base.compute_gradients(self, *args, **kwargs)
        grads = reducer.reduce([g for g, _ in pairs], [v for _, v in pairs])
        return list(zip(grads, [v for _, v in pairs], strict=True))

    cls = type(f"Distributed{base.__name__}", (base,), {"compute_gradients": compute_gradients})
    optimizer.__class__ = cls  # (re-classed in place: its state stays its own)
    return optimizer
