"""Horovod's PyTorch API on torch.distributed: ``import collectives.torch as hvd``.

This module is the whole public surface; the implementation lives in submodules:
``runtime`` (init/shutdown and the rank queries), ``mpi_ops`` (the tensor collectives),
``ops`` (the execution layer they share), ``functions`` (parameters, optimizer state and
objects), ``optimizer`` (``DistributedOptimizer``) and ``compression``.
"""

from __future__ import annotations

from collectives.torch.common import ProcessSet, ReduceOp, global_process_set
from collectives.torch.compression import Compression
from collectives.torch.errors import HorovodInternalError, HostsUpdatedInterrupt
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
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    poll,
    synchronize,
)
from collectives.torch.optimizer import DistributedOptimizer
from collectives.torch.runtime import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)


def add_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Registers a process set (not supported yet: only the global process set exists)."""
    raise NotImplementedError("process sets other than the global one are not supported yet")


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes a process set (not supported yet: only the global process set exists)."""
    raise NotImplementedError("process sets other than the global one are not supported yet")


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
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
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "poll",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]
