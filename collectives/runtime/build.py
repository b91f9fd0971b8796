"""What this build supports: Horovod's ``hvd.gloo_built()``, ``hvd.nccl_built()``, ...

Answered from the installed torch (there is no compiled core of our own), so they work
before ``hvd.init()``, as in Horovod. MPI, DDL and oneCCL are never built in: hvdrun runs on
torch.distributed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "ccl_built",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rocm_built",
]


def mpi_built() -> bool:
    """Whether MPI support is built in (never: hvdrun runs on torch.distributed)."""
    return False


def mpi_enabled() -> bool:
    """Whether MPI is in use (never)."""
    return False


def mpi_threads_supported() -> bool:
    """Whether MPI multi-threading is supported (no MPI: ops may come from any thread)."""
    return False


def gloo_built() -> bool:
    """Whether Gloo support is available in this torch build."""
    return bool(dist.is_available() and dist.is_gloo_available())


def gloo_enabled() -> bool:
    """Whether Gloo carries the collectives (always, for CPU tensors and negotiation)."""
    return gloo_built()


def nccl_built() -> bool:
    """Whether NCCL support is available in this torch build."""
    return bool(dist.is_available() and dist.is_nccl_available())


def cuda_built() -> bool:
    """Whether this torch build supports CUDA."""
    return bool(torch.backends.cuda.is_built()) and torch.version.hip is None


def rocm_built() -> bool:
    """Whether this torch build supports ROCm."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """Whether IBM DDL support is built in (never)."""
    return False


def ccl_built() -> bool:
    """Whether oneCCL support is built in (never)."""
    return False
