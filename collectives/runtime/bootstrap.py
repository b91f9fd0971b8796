"""Starting and stopping the runtime: ``init()``, ``shutdown()`` and the elastic ``reset()``.

``init()`` decides how this process joins its job and then does what every job does: it
starts the engine on process groups of its own (:mod:`.groups`) and installs the runtime
(:mod:`.state`).

* Under ``hvdrun`` (``HVDRUN_RENDEZVOUS_ADDR`` is set) the worker joins through the job's
  rendezvous (:mod:`.registration`).
* Started by another launcher (srun, mpirun, jsrun, torchrun, a Kubernetes operator: see
  :mod:`rendezvous.launchers`) it joins through a rendezvous that rank 0 serves
  (:mod:`.launched`), and from registration on everything is the same.
* Where ``torch.distributed`` already has a default process group (Lightning, Accelerate,
  Ray Train, a torchrun script that called ``init_process_group()``) it joins that group's
  job and leaves the group to its owner at shutdown (:mod:`.adopted`).
* Started by no one the script runs as a job of size 1 on a real one-rank Gloo group over an
  in-memory ``HashStore``: every op then takes the same code path as in a real job, so a
  script debugged alone behaves the same under ``hvdrun``. A process whose launcher says it
  has peers never falls back to that silently: :func:`init` raises instead.

The default torch process group keeps a longer timeout than the engine's groups, because it
also bootstraps the job while slow workers are still starting.

:func:`reset` is for elastic jobs: it leaves the current membership generation without
waiting on dead peers (the engine is stopped, its process groups destroyed) and joins the
next one. ``collectives.torch.elastic.run`` calls it; user code need not.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import threading
from typing import Any

import torch.distributed as dist

from collectives.engine import config as config_module
from collectives.engine.cycle import FINAL_CYCLE_SECONDS
from collectives.engine.leaving import NEXT_GENERATION
from collectives.runtime import exits, insight, logs, state
from collectives.runtime.adopted import init_adopted
from collectives.runtime.groups import (
    check_interfaces,
    choose_backend,
    init_default_group,
    keep_nccl_off_the_store,
    select_cuda_device,
    start_engine,
    stop_collectives,
)
from collectives.runtime.launched import detect_placement, init_launched
from collectives.runtime.reach import out_of_threads
from collectives.runtime.registration import (
    init_from_rendezvous,
    join_elastic,
    register,
    report_state_synced,
)
from collectives.runtime.state import RuntimeState, Topology
from rendezvous import worker_env

__all__ = ["BOOTSTRAP_TIMEOUT_SECONDS", "init", "reset", "shutdown", "state_synced"]

logger = logging.getLogger(__name__)

#: How long the job's bootstrap (the default group) waits for slow peers to start.
BOOTSTRAP_TIMEOUT_SECONDS = 300.0

# init(), shutdown() and reset() run one at a time.
_lock = threading.RLock()
_init_count = 0
_atexit_registered = False
#: Set in the environment of a process that joined a job of several, for its children to
#: see: "PID RANK JOB". A child (forked, spawned or started by subprocess) inherits the
#: launcher's variables too, and its ``init()`` would register for its parent's slot: under
#: hvdrun it waited for peers that never came, without a word.
JOINED_VARIABLE = "HVDRUN_JOINED_PROCESS"


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker, ...) keeps its parent's runtime for the rank
    queries (``state.engine()`` refuses its collectives, ``state.inherited()`` names it),
    and gets a fresh lock: a thread of the parent that held it at the fork does not exist
    here to release it."""
    global _lock
    _lock = threading.RLock()


def _refuse_in_a_forked_child() -> None:
    """The inherited runtime's torch default group is the parent's too: an ``init()`` here
    would adopt it and talk over the parent's sockets."""
    parent = state.inherited()
    if parent is not None and parent.topology.size > 1:
        raise RuntimeError(
            f"hvd.init() in process {os.getpid()}, forked from rank {parent.topology.rank}'s "
            f"process (pid {parent.pid}) after its hvd.init(): a forked child cannot join the "
            "job in its parent's place; run the collectives in the parent"
        )


os.register_at_fork(after_in_child=_after_fork_in_child)


def _mark_joined(runtime_: RuntimeState, job: str) -> None:
    os.environ[JOINED_VARIABLE] = f"{os.getpid()} {runtime_.topology.rank} {job}"


def _unmark_joined() -> None:
    if os.environ.get(JOINED_VARIABLE, "").split(" ", 1)[0] == str(os.getpid()):
        del os.environ[JOINED_VARIABLE]


