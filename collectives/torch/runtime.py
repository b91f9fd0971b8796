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
* The default torch process group stays the user's: the collectives engine
  (:mod:`collectives.torch.engine`) runs on groups of its own (a Gloo group for negotiation,
  one data group per process set), so a script may still call ``torch.distributed``
  directly without its collectives interleaving with the engine's. Those groups wait at
  most ``HVDRUN_GLOO_TIMEOUT_SECONDS`` (30) for a peer; the default group keeps a longer
  timeout because it also bootstraps the job while slow workers are still starting.
* Elastic jobs (``hvdrun --min-np/--max-np``, ``HVDRUN_ELASTIC=1``) change membership while
  they run. :func:`reset` leaves the current membership generation without waiting on dead
  peers (the engine is stopped, its process groups destroyed) and joins the next one: it
  registers again, waits for the launcher's next slot table and bootstraps fresh process
  groups under that generation's key prefix ``hvdrun/g<N>/``. A bootstrap that fails (a peer
  died meanwhile, or the launcher published a newer generation) moves on to the next
  generation. ``collectives.torch.elastic.run`` calls it; user code need not.
"""

from __future__ import annotations

import atexit
import contextlib
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

from collectives.torch import common
from collectives.torch.engine import config as config_module
from collectives.torch.engine import timeline
from collectives.torch.engine.config import EngineConfig
from collectives.torch.engine.core import FINAL_CYCLE_SECONDS, Engine
from collectives.torch.errors import HorovodInternalError, NotInitializedError
from rendezvous import worker_env

__all__ = [
    "Topology",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]

logger = logging.getLogger(__name__)

#: How long the job's bootstrap (the default group) waits for slow peers to start.
BOOTSTRAP_TIMEOUT_SECONDS = 300.0
#: How long the rendezvous heartbeat may stay silent before the job counts as lost.
DEFAULT_LOST_AFTER_SECONDS = 5.0
#: Elastic jobs: how long a worker waits for the launcher's next membership generation.
DEFAULT_ELASTIC_TIMEOUT_SECONDS = 600.0


class HostRemoved(SystemExit):
    """Elastic jobs: this worker's host is no longer part of the job; the worker exits (0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message


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
    config: EngineConfig = field(default_factory=EngineConfig)
    engine: Engine | None = None
    # Elastic jobs: the membership generation this process is part of, the newest one the
    # rendezvous announced, and the slot this process registers with.
    elastic: bool = False
    generation: int = 0
    newest_generation: int = 0
    host: str = ""
    slot: int = 0

    def saw_generation(self, generation: int) -> None:
        if generation > self.newest_generation:
            self.newest_generation = generation


_lock = threading.RLock()
_runtime: _Runtime | None = None
_init_count = 0
_atexit_registered = False


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


def _elastic_timeout() -> float:
    return worker_env.number(
        worker_env.ELASTIC_TIMEOUT, DEFAULT_ELASTIC_TIMEOUT_SECONDS, minimum=0.0, strict=True
    )


def _register(runtime_: _Runtime, min_generation: int) -> Any:
    from rendezvous.client import RendezvousError, RendezvousRemoved

    client = runtime_.client
    assert client is not None
    timeout = _elastic_timeout() if runtime_.elastic else 0.0
    try:
        info = client.register(runtime_.host, runtime_.slot, min_generation, timeout=timeout)
    except RendezvousRemoved:
        message = f"host {runtime_.host!r} is no longer part of the job (removed by host discovery)"
        with contextlib.suppress(Exception):  # stderr may be gone with the launcher
            sys.stderr.write(f"hvdrun: leaving the elastic job: {message}\n")
            sys.stderr.flush()
        raise HostRemoved(message) from None
    except RendezvousError as error:
        raise RuntimeError(f"hvd.init() could not register with the rendezvous: {error}") from None
    runtime_.topology = Topology(
        rank=info.rank,
        size=info.size,
        local_rank=info.local_rank,
        local_size=info.local_size,
        cross_rank=info.cross_rank,
        cross_size=info.cross_size,
    )
    runtime_.generation = info.generation
    runtime_.saw_generation(info.generation)
    return info


def _bootstrap(runtime_: _Runtime, counter: int) -> None:
    """Creates the default process group of the registered generation."""
    from rendezvous.client import RendezvousError
    from rendezvous.store import RendezvousStore

    topology = runtime_.topology
    client = runtime_.client
    assert client is not None
    _select_cuda_device(runtime_.backend, topology.local_rank)
    runtime_.store = RendezvousStore(
        client,
        prefix=f"hvdrun/g{runtime_.generation}/i{counter}/",
        timeout=runtime_.timeout,
    )
    try:
        dist.init_process_group(
            runtime_.backend,
            store=runtime_.store,
            rank=topology.rank,
            world_size=topology.size,
            timeout=runtime_.timeout,
        )
    except (RuntimeError, RendezvousError) as error:
        raise RuntimeError(
            f"hvd.init() could not connect rank {topology.rank} to its "
            f"{topology.size - 1} peers: {error}"
        ) from None


