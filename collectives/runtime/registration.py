"""Joining a job through its rendezvous: registration, the default process group over the
rendezvous store, the heartbeat watch and elastic membership generations.

Why it is built this way:

* A worker learns its place in the job by registering with the job's rendezvous server, and
  torch.distributed bootstraps through the rendezvous key-value store, so no
  MASTER_ADDR/port has to be agreed on beforehand.
* A worker must not outlive its job. Registration opens a heartbeat stream to the
  rendezvous; when it is lost (``hvdrun`` was killed, even with -9) the worker stops the
  processes of its own process group and exits.
* Each ``init()`` uses a fresh key prefix in the store: torch's group counters restart after
  ``destroy_process_group`` and would otherwise read the keys of the previous group.
* Elastic jobs (``hvdrun --min-np/--max-np``, ``HVDRUN_ELASTIC=1``) change membership while
  they run: a worker registers for a generation, waits for the launcher's slot table and
  bootstraps fresh process groups under that generation's key prefix ``hvdrun/g<N>/``. A
  bootstrap that fails (a peer died meanwhile, or the launcher published a newer
  generation) moves on to the next generation.

The rendezvous client (and with it gRPC) is imported only here and only when a job has a
rendezvous: a script run alone must not load it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from collectives.errors import HorovodInternalError, JobSetupError
from collectives.runtime.groups import (
    destroy_groups,
    init_default_group,
    select_cuda_device,
    start_engine,
)
from collectives.runtime.reach import (
    HostsProbe,
    connect_failure,
    never_joined,
    warn_unreachable,
)
from collectives.runtime.state import RuntimeState, Topology
from rendezvous import launchers, load_grpc, worker_env

__all__ = [
    "HostRemoved",
    "init_from_rendezvous",
    "join_elastic",
    "register",
    "report_state_synced",
    "watch_and_join",
]

logger = logging.getLogger(__name__)

#: How long a worker keeps dialling a rendezvous that does not answer its first call. The
#: launcher's server is up when a worker starts (its agent reached it), so a failed connection
#: is an overloaded host or network; a server that is gone fails the call after this long.
REGISTER_RETRY_SECONDS = 15.0


class HostRemoved(SystemExit):
    """Elastic jobs: this worker's host is no longer part of the job; the worker exits (0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message


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


def _exit_saying(message: str) -> None:
    """Ends this worker at once, from any thread: says ``message``, stops the processes of
    its own process group and exits (1)."""
    try:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    except Exception:  # stderr may be gone with the launcher
        pass
    try:
        _terminate_own_process_group()
    finally:
        os._exit(1)


def _make_on_lost(runtime: RuntimeState) -> Any:
    def on_lost(reason: str) -> None:
        if runtime.closed.is_set():
            return
        _exit_saying(
            f"hvdrun: rank {runtime.topology.rank} lost its job's rendezvous at "
            f"{runtime.rendezvous_addr} ({reason}); exiting"
        )

    return on_lost


def _elastic_timeout() -> float:
    return worker_env.number(worker_env.ELASTIC_TIMEOUT)


def _register_retrying(
    client: Any, runtime_: RuntimeState, min_generation: int, timeout: float
) -> Any:
    """``client.register``, dialling again for up to :data:`REGISTER_RETRY_SECONDS` while the
    server cannot be reached (registering a slot twice is harmless)."""
    from rendezvous.client import RendezvousUnavailable

    give_up = time.monotonic() + REGISTER_RETRY_SECONDS
    pause = 0.1
    while True:
        try:
            return client.register(runtime_.host, runtime_.slot, min_generation, timeout=timeout)
        except RendezvousUnavailable as error:
            if runtime_.closed.is_set() or time.monotonic() + pause > give_up:
                raise
            logger.info("the rendezvous did not answer (%s); dialling again", error)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