def _refuse_a_ranks_child(job: str) -> None:
    """Raises where a live ancestor of this process has joined ``job`` already (see
    :data:`JOINED_VARIABLE`)."""
    pid_text, _, rest = os.environ.get(JOINED_VARIABLE, "").partition(" ")
    rank_text, _, joined_job = rest.partition(" ")
    if joined_job != job or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return  # (a mark left by a process that is gone)
    except PermissionError:
        pass
    how = (
        "run the collectives in the parent, or call hvd.shutdown() in the parent before "
        "starting the child"
    )
    if _in_a_spawned_scripts_top_level():
        how = (
            "this child runs the script's top level again (multiprocessing's spawn and "
            "forkserver start methods import it, a DataLoader's with multiprocessing_context="
            "'spawn' too): put the training under if __name__ == '__main__':"
        )
    raise RuntimeError(
        f"hvd.init() in process {os.getpid()}, a child of rank {rank_text}'s process "
        f"(pid {pid_text}), which has joined this job already: a child process (a DataLoader "
        "worker, multiprocessing, torch.multiprocessing.spawn, subprocess) cannot join the "
        f"job in its parent's place; {how}"
    )


def _in_a_spawned_scripts_top_level() -> bool:
    """Whether this call comes from the top level of the job's script that multiprocessing's
    spawn is importing again (as ``__mp_main__``) in a child, rather than from a function
    the child was told to run."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _init_single(backend: str, timeout: datetime.timedelta) -> RuntimeState:
    topology = Topology(rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    select_cuda_device(backend, 0)
    store = dist.HashStore()
    init_default_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return RuntimeState(topology=topology, backend=backend, timeout=timeout, store=store)


def _rank_hint() -> int | None:
    """This worker's rank for its log lines, where its launcher already says it."""
    text = os.environ.get(worker_env.RANK) or os.environ.get(worker_env.TORCH_RANK)
    return int(text) if text and text.isdigit() else None


def init(comm: Any = None) -> bool:
    """Initializes the runtime: joins the job started by ``hvdrun``, another launcher or a
    framework's default process group (or runs as size 1).

    Returns whether this call initialized it (False: it already was). ``hvd.init()``
    (:func:`collectives.torch.mpi_ops.init`) calls it and then registers the process sets
    it was given: process sets are API above the runtime, which does not import them. A
    process that cannot start the threads it needs is told which limits to look at.
    """
    try:
        return _init(comm)
    except RuntimeError as error:
        starved = out_of_threads(error)
        if starved is not None:
            raise starved from error
        raise


def _init(comm: Any) -> bool:
    global _init_count, _atexit_registered
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) is not supported: hvdrun does not use MPI")
    with _lock:
        if state.current() is not None:
            return False
        _refuse_in_a_forked_child()
        if not dist.is_available():
            raise RuntimeError("this torch build has no torch.distributed support")
        adopting = dist.is_initialized()
        logs.configure_from_environment(dist.get_rank() if adopting else _rank_hint())
        cfg = config_module.from_environment()
        timeout = datetime.timedelta(
            seconds=max(BOOTSTRAP_TIMEOUT_SECONDS, cfg.collective_timeout_seconds)
        )
        backend = choose_backend()
        _init_count += 1
        addr = os.environ.get(worker_env.RENDEZVOUS_ADDR)
        placement = None if addr or adopting else detect_placement()
        job = f"{addr} {os.environ.get(worker_env.JOB_ID, '')}" if addr else ""
        if placement is not None and placement.size > 1:
            job = placement.job_key
        if job and not adopting:
            _refuse_a_ranks_child(job)
        if not adopting:  # (a framework's default group has a store of its own)
            keep_nccl_off_the_store(backend)
            check_interfaces()
        if adopting:
            runtime_ = init_adopted(backend)
        elif addr:
            runtime_ = init_from_rendezvous(addr, backend, timeout, _init_count)
        elif placement is not None and placement.size > 1:
            runtime_ = init_launched(placement, backend, timeout, _init_count)
        else:
            runtime_ = _init_single(backend, timeout)
            runtime_.started_by = placement.name if placement is not None else ""
        runtime_.config = cfg
        try:
            if runtime_.elastic:
                join_elastic(runtime_)
            else:
                runtime_.engine = start_engine(runtime_)
        except BaseException:
            _teardown(runtime_)
            raise
        state.set_current(runtime_)
        if job and not adopting:
            _mark_joined(runtime_, job)
        insight.start(runtime_)
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
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


