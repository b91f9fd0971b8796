"""Horovod's PyTorch API on torch.distributed: ``import collectives.torch as hvd``.

This module is the whole public surface; the implementation lives in layers that only
import downward (no import cycles, not even through imports inside functions):

=================== =========================================================================
public API          ``mpi_ops`` (the tensor collectives and ``init``), ``autograd`` (their
                    gradients), ``process_sets``, ``functions`` (parameters, optimizer state
                    and objects), ``sync_batch_norm``, ``optimizer`` (``DistributedOptimizer``)
                    with its family in ``optim/``, and ``elastic/`` on top of them
submission          ``ops``: argument checks, requests, submission (Adasum allreduce included)
process runtime     ``runtime/``: joining the job, the rank queries, the running engine
engine core         ``engine/``: negotiation, fusion, execution, timeline on a background
                    thread; imports none of the layers above
leaves              ``common`` (``ReduceOp``, ``ProcessSet``), ``errors``, ``compression``,
                    ``adasum`` (the math)
=================== =========================================================================

A layer may import any layer below it. The leaves import nothing of the package but
``errors``; what a leaf needs from above (a process set's size and rank) is handed to it by
the runtime (``common.bind_job``).
"""

from __future__ import annotations

from collectives.torch import elastic
from collectives.torch.common import ProcessSet, ReduceOp, global_process_set
from collectives.torch.compression import Compression
from collectives.torch.errors import (
    CollectiveError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidSplitsError,
    NotSupportedWithJoinError,
    TensorMismatchError,
)
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
from collectives.torch.process_sets import add_process_set, remove_process_set
from collectives.torch.runtime import (
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
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from collectives.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum",
    "Average",
    "CollectiveError",
    "Compression",
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
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
