"""Process-wide state of the worker runtime: ``hvd.init()``, ``hvd.shutdown()`` and the
rank queries.

Why it is built this way:

* Under ``hvdrun`` (``HVDRUN_RENDEZVOUS_ADDR`` is set) a worker learns its place in the job
  by registering with the job's rendezvous server, and torch.distributed bootstraps through
  the rendezvous key-value store, so no MASTER_ADDR/port has to be agreed on beforehand.
* Without ``hvdrun`` the script runs as a job of size 1 on a real one-rank Gloo group over an
  in-memory ``HashStore``: every op then takes the same code path as in a real job, so a
  script debugged alone behaves the same under ``hvdrun``.
* A worker must not outlive its job. ``init()`` keeps a heartbeat stream to the rendezvous
  open; when it is lost (``hvdrun`` was killed, even with -9) the worker stops the processes
  of its own process group and exits.
* Each ``init()`` uses a fresh key prefix in the store: torch's group counters restart after
  ``destroy_process_group`` and would otherwise read the keys of the previous group.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from collectives.torch.errors import NotInitializedError

__all__ = [
    "Topology",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
]

logger = logging.getLogger(__name__)

#: How long a collective (and the group's bootstrap) waits for its peers before failing.
DEFAULT_TIMEOUT_SECONDS = 300.0
#: How long the rendezvous heartbeat may stay silent before the job counts as lost.
DEFAULT_LOST_AFTER_SECONDS = 5.0


@dataclass(frozen=True)
class Topology:
    """Where this process sits in the job (Horovod's rank vocabulary)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


@dataclass
class _Runtime:
    topology: Topology
    backend: str
    timeout: datetime.timedelta
    # Both must stay referenced as long as the process group lives: torch's C++ side calls
    # back into the Python store, and the store into the client.
    store: Any
    client: Any | None = None
    rendezvous_addr: str | None = None
    closed: threading.Event = field(default_factory=threading.Event)


_lock = threading.RLock()
_runtime: _Runtime | None = None
_init_count = 0
_atexit_registered = False


def env(name: str, default: str | None = None) -> str | None:
    """A tuning variable, spelled ``HVDRUN_<name>`` or (Horovod's spelling) ``HOROVOD_<name>``."""
    for prefix in ("HVDRUN_", "HOROVOD_"):
        value = os.environ.get(prefix + name)
        if value is not None and value != "":
            return value
    return default


def _float_env(name: str, default: float) -> float:
    raw = env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"HVDRUN_{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"HVDRUN_{name} must be positive, got {raw!r}")
    return value


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def _choose_backend() -> str:
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def _select_cuda_device(backend: str, local_rank_: int) -> None:
    if "nccl" not in backend:
        return
    count = torch.cuda.device_count()
    if local_rank_ < count:
        torch.cuda.set_device(local_rank_)
    else:
        logger.warning(
            "local rank %d has no GPU of its own (%d visible); leaving the CUDA device as is",
            local_rank_,
            count,
        )


def _terminate_own_process_group() -> None:
    """SIGTERMs the other members of this process's group, if this process leads one.

    ``killpg`` would hit this process too and end it by the signal before it can exit with
    status 1, so the members are signalled one by one.
    """
    if not hasattr(os, "getpgrp"):
        return
    me = os.getpid()
    pgid = os.getpgrp()
    if pgid != me:
        return
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        os.killpg(pgid, signal.SIGTERM)
        return
    for proc in psutil.process_iter():
        pid = proc.pid
        if pid == me:
            continue
        try:
            if os.getpgid(pid) == pgid:
                os.kill(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            continue


def _make_on_lost(runtime: _Runtime) -> Any:
    def on_lost(reason: str) -> None:
        if runtime.closed.is_set():
            return
        try:
            sys.stderr.write(
                f"hvdrun: rank {runtime.topology.rank} lost its job's rendezvous at "
                f"{runtime.rendezvous_addr} ({reason}); exiting\n"
            )
            sys.stderr.flush()
        except Exception:  # stderr may be gone with the launcher
            pass
        try:
            _terminate_own_process_group()
        finally:
            os._exit(1)

    return on_lost


def _init_single(backend: str, timeout: datetime.timedelta) -> _Runtime:
    topology = Topology(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    _select_cuda_device(backend, 0)
    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return _Runtime(topology=topology, backend=backend, timeout=timeout, store=store)


def _init_from_rendezvous(
    addr: str, backend: str, timeout: datetime.timedelta, counter: int
) -> _Runtime:
    # Imported here: the size-1 path must work without the rendezvous (and gRPC) loaded.
    from rendezvous.client import RendezvousClient, RendezvousError
    from rendezvous.store import RendezvousStore

    secret = os.environ.get("HVDRUN_SECRET", "")
    job_id = os.environ.get("HVDRUN_JOB_ID", "")
    host = os.environ.get("HVDRUN_HOSTNAME") or socket.gethostname()
    local_rank_ = _int_env("HVDRUN_LOCAL_RANK", 0)

    client = RendezvousClient(addr, secret, job_id)
    try:
        try:
            info = client.register(host, local_rank_)
        except RendezvousError as error:
            raise RuntimeError(
                f"hvd.init() could not register with the rendezvous: {error}"
            ) from None
        topology = Topology(
            rank=info.rank,
            size=info.size,
            local_rank=info.local_rank,
            local_size=info.local_size,
            cross_rank=info.cross_rank,
            cross_size=info.cross_size,
        )
        env_rank = os.environ.get("HVDRUN_RANK")
        if env_rank is not None and env_rank != str(topology.rank):
            logger.info("the rendezvous assigned rank %d (HVDRUN_RANK=%s)", topology.rank, env_rank)
        runtime = _Runtime(
            topology=topology,
            backend=backend,
            timeout=timeout,
            store=None,
            client=client,
            rendezvous_addr=addr,
        )
        # Watch before bootstrapping: a launcher that dies while peers are still missing must
        # not leave this worker blocked in the store until the timeout.
        lost_after = _float_env("RENDEZVOUS_LOST_AFTER_SECONDS", DEFAULT_LOST_AFTER_SECONDS)
        client.watch(topology.rank, _make_on_lost(runtime), lost_after=lost_after)
        _select_cuda_device(backend, topology.local_rank)
        runtime.store = RendezvousStore(
            client, prefix=f"hvdrun/g{info.generation}/i{counter}/", timeout=timeout
        )
        try:
            dist.init_process_group(
                backend,
                store=runtime.store,
                rank=topology.rank,
                world_size=topology.size,
                timeout=timeout,
            )
        except (RuntimeError, RendezvousError) as error:
            raise RuntimeError(
                f"hvd.init() could not connect rank {topology.rank} to its "
                f"{topology.size - 1} peers: {error}"
            ) from None
        return runtime
    except BaseException:
        client.close()
        raise


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initializes the runtime: joins the job started by ``hvdrun`` (or runs as size 1)."""
    global _runtime, _init_count, _atexit_registered
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) is not supported: hvdrun does not use MPI")
    if process_sets is not None:
        raise NotImplementedError("hvd.init(process_sets=...) is not supported yet")
    with _lock:
        if _runtime is not None:
            return
        if not dist.is_available():
            raise RuntimeError("this torch build has no torch.distributed support")
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed already has a default process group; hvd.init() creates "
                "it itself, so do not call torch.distributed.init_process_group() as well"
            )
        timeout = datetime.timedelta(
            seconds=_float_env("GLOO_TIMEOUT_SECONDS", DEFAULT_TIMEOUT_SECONDS)
        )
        backend = _choose_backend()
        _init_count += 1
        addr = os.environ.get("HVDRUN_RENDEZVOUS_ADDR")
        if addr:
            _runtime = _init_from_rendezvous(addr, backend, timeout, _init_count)
        else:
            _runtime = _init_single(backend, timeout)
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        topo = _runtime.topology
        logger.debug(
            "initialized rank %d of %d (local %d/%d, cross %d/%d) with backend %s",
            topo.rank,
            topo.size,
            topo.local_rank,
            topo.local_size,
            topo.cross_rank,
            topo.cross_size,
            backend,
        )


def shutdown() -> None:
    """Destroys the process group and leaves the rendezvous; ``init()`` may be called again."""
    global _runtime
    with _lock:
        runtime = _runtime
        if runtime is None:
            return
        _runtime = None
        runtime.closed.set()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as error:  # tearing down must not mask the user's own exit path
            logger.debug("destroy_process_group failed: %s", error)
        if runtime.client is not None:
            runtime.client.close()


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` not since)."""
    return _runtime is not None


def require(what: str = "this function") -> _Runtime:
    """The live runtime, or :class:`NotInitializedError` naming ``what`` was called too early."""
    runtime = _runtime
    if runtime is None:
        raise NotInitializedError(what)
    return runtime


def topology() -> Topology:
    """This process's place in the job."""
    return require().topology


def size() -> int:
    """Number of processes in the job."""
    return require("hvd.size()").topology.size


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return require("hvd.rank()").topology.rank


def local_size() -> int:
    """Number of processes on this host."""
    return require("hvd.local_size()").topology.local_size


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return require("hvd.local_rank()").topology.local_rank


def cross_size() -> int:
    """Number of hosts that run a process with this process's local rank."""
    return require("hvd.cross_size()").topology.cross_size


def cross_rank() -> int:
    """This host's index among the hosts that run a process with this local rank."""
    return require("hvd.cross_rank()").topology.cross_rank


def mpi_built() -> bool:
    """Whether MPI support is built in (never: hvdrun runs on torch.distributed)."""
    return False


def mpi_enabled() -> bool:
    """Whether MPI is in use (never)."""
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


def backend() -> str:
    """The torch.distributed backend string the default process group was created with."""
    return require().backend


def timeout() -> datetime.timedelta:
    """How long a collective waits for its peers before failing."""
    return require().timeout
