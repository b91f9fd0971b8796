"""Horovod's PyTorch API on torch.distributed: ``import collectives.torch as hvd``.

This module is the whole public surface of the PyTorch frontend; its parts import only
downward (no import cycles, not even through imports inside functions):

=================== =========================================================================
public API          ``mpi_ops`` (the tensor collectives and ``init``), ``autograd`` (their
                    gradients), ``functions`` (parameters, optimizer state and objects),
                    ``sync_batch_norm``, ``optimizer`` (``DistributedOptimizer``) with its
                    family in ``optim/``, and ``elastic/`` on top of them
leaves              ``compression``
=================== =========================================================================

Below the frontend (see :mod:`collectives`): ``collectives.process_sets``, the submission
layer ``collectives.ops``, the runtime ``collectives.runtime`` and the engine
``collectives.engine``, with ``collectives.errors`` and ``collectives.common`` as leaves.
"""

from __future__ import annotations

from collectives import missing_framework as _missing_framework

if _missing := _missing_framework("torch", __name__):
    raise _missing

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
from collectives.torch import elastic
from collectives.torch.compression import Compression
from collectives.torch.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from collectives.torch.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from collectives.torch.optimizer import DistributedOptimizer
from collectives.torch.sync_batch_norm import SyncBatchNorm

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
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "TensorMismatchError",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
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
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
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
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "report",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
