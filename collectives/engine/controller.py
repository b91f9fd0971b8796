"""One process set's negotiation on this rank: its queue, its cycles and their thread.

Each registered process set this rank belongs to has a :class:`Controller` (Horovod has one
per process set too): the set's members negotiate and run its ops among themselves, on Gloo
and data groups of the set's own, so an op on a set never waits for a rank outside it.

A cycle runs on the set's own thread, or on a thread that blocks in ``synchronize()`` while
no cycle of the set is running: that thread then runs the cycle itself (:meth:`flush`), so
a synchronous op costs no thread switch. A *blocking* op (one the caller waits on right
away: ``hvd.allreduce``, ``allreduce_``, ``broadcast``...) does not even wake the set's
thread; a cycle run by a caller wakes it only when it has to act before its next keepalive
(an op waits for another rank, the set stopped).

Failures: a cycle that raises (a peer died: Gloo notices a closed connection within
milliseconds; a hung peer: after ``HVDRUN_GLOO_TIMEOUT_SECONDS``) stops the whole engine
(see ``Engine.failed``): every pending and later op of every set raises
:class:`HorovodInternalError`. The set then closes its connections, so that peers waiting on
this rank (not on the dead one) fail as fast.

Ownership:

* ``cycle_lock``: one cycle at a time, on whichever thread; its holder owns the runner (and
  through it the exchange, table, cache rounds, dispatch and executor) and ``_released``;
* ``queue``: its fields under its own condition (see :mod:`.queue`);
* ``_thread`` and the constructor's arguments: set once, read by anyone.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import DistError

from collectives.engine import lanes
from collectives.engine.autotune import Autotuner
from collectives.engine.config import EngineConfig
from collectives.engine.cycle import CycleRunner
from collectives.engine.dispatch import Controls
from collectives.engine.execute import Group
from collectives.engine.handles import Handle
from collectives.engine.names import UnnamedCounters
from collectives.engine.queue import Submissions
from collectives.engine.requests import Request
from collectives.engine.timeline import TimelineSlot
from collectives.errors import HorovodInternalError

__all__ = ["Controller", "describe_failure", "from_peers"]

logger = logging.getLogger(__name__)

#: What the errors of a failed collective say (Gloo raises plain RuntimeErrors that name its
#: transport, a timeout or the connection; c10d and NCCL raise DistError).
_PEER_MARKS = ("gloo", "timed out", "timeout", "connection", "socket", "peer")


def from_peers(error: BaseException) -> bool:
    """Whether an error of a cycle came from a collective that failed (a peer died, hung or
    was cut off) rather than from this rank's own work (a local torch error)."""
    if isinstance(error, DistError):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return any(mark in text for mark in _PEER_MARKS)


def describe_failure(rank: int, error: BaseException, timeout: float) -> str:
    """What every pending op of a failed engine says."""
    if isinstance(error, HorovodInternalError):
        return str(error)
    if from_peers(error):
        return (
            f"rank {rank}: a collective failed, so a peer process has probably died, "
            f"hung or lost its connection (HVDRUN_GLOO_TIMEOUT_SECONDS={timeout:g}); the "
            f"job's collectives are stopped: {error}"
        )
    return (
        f"rank {rank}: the collectives engine failed on this rank itself (not because of a "
        f"peer); the job's collectives are stopped: {type(error).__name__}: {error}"
    )


