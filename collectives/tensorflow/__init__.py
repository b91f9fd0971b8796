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
training            ``DistributedGradientTape``, ``DistributedOptimizer`` (Keras and TF1
                    optimizers), ``broadcast_variables``, ``Compression``
elastic             ``hvd.elastic.run``, ``TensorFlowKerasState``, ``TensorFlowState``
=================== =========================================================================

Keras users import ``collectives.keras`` (also reachable as ``collectives.tensorflow.keras``).
Importing this module imports TensorFlow; ``collectives.torch`` and ``hvdrun`` never do.
"""

from __future__ import annotations

from collectives import job
from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.errors import (
    CollectiveError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
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
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_variables,
)
from collectives.tensorflow.gradient_tape import DistributedGradientTape
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
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
)
from collectives.tensorflow.optimizer import DistributedOptimizer

init = job.init

__all__ = [
    "Adasum",
    "Average",
    "CollectiveError",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "InvalidSplitsError",
    "Max",
    "Min",
    "NotSupportedWithJoinError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
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
    "broadcast_variables",
    "ccl_built",
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
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
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
