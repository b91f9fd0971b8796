"""The live runtime of this process and the questions asked of it: ``hvd.rank()``,
``hvd.size()``, ..., the running engine, its configuration and its timeline.

One :class:`RuntimeState` exists between ``hvd.init()`` and ``hvd.shutdown()``; the
bootstrap (:mod:`.bootstrap`) creates it and installs it here with :func:`set_current`.
Everything else only reads it: the queries raise ``NotInitializedError`` naming the function
that was called too early.

This module knows nothing of how a process joins its job (the rendezvous, another launcher's
variables, a job of size 1), so the ways of joining can change without touching the
questions. It also hands :func:`size` and :func:`rank` to :mod:`collectives.common`
when imported, so process sets answer ``size()``/``rank()`` without importing the runtime.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from collectives import common
from collectives.engine import timeline
from collectives.engine.config import EngineConfig
from collectives.engine.core import Engine
from collectives.errors import NotInitializedError

__all__ = [
    "RuntimeState",
    "Topology",
    "backend",
    "config",
    "cross_rank",
    "cross_size",
    "cuda_refusal",
    "current",
    "engine",
    "generation",
    "is_elastic",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "newest_generation",
    "rank",
    "require",
    "set_current",
    "size",
    "start_timeline",
    "started_by",
    "stop_timeline",
    "timeout",
    "topology",
]


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
class RuntimeState:
    """Everything ``hvd.init()`` set up in this process, until ``hvd.shutdown()``."""

    topology: Topology
    backend: str
    timeout: datetime.timedelta
    # Both must stay referenced as long as the process group lives: torch's C++ side calls
    # back into the Python store, and the store into the client.
    store: Any
    client: Any | None = None
    rendezvous_addr: str | None = None
    closed: threading.Event = field(default_factory=threading.Event)
    #: Who started this process, in words ("hvdrun", "Slurm (srun)", ...; "" when no one).
    started_by: str = ""
    #: How this process leaves its job at shutdown; None: by closing the client.
    leave: Callable[[], None] | None = None
    config: EngineConfig = field(default_factory=EngineConfig)
    engine: Engine | None = None
    # Elastic jobs: the membership generation this process is part of, the newest one the
    # rendezvous announced, and the slot this process registers with.
    elastic: bool = False
    generation: int = 0
    newest_generation: int = 0
    host: str = ""
    slot: int = 0
    #: Elastic jobs: the generation this worker last told hvdrun it holds the training
    #: state in (-1: never).
    state_reported: int = -1
    #: The default process group is a framework's (:mod:`.adopted`): shutdown leaves it be.
    adopted: bool = False
    #: The process groups the engine runs on, which shutdown destroys where the default
    #: group is not this runtime's to destroy.
    own_groups: list[Any] = field(default_factory=list)
    #: Why CUDA tensors cannot be reduced in this job (ranks that would share a GPU under
    #: NCCL); None where they can. Every rank holds the same verdict.
    cuda_refusal: str | None = None
    #: What publishes this rank's arrival figures (``collectives.runtime.insight``).
    insight: Any = None
    #: The process that joined the job. A child forked from it (a DataLoader worker, a
    #: ``multiprocessing`` fork, ``os.fork()``) inherits this object but none of the engine's
    #: threads, and shares its sockets: it may ask the rank queries, never run collectives.
    pid: int = field(default_factory=os.getpid)

    def saw_generation(self, generation: int) -> None:
        if generation > self.newest_generation:
            self.newest_generation = generation


_current: RuntimeState | None = None
#: In a process forked from one whose runtime was live: that runtime (its engine, sockets
#: and rendezvous connection are the parent's). None in the process that joined, so the
#: check of every op for an inherited runtime costs no system call there.
_inherited: RuntimeState | None = None


def _after_fork_in_child() -> None:
    global _inherited
    if _current is not None:
        _inherited = _current


os.register_at_fork(after_in_child=_after_fork_in_child)


def inherited() -> RuntimeState | None:
    """The runtime this process inherited from the parent it was forked from, if any."""
    return _inherited


def current() -> RuntimeState | None:
    """The live runtime, or None before ``init()`` and after ``shutdown()``."""
    return _current


def set_current(state: RuntimeState | None) -> None:
    """Installs the runtime that ``init()`` built (None: it was shut down)."""
    global _current, _last_place
    if _current is not None:  # (an elastic reset's or a shutdown's predecessor)
        _last_place = _place_of(_current)
    _current = state


#: (rank, size, generation) of the runtime this process had last, kept after ``shutdown()``
#: forgets the runtime itself (see last_place).
_last_place: tuple[int, int, int] | None = None


def _place_of(runtime: RuntimeState) -> tuple[int, int, int]:
    return runtime.topology.rank, runtime.topology.size, runtime.generation


def last_place() -> tuple[int, int, int] | None:
    """(rank, size, generation) of the live runtime, or of the last one after
    ``shutdown()``; None before any ``init()``. ``hvdrun.run``'s worker places its
    function's result by it (:mod:`collectives.run_task`)."""
    return _place_of(_current) if _current is not None else _last_place


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` not since)."""
    return _current is not None


def require(what: str = "this function") -> RuntimeState:
    """The live runtime, or :class:`NotInitializedError` naming ``what`` was called too early."""
    runtime = _current
    if runtime is None:
        raise NotInitializedError(what, shut_down=_last_place is not None)
    return runtime


def started_by() -> str:
    """Who started this process ("hvdrun", "Slurm (srun)", ...; "" when it runs alone)."""
    return require("started_by()").started_by


def topology() -> Topology:
    """This process's place in the job."""
    return require().topology


def size() -> int:
    """Number of processes in the job."""
    return require("hvd.size()").topology.size


def rank() -> int:
    """This process's rank, 0 .. size()-1."""
    return require("hvd.rank()").topology.rank


# Process sets answer size() and rank() through these queries (common is a leaf and does
# not import the runtime).
common.bind_job(size=size, rank=rank)


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


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    topo = require("hvd.is_homogeneous()").topology
    return topo.size == topo.local_size * topo.cross_size


def generation() -> int:
    """Elastic jobs: the membership generation this process is part of (0 otherwise)."""
    return require("generation()").generation


def newest_generation() -> int:
    """Elastic jobs: the newest membership generation the rendezvous has announced."""
    return require("newest_generation()").newest_generation


def is_elastic() -> bool:
    """Whether this process runs in an elastic job."""
    return require("is_elastic()").elastic


def backend() -> str:
    """The torch.distributed backend string the default process group was created with."""
    return require().backend


def cuda_refusal() -> str | None:
    """Why this job's collectives refuse CUDA tensors (ranks sharing a GPU under NCCL), or
    None (also before ``init()``: the op then fails on that)."""
    runtime = _current
    return None if runtime is None else runtime.cuda_refusal


def timeout() -> datetime.timedelta:
    """How long a collective waits for its peers before failing."""
    return datetime.timedelta(seconds=require().config.collective_timeout_seconds)


def config() -> EngineConfig:
    """The engine's tuning (from HVDRUN_*/HOROVOD_* variables at ``init()``)."""
    return require().config


def engine(what: str = "this function") -> Engine:
    """The running engine, or :class:`NotInitializedError` naming ``what``; a RuntimeError
    in a process forked from the one that joined the job."""
    runtime = require(what)
    if _inherited is not None and runtime.pid != os.getpid():
        raise RuntimeError(_forked_child_message(what, runtime))
    engine_ = runtime.engine
    if engine_ is None:
        raise NotInitializedError(what)
    return engine_


def _forked_child_message(what: str, runtime: RuntimeState) -> str:
    """Why ``what`` cannot run in a process forked from a rank of the job."""
    return (
        f"{what} was called in process {os.getpid()}, which was forked from rank "
        f"{runtime.topology.rank} (pid {runtime.pid}) after hvd.init(): a forked child (a "
        "DataLoader worker, a multiprocessing 'fork' process, os.fork()) is not part of the "
        "job and cannot run its collectives (hvd.rank(), hvd.size() and the other queries "
        "still answer for its parent); run them in the process that called hvd.init()"
    )


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing a Chrome-trace timeline (rank 0; every rank if the path has
    ``{rank}`` or the job runs with ``--timeline-all-ranks``), replacing one being written:
    that one is completed first (the new one may be the same file)."""
    runtime_ = require("hvd.start_timeline()")
    engine_ = engine("hvd.start_timeline()")
    all_ranks = runtime_.config.timeline_all_ranks
    stop_timeline()
    engine_.timeline = timeline.open_for_rank(
        file_path, mark_cycles, engine_.rank, all_ranks, runtime_.host
    )


def stop_timeline() -> None:
    """Stops the timeline and completes its file."""
    engine_ = engine("hvd.stop_timeline()")
    old, engine_.timeline = engine_.timeline, None
    if old is not None:
        old.close()