def _teardown(runtime_: RuntimeState, failure: str = "") -> None:
    runtime_.closed.set()
    _unmark_joined()
    engine_ = runtime_.engine
    stop_collectives(runtime_, FINAL_CYCLE_SECONDS + 2.0, failure)
    _say_who_ended(runtime_, engine_)
    insight.finish(runtime_, engine_)  # (its last figures, before the store goes)
    if runtime_.leave is not None:
        runtime_.leave()
    elif runtime_.client is not None:
        runtime_.client.close()


def _say_who_ended(runtime_: RuntimeState, engine_: Any) -> None:
    """Tells hvdrun which rank's leaving ended this rank's collectives, if another's did
    (see ``worker_env.ENDED_BY_KEY_PREFIX``), or which rank held them up until the stall
    inspector stopped them (``STALLED_BY_KEY_PREFIX``): this rank may now fail because of
    it, and may be heard of first. Fixed jobs of hvdrun only (elastic jobs recover instead)."""
    if engine_ is None or runtime_.client is None or runtime_.elastic:
        return
    ended_by, stalled_by = engine_.ended_by(), engine_.stalled_by()
    rank = str(runtime_.topology.rank)
    try:
        if ended_by is not None:
            runtime_.client.set(worker_env.ENDED_BY_KEY_PREFIX + rank, str(ended_by).encode())
        if stalled_by is not None:
            value = f"{stalled_by[0]}\n{stalled_by[1]}"
            runtime_.client.set(worker_env.STALLED_BY_KEY_PREFIX + rank, value.encode())
    except Exception as error:  # the rendezvous may be gone with a failed job
        logger.debug("could not say which rank ended the collectives: %s", error)


def reset(why: str = "") -> None:
    """Elastic jobs: leaves this membership generation and joins the next one (``why``: what
    made it, which peers still in the generation's collectives are told).

    Does not wait on dead peers: after a failure the engine has stopped already, and after
    a host update every rank calls this together. Raises
    :class:`~collectives.runtime.registration.HostRemoved` (exit 0) when the launcher
    removed this worker's host from the job.
    """
    with _lock:
        runtime_ = state.require("collectives.torch.elastic reset")
        if not runtime_.elastic:
            raise RuntimeError(
                "elastic reset needs an elastic job: start it with hvdrun --min-np N (or "
                "--host-discovery-script)"
            )
        # Shorter than at shutdown: a peer that is gone must not delay the recovery.
        engine_ = runtime_.engine
        leaving = f"{NEXT_GENERATION} ({why})" if why else NEXT_GENERATION
        stop_collectives(runtime_, FINAL_CYCLE_SECONDS + 1.0, leaving)
        if engine_ is not None and runtime_.insight is not None:
            runtime_.insight.engine_stopped(engine_)  # (the next engine's figures add up)
        try:
            register(runtime_, runtime_.generation + 1)
            join_elastic(runtime_)
        except BaseException:
            state.set_current(None)
            _teardown(runtime_)
            raise


def state_synced() -> None:
    """Elastic jobs: this worker now holds the job's training state (synced in this
    generation, or kept from the last one). hvdrun never starts a generation from workers
    that hold none; a frontend's ``elastic.run`` calls this once the state is in place."""
    with _lock:
        runtime_ = state.current()
        if runtime_ is not None:
            report_state_synced(runtime_)


def shutdown() -> None:
    """Stops the collectives (on every rank: a job's collectives end when one rank leaves),
    destroys the process groups it made (a framework's default group stays) and leaves the
    rendezvous; ``init()`` may be called again."""
    _shutdown(failure="")


def _shutdown(failure: str) -> None:
    """:func:`shutdown`; ``failure``: how this rank's script failed, which the other
    ranks are told ("" when it did not)."""
    with _lock:
        runtime_ = state.current()
        if runtime_ is None:
            return
        state.set_current(None)
        if runtime_.pid != os.getpid():
            # A forked child forgets its parent's runtime: the engine, its sockets and the
            # rendezvous connection are the parent's, which goes on using them.
            logger.debug("not shutting down the runtime of pid %d in a forked child", runtime_.pid)
            return
        _teardown(runtime_, failure)


def _shutdown_at_exit() -> None:
    """The interpreter exits without hvd.shutdown(): the other ranks learn how this rank's
    script ended, when it failed (an uncaught exception: see :mod:`.exits`)."""
    _shutdown(failure=exits.describe())