def register(runtime_: RuntimeState, min_generation: int) -> Any:
    """Registers with the rendezvous (elastic jobs: for a generation >= ``min_generation``)
    and takes over the place in the job it assigns; raises :class:`HostRemoved` when the
    launcher removed this worker's host."""
    from rendezvous.client import RendezvousError, RendezvousRemoved, RendezvousUnavailable

    client = runtime_.client
    assert client is not None
    timeout = _elastic_timeout() if runtime_.elastic else 0.0
    try:
        info = _register_retrying(client, runtime_, min_generation, timeout)
    except RendezvousRemoved:
        message = f"host {runtime_.host!r} is no longer part of the job (removed by host discovery)"
        with contextlib.suppress(Exception):  # stderr may be gone with the launcher
            sys.stderr.write(f"hvdrun: leaving the elastic job: {message}\n")
            sys.stderr.flush()
        raise HostRemoved(message) from None
    except RendezvousError as error:
        hint = launchers.beside_hvdrun() if isinstance(error, RendezvousUnavailable) else None
        raise RuntimeError(
            f"hvd.init() could not register with the rendezvous: {error}"
            + (f". Note: {hint}" if hint else "")
        ) from None
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
    # Horovod's variables follow the assignment (an elastic worker's changes with each
    # generation, as Horovod sets them on a reset); HVDRUN_* keep naming the slot this
    # worker was started for, which it registers with.
    os.environ.update(
        worker_env.horovod_placement_env(
            info.rank,
            info.size,
            info.local_rank,
            info.local_size,
            info.cross_rank,
            info.cross_size,
            runtime_.host,
        )
    )
    return info


def _bootstrap(runtime_: RuntimeState, counter: int) -> None:
    """Creates the default process group of the registered generation."""
    from rendezvous.client import RendezvousError, superseded, unset_key
    from rendezvous.store import RendezvousStore

    topology = runtime_.topology
    client = runtime_.client
    assert client is not None
    select_cuda_device(runtime_.backend, topology.local_rank)
    runtime_.store = RendezvousStore(
        client,
        prefix=f"hvdrun/g{runtime_.generation}/i{counter}/",
        timeout=runtime_.timeout,
    )
    probe = None
    if HostsProbe.wanted(topology):
        unreachable = warn_unreachable if runtime_.elastic else _exit_saying
        probe = HostsProbe(runtime_.store, topology, runtime_.host, unreachable)
        probe.start()
    try:
        init_default_group(
            runtime_.backend,
            store=runtime_.store,
            rank=topology.rank,
            world_size=topology.size,
            timeout=runtime_.timeout,
        )
    except (RuntimeError, RendezvousError) as error:
        if superseded(error) is not None:
            raise  # (hosts joined or left meanwhile, not the network: see join_elastic)
        key = unset_key(error)
        late = key and never_joined(topology.rank, key, runtime_.timeout.total_seconds())
        raise (late or connect_failure(topology.rank, topology.size, error)) from None
    finally:
        if probe is not None:
            probe.stop()


def join_elastic(runtime_: RuntimeState) -> None:
    """Bootstraps the registered generation and starts the engine; on failure (a peer died,
    or a newer generation superseded this one) registers for the next generation and tries
    again, until the launcher's elastic timeout or a removal ends it."""
    from rendezvous.client import superseded

    while True:
        try:
            _bootstrap(runtime_, 1)  # one bootstrap per generation: the prefix is unique
            runtime_.engine = start_engine(runtime_)
            return
        except JobSetupError:
            raise  # the job's set-up: no generation can fix it
        except (RuntimeError, HorovodInternalError) as error:
            replaced = superseded(error)
            if replaced is not None:  # (the job's hosts changed while it started: routine)
                logger.info(
                    "rank %d: generation %d was superseded by generation %d "
                    "(hosts joined or left the job); joining that one",
                    runtime_.topology.rank,
                    *replaced,
                )
            else:
                logger.warning(
                    "rank %d could not join generation %d (%s); waiting for the next one",
                    runtime_.topology.rank,
                    runtime_.generation,
                    error,
                )
        destroy_groups()
        register(runtime_, runtime_.generation + 1)