class Controller:
    """Negotiates and runs one process set's ops on this rank."""

    def __init__(
        self,
        *,
        rank: int,
        group: Group,
        config: EngineConfig,
        control_pg: Any,
        data_pg: Any,
        controls: Controls,
        timeline: TimelineSlot,
        on_failure: Callable[[Controller, str], None],
        on_stop: Callable[[Controller], None],
        destroy_group: Callable[[Any], None],
        counters: UnnamedCounters | None = None,
        tuner: Autotuner | None = None,
        cuda_device: int | None = None,
    ) -> None:
        self.rank = rank
        self.group = group
        self.queue = Submissions(rank)
        self.cycle_lock = threading.Lock()
        self.runner = CycleRunner(
            rank=rank,
            group=group,
            queue=self.queue,
            config=config,
            control_pg=control_pg,
            data_pg=data_pg,
            controls=controls,
            timeline=timeline,
            counters=counters,
            tuner=tuner,
        )
        self.timeline = timeline  # (the engine's; read, never replaced, here)
        self._timeout = config.collective_timeout_seconds
        self._on_failure = on_failure
        self._on_stop = on_stop
        self._destroy_group = destroy_group
        self._cuda_device = cuda_device
        self._released = False
        set_id = group.process_set_id
        name = "hvdrun-engine" if set_id == 0 else f"hvdrun-engine-set{set_id}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread_ident: int | None = None  # the set's thread, once started
        self.flush_bound = self.flush  # (every handle holds it: bound once)

    # ---- callers ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self.thread_ident = self._thread.ident

    def new_handle(self) -> Handle:
        return Handle(self.flush_bound)

    def submit(self, request: Request, blocking: bool = False) -> Handle:
        """Queues a request for the set's next cycle (see ``Submissions.add``)."""
        return self.queue.add(request, blocking)

    def run_now(self, request: Request) -> bool:
        """The request lane (see :func:`collectives.engine.lanes.run_now`)."""
        return lanes.run_now(self, request)

    def flush(self) -> None:
        """Someone waits for a result: negotiate now instead of gathering a burst.

        When no cycle of the set is running, the waiting thread runs the next one itself
        (its own op is in it): a synchronous op then costs no thread switch at all, only the
        negotiation round and its collective. Otherwise the set's thread is woken.
        """
        if threading.get_ident() != self.thread_ident and self.cycle_lock.acquire(blocking=False):
            try:
                if self.queue.runnable():
                    self.guarded_cycle()
                    return
            finally:
                self.cycle_lock.release()
        self.queue.request_flush()

    # ---- cycles (with the cycle lock held) -------------------------------------------

    def guarded_cycle(self, body: Callable[[], bool] | None = None) -> None:
        """Runs one cycle (``body`` instead of the runner's, for a lane); any failure stops
        the engine."""
        runner = self.runner
        started = time.perf_counter()
        try:
            runner.busy = False
            runner.round_bytes = 0
            # Grad mode is per thread, and a caller's thread may run the cycle: the copies
            # into and out of staging buffers must not record autograd history (an in-place
            # op on a leaf that requires grad, such as a Parameter, would raise).
            # (torch.no_grad() as a context costs ~3 µs, a tenth of a lane's Python.)
            grad = torch.is_grad_enabled()
            if grad:
                torch.set_grad_enabled(False)
            try:
                going_on = runner.cycle() if body is None else body()
            finally:
                if grad:
                    torch.set_grad_enabled(True)
            if going_on and runner.busy and runner.tuner is not None:
                runner.autotune(runner.tuner)
        except BaseException as error:
            self.cycle_failed(error)
            return
        runner.arrivals.busy += time.perf_counter() - started
        if not going_on:
            runner.arrivals.close()
            self._on_stop(self)
        elif runner.pace.awaiting and threading.get_ident() != self.thread_ident:
            self.queue.wake()  # the set's thread must act sooner than it planned

    def cycle_failed(self, error: BaseException) -> None:
        """A cycle raised: the engine stops, every pending op fails, the set's groups go.
        Re-raises an interruption (Ctrl-C in a thread that ran the cycle)."""
        logger.debug("collectives engine of rank %d stopped", self.rank, exc_info=True)
        self.runner.arrivals.close()
        self._on_failure(self, describe_failure(self.rank, error, self._timeout))
        # The failed call's frames still hold process groups in their locals: cleared, and
        # the error gone with this call, only the runner holds them (nothing is chained
        # inside a cycle, so the traceback is all there is).
        traceback.clear_frames(error.__traceback__)
        interrupted = None if isinstance(error, Exception) else error
        del error
        self.release_groups()
        if interrupted is not None:
            raise interrupted

    def fail(self, message: str, origin: bool = False) -> None:
        """The engine failed (``origin``: in this set's cycle, whose ops fail too)."""
        also = self.runner.dispatch.current if origin else ()
        self.queue.fail(message, also)

    def release_groups(self) -> None:
        """Closes the set's connections, so that peers still inside a collective with this
        rank fail at once instead of after the timeout.

        A process group closes its connections only when the last reference to it goes
        (destroying it does not, and Gloo's ``abort()`` does nothing): the runner drops its
        own references before they are destroyed, and the connections close when this
        returns. Called with the cycle lock held, after a failed cycle (whose frames must be
        gone) and once the set stopped; nothing runs on the groups any more."""
        if self._released:
            return
        self._released = True
        for group in self.runner.release():
            if group is None:
                continue
            try:
                self._destroy_group(group)
            except Exception as error:  # already broken: nothing more to do
                logger.debug("destroying a process group failed: %s", error)

    # ---- lifetime --------------------------------------------------------------------

    def leave(self, message: str = "", failure: str = "") -> None:
        """This rank leaves the set: its next cycle (the last) says so to the members
        (``message``: what the set's ops say, when the set ends for another reason than
        this rank's shutdown; ``failure``: how its script failed, when it did)."""
        self.queue.leave(message, failure)

    def cancel(self, error_for: Callable[[Request], BaseException]) -> None:
        """The set goes away: every op in flight fails at once, then this rank leaves."""
        self.queue.fail_pending(error_for)
        self.leave()

    def join(self, timeout: float | None) -> None:
        """Waits for the set's thread (its last cycle); releases the groups if it ended or
        never started."""
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive() and self.cycle_lock.acquire(timeout=1.0):
            try:
                self.release_groups()
            finally:
                self.cycle_lock.release()

    def _run(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        queue, runner = self.queue, self.runner
        while queue.wait_until_due(runner.current_pace):
            with self.cycle_lock:
                if queue.due_now(runner.pace):
                    self.guarded_cycle()
        with self.cycle_lock:
            self.release_groups()
