"""The process runtime: how this process joins its job, and what it knows about it.

``from collectives import runtime`` gives ``runtime.init()``, ``runtime.shutdown()``,
``runtime.reset()``, the rank queries (``runtime.rank()``, ``runtime.size()``, ...),
``runtime.require()``, ``runtime.engine()``, ``runtime.config()``, ``runtime.timeout()``,
``runtime.generation()``, ``runtime.report()`` and the build queries; the modules behind
them:

* :mod:`.state` -- the live runtime of this process and the questions asked of it;
* :mod:`.bootstrap` -- ``init()``, ``shutdown()`` and the elastic ``reset()``: how a process
  joins its job (through ``hvdrun``'s rendezvous, or alone as a job of size 1);
* :mod:`.registration` -- joining through the rendezvous: registration, the default process
  group over the rendezvous store, the heartbeat watch, elastic generations;
* :mod:`.groups` -- the backend, the CUDA device, and the engine on process groups of its own;
* :mod:`.insight` -- publishing this rank's arrival figures, and ``hvd.report()``;
* :mod:`.build` -- what this build supports (``gloo_built()``, ``nccl_built()``, ...).

Layering: the runtime sits above the engine (:mod:`collectives.engine`), which it creates
and hands its process groups, and below the submission layer and the frontends, which ask it
for the running engine. It never imports them (not even ``process_sets``: a frontend's
``hvd.init()``, such as :func:`collectives.torch.mpi_ops.init`, registers those after
:func:`init`). The state is apart from the bootstrap so that other ways of joining a job can
be added without touching the queries.
"""

from __future__ import annotations

from typing import Any

from collectives.runtime.bootstrap import init, reset, shutdown, state_synced
from collectives.runtime.build import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from collectives.runtime.insight import report
from collectives.runtime.registration import HostRemoved
from collectives.runtime.state import (
    RuntimeState,
    Topology,
    backend,
    config,
    cross_rank,
    cross_size,
    cuda_refusal,
    engine,
    generation,
    is_elastic,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    newest_generation,
    rank,
    require,
    size,
    start_timeline,
    started_by,
    stop_timeline,
    timeout,
    topology,
)

#: The job's queries of Horovod's API that every frontend exports, and that Horovod's
#: ``mpi_ops`` modules hold too (``from horovod.torch.mpi_ops import rank``): the frontends'
#: ``mpi_ops`` answer them through :func:`job_query`.
JOB_QUERIES = frozenset(
    {
        "size",
        "rank",
        "local_size",
        "local_rank",
        "cross_size",
        "cross_rank",
        "is_homogeneous",
        "is_initialized",
        "shutdown",
        "start_timeline",
        "stop_timeline",
        "mpi_threads_supported",
        "mpi_built",
        "mpi_enabled",
        "gloo_built",
        "gloo_enabled",
        "nccl_built",
        "ddl_built",
        "ccl_built",
        "cuda_built",
        "rocm_built",
    }
)


def job_query(module: str, name: str) -> Any:
    """``name`` of :data:`JOB_QUERIES` (a module's ``__getattr__``); AttributeError for any
    other name, as for a module without it."""
    if name in JOB_QUERIES:
        return globals()[name]
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


__all__ = [
    "JOB_QUERIES",
    "HostRemoved",
    "RuntimeState",
    "Topology",
    "backend",
    "ccl_built",
    "config",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "cuda_refusal",
    "ddl_built",
    "engine",
    "generation",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_elastic",
    "is_homogeneous",
    "is_initialized",
    "job_query",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "newest_generation",
    "rank",
    "report",
    "require",
    "reset",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "started_by",
    "state_synced",
    "stop_timeline",
    "timeout",
    "topology",
]