def _destroy_groups() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as error:  # the groups may be broken already
        logger.debug("destroy_process_group failed: %s", error)


def _join_elastic(runtime_: _Runtime) -> None:
    """Bootstraps the registered generation and starts the engine; on failure (a peer died,
    or a newer generation superseded this one) registers for the next generation and tries
    again, until the launcher's elastic timeout or a removal ends it."""
    while True:
        try:
            _bootstrap(runtime_, 1)  # one bootstrap per generation: the prefix is unique
            runtime_.engine = _start_engine(runtime_)
            return
        except (RuntimeError, HorovodInternalError) as error:
            logger.warning(
                "rank %d could not join generation %d (%s); waiting for the next one",
                runtime_.topology.rank,
                runtime_.generation,
                error,
            )
        _destroy_groups()
        _register(runtime_, runtime_.generation + 1)


def _init_from_rendezvous(
    addr: str, backend: str, timeout: datetime.timedelta, counter: int
) -> _Runtime:
    # Imported here: the size-1 path must work without the rendezvous (and gRPC) loaded.
    from rendezvous.client import RendezvousClient

    secret = os.environ.get(worker_env.SECRET, "")
    job_id = os.environ.get(worker_env.JOB_ID, "")
    client = RendezvousClient(addr, secret, job_id)
    runtime_ = _Runtime(
        topology=Topology(0, 1, 0, 1, 0, 1),
        backend=backend,
        timeout=timeout,
        store=None,
        client=client,
        rendezvous_addr=addr,
        elastic=worker_env.flag(worker_env.ELASTIC),
        host=os.environ.get(worker_env.HOSTNAME) or socket.gethostname(),
        slot=worker_env.integer(worker_env.LOCAL_RANK, 0),
    )
    try:
        min_generation = worker_env.integer(worker_env.GENERATION, 0) if runtime_.elastic else 0
        _register(runtime_, min_generation)
        topology = runtime_.topology
        env_rank = os.environ.get(worker_env.RANK)
        if env_rank is not None and env_rank != str(topology.rank):
            logger.info("the rendezvous assigned rank %d (HVDRUN_RANK=%s)", topology.rank, env_rank)
        # Watch before bootstrapping: a launcher that dies while peers are still missing must
        # not leave this worker blocked in the store until the timeout.
        lost_after = worker_env.number(
            worker_env.RENDEZVOUS_LOST_AFTER_SECONDS, DEFAULT_LOST_AFTER_SECONDS, strict=True
        )
        client.watch(
            topology.rank,
            _make_on_lost(runtime_),
            lost_after=lost_after,
            on_generation=runtime_.saw_generation if runtime_.elastic else None,
        )
        if not runtime_.elastic:
            _bootstrap(runtime_, counter)
        return runtime_
    except BaseException:
        client.close()
        raise


def _start_engine(runtime_: _Runtime) -> Engine:
    """Creates the engine's own process groups (on every rank, same order) and starts it."""
    topo, cfg = runtime_.topology, runtime_.config
    timeout = datetime.timedelta(seconds=cfg.collective_timeout_seconds)
    everyone = list(range(topo.size))
    control = dist.new_group(everyone, backend="gloo", timeout=timeout)
    data = dist.new_group(everyone, backend=runtime_.backend, timeout=timeout)

    def make_group(ranks: list[int]) -> Any:
        return dist.new_group(ranks, backend=runtime_.backend, timeout=timeout)

    def destroy_group(group: Any) -> None:
        if isinstance(group, dist.ProcessGroup):
            dist.destroy_process_group(group)

    engine = Engine(
        rank=topo.rank,
        size=topo.size,
        config=cfg,
        control_group=control,
        global_group=data,
        make_group=make_group,
        destroy_group=destroy_group,
        cuda_device=torch.cuda.current_device() if "nccl" in runtime_.backend else None,
    )
    if cfg.timeline:
        engine.timeline = timeline.open_for_rank(cfg.timeline, cfg.timeline_mark_cycles, topo.rank)
    engine.start()
    return engine


