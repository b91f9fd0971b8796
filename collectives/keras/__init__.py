"""Horovod's Keras API on the shared engine: ``import collectives.keras as hvd``.

What ``import horovod.keras as hvd`` and ``import horovod.tensorflow.keras as hvd`` give
(also importable as ``collectives.tensorflow.keras``), for Keras 3 on its TensorFlow and
torch backends and for Keras 2 through ``tf_keras`` (``TF_USE_LEGACY_KERAS=1``), with
nothing to compile (see :mod:`.backend` for how each reaches the engine):

=================== =========================================================================
the job             ``init``, ``shutdown``, ``rank``/``size`` and friends, process sets,
                    ``join``, ``barrier``, ``broadcast_object``, ``allgather_object``
training            ``DistributedOptimizer`` (any Keras optimizer), ``load_model``,
                    ``Compression``; ``callbacks``: ``BroadcastGlobalVariablesCallback``,
                    ``MetricAverageCallback``, ``LearningRateWarmupCallback``,
                    ``LearningRateScheduleCallback``
ops on values       ``allreduce``, ``allgather``, ``broadcast``, ``reducescatter`` of backend
                    tensors, numpy arrays and numbers
elastic             ``hvd.elastic.run``, ``KerasState`` and its callbacks
=================== =========================================================================
"""

from __future__ import annotations

from typing import Any

from collectives import missing_framework as _missing_framework

if _missing := _missing_framework("torch", __name__):
    raise _missing

import numpy as np

from collectives import job, objects
from collectives.common import ProcessSet, ReduceOp, global_process_set, layer_variables
from collectives.errors import (
    CollectiveError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidArgumentsError,
    InvalidSplitsError,
    NotSupportedWithJoinError,
    TensorMismatchError,
)
from collectives.keras import backend as keras_backend

try:  # which Keras (decided once, before the modules below use it), or what to install
    _bridge = keras_backend.current()
except ModuleNotFoundError as _error:
    _advice = {
        "keras": "Keras: pip install 'hvdrun[keras]' (Keras 3, on TensorFlow or with "
        "KERAS_BACKEND=torch), or pip install tf_keras with TF_USE_LEGACY_KERAS=1 (Keras 2)",
        "tf_keras": "tf_keras for Keras 2, which TF_USE_LEGACY_KERAS asks for: pip install "
        "tf_keras (or unset TF_USE_LEGACY_KERAS for Keras 3)",
        "tensorflow": "TensorFlow for Keras's TensorFlow backend: pip install "
        "'hvdrun[tensorflow]' (or, with Keras 3, KERAS_BACKEND=torch)",
        "jax": "Keras's TensorFlow or torch backend, not jax: set KERAS_BACKEND=tensorflow "
        "or KERAS_BACKEND=torch",
    }.get(_error.name or "")
    if _advice is None:
        raise
    raise ModuleNotFoundError(
        f"collectives.keras needs {_advice}",
        name=_error.name,
    ) from None
from collectives.keras import callbacks, elastic
from collectives.keras.optimizer import create_distributed_optimizer
from collectives.keras.sync_batch_norm import SyncBatchNormalization
from collectives.process_sets import add_process_set, remove_process_set
from collectives.runtime import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    report,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

if _bridge.legacy:
    from collectives.tensorflow.compression import Compression
else:
    from collectives.keras.compression import Compression  # type: ignore[assignment]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

init = job.init
join = job.join
barrier = job.barrier
broadcast_object = objects.broadcast_object
allgather_object = objects.allgather_object


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = ReduceOp.AVERAGE,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """``optimizer`` (any Keras optimizer, re-classed in place) applying gradients averaged
    (``op``) over the ranks; see :mod:`collectives.keras.optimizer`."""
    return create_distributed_optimizer(
        optimizer,
        name,
        compression,
        sparse_as_dense,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        average_aggregated_gradients,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )


def PartialDistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = ReduceOp.AVERAGE,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """A :func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of
    them) keep each rank's own gradients: not reduced, divided by the process set's size
    unless ``scale_local_gradients=False``, as in Horovod."""
    if ReduceOp(op) not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("op currently only supports Average and Sum")
    return create_distributed_optimizer(
        optimizer,
        name,
        compression,
        sparse_as_dense,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        average_aggregated_gradients,
        0,
        groups,
        process_set,
        scale_local_gradients,
        layer_variables(local_layers),
    )


