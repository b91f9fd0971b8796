"""Horovod's TensorFlow API on the shared engine: ``import collectives.tensorflow as hvd``.

What ``import horovod.tensorflow as hvd`` gives, for TensorFlow 2 (eager, ``tf.function``)
and TF1-style graphs (``tf.compat.v1`` sessions), with nothing to compile: the tensors reach
the engine that ``collectives.torch`` uses too (one engine, one job per process) through
DLPack, without copies, and graph ops run as ``tf.py_function`` (see :mod:`.graph`).

=================== =========================================================================
the job             ``init``, ``shutdown``, ``rank``/``size`` and friends, process sets,
                    ``join``, ``barrier``, ``broadcast_object``, ``allgather_object``
ops                 ``allreduce`` (Average, Sum, Adasum, Min, Max, Product; scaling;
                    compression; ``tf.IndexedSlices``), ``grouped_allreduce``, ``allgather``,
                    ``grouped_allgather``, ``broadcast``, ``broadcast_`` (variables, in
                    place), ``alltoall``, ``reducescatter``, ``grouped_reducescatter``; each
                    differentiable as in Horovod
training            ``DistributedGradientTape``, ``PartialDistributedGradientTape``,
                    ``DistributedOptimizer`` (Keras and TF1 optimizers),
                    ``broadcast_variables``, ``Compression``, ``SyncBatchNormalization``
the job in graphs   ``rank_op``, ``size_op``, ``local_rank_op``, ``local_size_op``,
                    ``process_set_included_op``: int32 ops read when they run
elastic             ``hvd.elastic.run``, ``TensorFlowKerasState``, ``TensorFlowState``
=================== =========================================================================

Ops raise TensorFlow's error types, as Horovod's do (see :mod:`.errors`). Keras users import
``collectives.keras`` (also reachable as ``collectives.tensorflow.keras``). Importing this
module imports TensorFlow; ``collectives.torch`` and ``hvdrun`` never do. Horovod's private
names that scripts call (``_executing_eagerly``, ``_allreduce``, ``vars_to_refs``, ...) are
here too.
"""

from __future__ import annotations

from typing import Any

from collectives import missing_framework as _missing_framework

if _missing := _missing_framework("torch", __name__) or _missing_framework("tensorflow", __name__):
    raise _missing

from collectives import job
from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.errors import (
    CollectiveError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidArgumentsError,
    InvalidSplitsError,
    NotSupportedWithJoinError,
    TensorMismatchError,
)
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
from collectives.tensorflow import elastic
from collectives.tensorflow.compression import Compression
from collectives.tensorflow.functions import (
    BroadcastGlobalVariablesHook,
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from collectives.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from collectives.tensorflow.gradient_tape import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
)
from collectives.tensorflow.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    check_num_rank_power_of_2,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    handle_average_backwards_compatibility,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    raw_allreduce,
    raw_grouped_allreduce,
    raw_grouped_reducescatter,
    raw_reducescatter,
    reducescatter,
    size_op,
)
from collectives.tensorflow.optimizer import DistributedOptimizer
from collectives.tensorflow.util import (
    cache,
    executing_eagerly,
    make_subgraph,
    refs_to_vars,
    vars_to_refs,
)

init = job.init

# Horovod's private names, which scripts and test suites call.
_IS_TF2 = True
_allreduce = raw_allreduce
_grouped_allreduce = raw_grouped_allreduce
_reducescatter = raw_reducescatter
_grouped_reducescatter = raw_grouped_reducescatter
_executing_eagerly = executing_eagerly
_make_subgraph = make_subgraph
_cache = cache


def __getattr__(name: str) -> Any:
    # SyncBatchNormalization is a Keras layer: Keras is imported when it is first asked for.
    if name == "SyncBatchNormalization":
        from collectives.keras.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Adasum",
    "Average",
    "BroadcastGlobalVariablesHook",
    "CollectiveError",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "InvalidArgumentsError",
    "InvalidSplitsError",
    "LocalGradientAggregationHelper",
    "Max",
    "Min",
    "NotSupportedWithJoinError",
    "PartialDistributedGradientTape",
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
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "ccl_built",
    "check_num_rank_power_of_2",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "handle_average_backwards_compatibility",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "refs_to_vars",
    "remove_process_set",
    "report",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
    "vars_to_refs",
]