def init(comm: Any = None) -> bool:
    """Initializes the runtime: joins the job started by ``hvdrun`` (or runs as size 1).

    Returns whether this call initialized it (False: it already was). ``hvd.init()``
    (:func:`collectives.torch.mpi_ops.init`) calls it and then registers the process sets
    it was given: process sets are API above the runtime, which does not import them.
    """
    global _runtime, _init_count, _atexit_registered
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) is not supported: hvdrun does not use MPI")
    with _lock:
        if _runtime is not None:
            return False
        if not dist.is_available():
            raise RuntimeError("this torch build has no torch.distributed support")
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed already has a default process group; hvd.init() creates "
                "it itself, so do not call torch.distributed.init_process_group() as well"
            )
        cfg = config_module.from_environment()
        timeout = datetime.timedelta(
            seconds=max(BOOTSTRAP_TIMEOUT_SECONDS, cfg.collective_timeout_seconds)
        )
        backend = _choose_backend()
        _init_count += 1
        addr = os.environ.get(worker_env.RENDEZVOUS_ADDR)
        if addr:
            runtime_ = _init_from_rendezvous(addr, backend, timeout, _init_count)
        else:
            runtime_ = _init_single(backend, timeout)
        runtime_.config = cfg
        try:
            if runtime_.elastic:
                _join_elastic(runtime_)
            else:
                runtime_.engine = _start_engine(runtime_)
        except BaseException:
            _teardown(runtime_)
            raise
        _runtime = runtime_
        if not _atexit_registered:
            atexit.register(shutdown)
            _atexit_registered = True
        topo = runtime_.topology
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
    return True


def _stop_collectives(runtime_: _Runtime, timeout: float) -> None:
    """Stops the engine (waiting at most ``timeout`` for its last cycle) and destroys the
    process groups; the rendezvous connection stays."""
    engine_, runtime_.engine = runtime_.engine, None
    if engine_ is not None:
        engine_.stop(timeout=timeout)
    _destroy_groups()


def _teardown(runtime_: _Runtime) -> None:
    runtime_.closed.set()
    _stop_collectives(runtime_, FINAL_CYCLE_SECONDS + 2.0)
    if runtime_.client is not None:
        runtime_.client.close()


def reset() -> None:
    """Elastic jobs: leaves this membership generation and joins the next one.

    Does not wait on dead peers: after a failure the engine has stopped already, and after
    a host update every rank calls this together. Raises :class:`HostRemoved` (exit 0)
    when the launcher removed this worker's host from the job.
    """
    global _runtime
    with _lock:
        runtime_ = require("collectives.torch.elastic reset")
        if not runtime_.elastic:
            raise RuntimeError(
                "elastic reset needs an elastic job: start it with hvdrun --min-np/--max-np"
            )
        # Shorter than at shutdown: a peer that is gone must not delay the recovery.
        _stop_collectives(runtime_, FINAL_CYCLE_SECONDS + 1.0)
        try:
            _register(runtime_, runtime_.generation + 1)
            _join_elastic(runtime_)
        except BaseException:
            _runtime = None
            _teardown(runtime_)
            raise


def generation() -> int:
    """Elastic jobs: the membership generation this process is part of (0 otherwise)."""
    return require("generation()").generation


def newest_generation() -> int:
    """Elastic jobs: the newest membership generation the rendezvous has announced."""
    return require("newest_generation()").newest_generation


def is_elastic() -> bool:
    """Whether this process runs in an elastic job."""
    return require("is_elastic()").elastic


def shutdown() -> None:
    """Stops the collectives (on every rank: a job's collectives end when one rank leaves),
    destroys the process groups and leaves the rendezvous; ``init()`` may be called again."""
    global _runtime
    with _lock:
        runtime_ = _runtime
        if runtime_ is None:
            return
        _runtime = None
        _teardown(runtime_)


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


# Process sets answer size() and rank() through these queries (common is a leaf and does
# not import the runtime).
common.bind_job(size=size, rank=rank)


def mpi_built() -> bool:
    """Whether MPI support is built in (never: hvdrun runs on torch.distributed)."""
    return False


def mpi_enabled() -> bool:
    """Whether MPI is in use (never)."""
    return False


def mpi_threads_supported() -> bool:
    """Whether MPI multi-threading is supported (no MPI: ops may come from any thread)."""
    return False


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    topo = require("hvd.is_homogeneous()").topology
    return topo.size == topo.local_size * topo.cross_size


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
    return datetime.timedelta(seconds=require().config.collective_timeout_seconds)


def config() -> EngineConfig:
    """The engine's tuning (from HVDRUN_*/HOROVOD_* variables at ``init()``)."""
    return require().config


def engine(what: str = "this function") -> Engine:
    """The running engine, or :class:`NotInitializedError` naming ``what``."""
    engine_ = require(what).engine
    if engine_ is None:
        raise NotInitializedError(what)
    return engine_


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing a Chrome-trace timeline (rank 0; every rank if the path has
    ``{rank}``), replacing one being written."""
    engine_ = engine("hvd.start_timeline()")
    new = timeline.open_for_rank(file_path, mark_cycles, engine_.rank)
    old, engine_.timeline = engine_.timeline, new
    if old is not None:
        old.close()


def stop_timeline() -> None:
    """Stops the timeline and completes its file."""
    engine_ = engine("hvd.stop_timeline()")
    old, engine_.timeline = engine_.timeline, None
    if old is not None:
        old.close()