def broadcast_global_variables(root_rank: int) -> Any:
    """Horovod's TF1 helper: broadcasts every global variable from ``root_rank`` in the
    Keras session (tf_keras in graph mode). Keras 3 and eager Keras have no session: use
    ``hvd.callbacks.BroadcastGlobalVariablesCallback`` or broadcast the model's variables."""
    session = _bridge.session()
    if session is not None:
        from collectives.tensorflow import functions

        return session.run(functions.broadcast_global_variables(root_rank))
    raise RuntimeError(
        "hvd.broadcast_global_variables() needs a TF1 Keras session; with eager Keras use "
        "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit(), or "
        "hvd.broadcast_variables(model.variables, root_rank)"
    )


def load_model(
    filepath: Any,
    custom_optimizers: Any = None,
    custom_objects: Any = None,
    compression: Any = None,
    legacy_opts: bool = False,
) -> Any:
    """``keras.models.load_model``, its optimizer wrapped in a DistributedOptimizer.
    ``custom_optimizers``: optimizer classes of one's own that the saved model may use (as
    ``custom_objects`` by their names; ``custom_objects`` wins). ``legacy_opts`` is accepted
    for Horovod's scripts: the optimizer is wrapped whatever its kind."""
    # (this frontend's own layer too, which Horovod's load_model leaves to custom_objects)
    objects: dict[str, Any] = {"SyncBatchNormalization": SyncBatchNormalization}
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    objects.update(custom_objects or {})
    model = _bridge.keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not getattr(optimizer, "_hvd_distributed", False):
        DistributedOptimizer(optimizer, compression=compression)
    return model


def _is_backend_tensor(value: Any) -> bool:
    if _bridge.is_torch:
        import torch

        return isinstance(value, torch.Tensor)
    import tensorflow as tf

    return isinstance(value, tf.Tensor | tf.Variable) or hasattr(value, "_value")


def allreduce(
    value: Any,
    name: str | None = None,
    average: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    op: Any = None,
    compression: Any = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Reduces a backend tensor, numpy array or number over the ranks (Average by default);
    the same kind of value comes back."""
    op = job.handle_average_backwards_compatibility(op, average)
    if not _is_backend_tensor(value):
        return _bridge.allreduce_value(
            value, op, name, process_set, prescale_factor, postscale_factor
        )
    if compression is not None:
        packed, ctx = compression.compress(value)
        (reduced,) = _bridge.reduce(
            [packed], op, prescale_factor, postscale_factor, name, process_set
        )
        return compression.decompress(reduced, ctx)
    (reduced,) = _bridge.reduce([value], op, prescale_factor, postscale_factor, name, process_set)
    return reduced


def allgather(
    value: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Concatenates every rank's value along the first dimension."""
    if not _is_backend_tensor(value):
        return _bridge.allgather_value(value, name, process_set)
    if _bridge.is_torch:
        return _bridge.keras.ops.convert_to_tensor(
            _bridge.allgather_value(np.asarray(value.detach().cpu()), name, process_set)
        )
    from collectives.tensorflow import mpi_ops

    return mpi_ops.allgather(value, name, process_set=process_set)


def broadcast(
    value: Any,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """root_rank's value on every rank."""
    if not _is_backend_tensor(value):
        return _bridge.broadcast_value(value, root_rank, name, process_set)
    (result,) = _bridge.broadcast([value], root_rank, name, process_set)
    return result


def reducescatter(
    value: Any,
    name: str | None = None,
    op: Any = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Reduces and gives each rank its share of the first dimension."""
    if _bridge.is_torch or not _is_backend_tensor(value):
        import torch

        from collectives import ops

        tensor = (
            value
            if isinstance(value, torch.Tensor)
            else torch.from_numpy(np.ascontiguousarray(value))
        )
        result = ops.submit_reducescatter(
            [tensor], ReduceOp(op), 1.0, 1.0, process_set, name, ops.first_output, True
        ).wait()
        return result if isinstance(value, torch.Tensor) else result.numpy()
    from collectives.tensorflow import mpi_ops

    return mpi_ops.reducescatter(value, op=op, name=name, process_set=process_set)


def backend() -> str:
    """Which Keras and backend this is, e.g. ``keras 3.15.1 on torch``."""
    return _bridge.describe()


__all__ = [
    "Adasum",
    "Average",
    "CollectiveError",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "InvalidArgumentsError",
    "InvalidSplitsError",
    "Max",
    "Min",
    "NotSupportedWithJoinError",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNormalization",
    "TensorMismatchError",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "callbacks",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "report",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