def _report(runtime_: RuntimeState, prefix: str, number: int, what: str) -> bool:
    """Elastic jobs: a number this worker tells hvdrun, in the rendezvous store under
    ``prefix`` and its worker number; whether it was told (not when the job is ending)."""
    from rendezvous.client import RendezvousError

    worker = os.environ.get(worker_env.WORKER, "")
    client = runtime_.client
    if not runtime_.elastic or client is None or not worker.isdigit():
        return False
    try:
        client.set(prefix + worker, str(number).encode())
    except RendezvousError as error:  # the job is ending; the training goes on regardless
        logger.debug("could not report %s: %s", what, error)
        return False
    return True


def _answer_roll(runtime_: RuntimeState) -> Callable[[int], None]:
    """Answers hvdrun's roll calls from the watch thread, which runs while the script is
    busy in its own code (see ``worker_env.PRESENT_KEY_PREFIX``)."""

    def answer(roll: int) -> None:
        _report(runtime_, worker_env.PRESENT_KEY_PREFIX, roll, "the roll call")

    return answer


def report_state_synced(runtime_: RuntimeState) -> None:
    """Elastic jobs: tells hvdrun that this worker holds the training state as of its
    generation (once per generation), in the rendezvous store under its worker number."""
    if runtime_.state_reported == runtime_.generation:
        return
    generation = runtime_.generation
    if _report(runtime_, worker_env.STATE_KEY_PREFIX, generation, "holding the training state"):
        runtime_.state_reported = generation


def init_from_rendezvous(
    addr: str, backend: str, timeout: datetime.timedelta, counter: int
) -> RuntimeState:
    """Under hvdrun: registers with the rendezvous at ``addr``, then :func:`watch_and_join`."""
    # Imported here: the size-1 path must work without the rendezvous (and gRPC) loaded.
    load_grpc()
    from rendezvous.client import RendezvousClient

    # Multi-host jobs: the host's relay (a local Unix socket) carries the calls to the server.
    client = RendezvousClient.from_environment({**os.environ, worker_env.RENDEZVOUS_ADDR: addr})
    addr = client.addr
    runtime_ = RuntimeState(
        topology=Topology(0, 1, 0, 1, 0, 1),
        backend=backend,
        timeout=timeout,
        store=None,
        client=client,
        rendezvous_addr=addr,
        started_by="hvdrun",
        elastic=worker_env.flag(worker_env.ELASTIC),
        host=os.environ.get(worker_env.HOSTNAME) or socket.gethostname(),
        slot=worker_env.integer(worker_env.LOCAL_RANK, 0),
    )
    try:
        min_generation = worker_env.integer(worker_env.GENERATION, 0) if runtime_.elastic else 0
        register(runtime_, min_generation)
        env_rank = os.environ.get(worker_env.RANK)
        if env_rank is not None and env_rank != str(runtime_.topology.rank):
            logger.info(
                "the rendezvous assigned rank %d (HVDRUN_RANK=%s)", runtime_.topology.rank, env_rank
            )
        watch_and_join(runtime_, counter)
        return runtime_
    except BaseException:
        client.close()
        raise


def watch_and_join(runtime_: RuntimeState, counter: int) -> None:
    """For a registered worker: starts the heartbeat watch and (unless the job is elastic:
    :func:`join_elastic` does that) creates the default process group."""
    client = runtime_.client
    assert client is not None
    # Watch before bootstrapping: a launcher that dies while peers are still missing must
    # not leave this worker blocked in the store until the timeout.
    lost_after = worker_env.number(worker_env.RENDEZVOUS_LOST_AFTER_SECONDS)
    client.watch(
        runtime_.topology.rank,
        _make_on_lost(runtime_),
        lost_after=lost_after,
        on_generation=runtime_.saw_generation if runtime_.elastic else None,
        on_roll_call=_answer_roll(runtime_) if runtime_.elastic else None,
    )
    if not runtime_.elastic:
        _bootstrap(runtime_, counter)
