"""The background engine: negotiates, fuses and runs every op of this process.

Any thread submits a :class:`~collectives.engine.requests.Request` and gets a handle at once.
Ops progress in *cycles*: one negotiation round (see :mod:`negotiation`) followed by the
collectives of every op that became ready in it, fused into buckets (see :mod:`fusion` and
:mod:`execute`), in the same order on every rank. A cycle runs on the engine's thread, or
on a thread that blocks in ``synchronize()`` while no cycle is running: that thread then
runs the cycle itself, so a synchronous op costs no thread switch. A *blocking* op (one the
caller waits on right away: ``hvd.allreduce``, ``allreduce_``, ``broadcast``...) does not
even wake the engine thread; a cycle run by a caller wakes it only when it has to act before
its next keepalive (an op waits for another rank, the engine stopped).

When a rank enters a cycle, so that the lockstep costs no CPU while nothing happens:

* it has newly submitted ops: once they were gathered for the cycle time
  (``HVDRUN_CYCLE_TIME``, 1 ms) and submissions paused (a burst goes out in one round, up to
  20 cycle times), or at once when a thread blocks on a handle;
* an announced op waits for some *other* rank: at once while announcements flow, at the
  cycle-time pace after a round that brought nothing new (the round blocks until the late
  rank announces; the late rank itself never spins);
* otherwise every second (keepalive), counted from the end of the last round so that the
  ranks' keepalive rounds coincide; it bounds how long a peer waits for this rank and paces
  the stall inspector.

While no op is pending, a cycle first tries the response cache (see :mod:`cache`): one small
allreduce agrees on ops every rank ran before, and carries the data of repeated small
allreduces; anything else falls back to the full round below in the same cycle. With
``--autotune`` (see :mod:`autotune`), every rank takes rank 0's next tuning at the end of each
sample, at the same cycle everywhere.

When every rank announced exactly the same ops (the usual SPMD case), the round needs no
per-op bookkeeping, and the round's small CPU allreduces are reduced locally from data that
travelled with the negotiation itself, or in one allgather right after it (see :mod:`eager`).

Failures: a collective that raises (a peer died: Gloo notices a closed connection within
milliseconds; a hung peer: after ``HVDRUN_GLOO_TIMEOUT_SECONDS``) stops the engine, and every
pending and later op raises :class:`HorovodInternalError`. The engine then closes its
connections, so that peers waiting on this rank (not on the dead one) fail as fast. A rank
that calls ``shutdown()`` announces it; every rank stops after that cycle (as in Horovod, a
job's collectives end when one rank leaves).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import BroadcastOptions, DistError

from collectives.engine import eager
from collectives.engine.autotune import Autotuner, Setting
from collectives.engine.cache import (
    CacheRound,
    Key,
    ResponseCache,
    key_of,
    keys_of,
    ordinal,
    request_key,
)
from collectives.engine.config import DEFAULT_CACHE_CAPACITY, EngineConfig
from collectives.engine.execute import Executor, Group
from collectives.engine.fusion import Bucket, Work, plan
from collectives.engine.handles import Handle
from collectives.engine.negotiation import (
    FLAG_ABORT,
    FLAG_LEAVING,
    Entry,
    Exchange,
    Table,
    check,
)
from collectives.engine.requests import (
    RECORD,
    Kind,
    Request,
    check_alltoall,
    label,
    noname,
    parse_signature,
)
from collectives.engine.stall import StallInspector
from collectives.engine.timeline import Timeline
from collectives.errors import HorovodInternalError, TensorMismatchError

__all__ = ["KEEPALIVE_SECONDS", "Engine", "from_peers"]


#: The per-rank parts of ops that have none (never written to).
_NO_VARS: dict[int, str] = {}
#: Device types whose tensors the executor can move (Gloo and NCCL).
_MOVABLE = frozenset(("cpu", "cuda"))

logger = logging.getLogger(__name__)

KEEPALIVE_SECONDS = 1.0
#: A burst of submissions is gathered until it pauses for this many cycle times...
BURST_PAUSE = 1.0
#: ... but for at most this many.
BURST_MAX = 20.0
#: How long the last cycle of a rank that shuts down waits for its peers.
FINAL_CYCLE_SECONDS = KEEPALIVE_SECONDS + 4.0


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


class Engine:
    """Negotiates and runs this process's collectives on a background thread."""

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        config: EngineConfig,
        control_group: Any,
        global_group: Any,
        make_group: Callable[[list[int]], Any],
        destroy_group: Callable[[Any], None],
        cuda_device: int | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.config = config
        self._control_group = control_group
        self._exchange = Exchange(control_group, rank, size)
        self._table = Table(size)
        self.groups: dict[int, Group] = {0: Group(0, list(range(size)), global_group, rank)}
        self._next_set_id = 1
        self._make_group = make_group
        self._destroy_group = destroy_group
        self._cuda_device = cuda_device
        self._executor = Executor(self._trace_phase)
        self._eager_budget = eager.budget(size, config.fusion_threshold)
        self._cache_round: CacheRound | None = None
        if config.cache_capacity > 0:
            self._cache_round = CacheRound(ResponseCache(config.cache_capacity), size)
        #: How many cycles the cache agreed on, and how many ran the full negotiation.
        # Rounds run: cache rounds (predicted ones among them, and among those the ones of
        # the hot lane) and full negotiations.
        self.stats = {"cache_rounds": 0, "predicted_rounds": 0, "hot_rounds": 0, "full_rounds": 0}
        self._busy = False  # the current cycle ran ops (alike on every rank)
        self._round_bytes = 0
        self._tuner: Autotuner | None = None
        if config.autotune:
            self._tuner = Autotuner(
                rank,
                Setting(config.fusion_threshold, config.cycle_time_ms, config.cache_capacity > 0),
                warmup_samples=config.autotune_warmup_samples,
                steps_per_sample=config.autotune_steps_per_sample,
                max_samples=config.autotune_bayes_opt_max_samples,
                noise=config.autotune_gaussian_process_noise,
                log_file=config.autotune_log,
            )

        self.timeline: Timeline | None = None

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._new: list[Request] = []
        self._local: dict[tuple[int, str], Request] = {}
        self._first_new = 0.0
        self._last_submit = 0.0
        self._flush = False
        self._woken = False  # the engine thread was notified of ops not yet in a cycle
        self._leaving = False
        self._abort_requested = False
        self._error: HorovodInternalError | None = None
        self._running = True  # False once the engine stopped (shutdown, failure, abort)
        self._cycle_lock = threading.Lock()  # one cycle at a time, on whichever thread
        self._flush_bound = self.flush  # (every handle holds it: bound once)
        self._names: dict[tuple[int, Kind], itertools.count[int]] = {}
        # What an in-place allreduce_ must match to take the hot lane (see run_hot): the op
        # on the global process set that just ran in a lane, as (name or None, common,
        # dtype, shape); None once any other cycle ran.
        self._hot: tuple[Any, ...] | None = None

        # Engine-thread state.
        self._awaiting = False
        self._quiet = True  # the last round carried no announcements
        self._last_cycle = time.monotonic()
        self._last_round = self._last_cycle
        self._cycle_no = 0
        self._current: list[Request] = []
        self._stall = StallInspector(config, rank)
        self._thread = threading.Thread(target=self._run, name="hvdrun-engine", daemon=True)

    @property
    def autotuning(self) -> bool:
        """Whether autotune is still searching (False when it is off or has settled)."""
        return self._tuner is not None and not self._tuner.done

    @property
    def response_cache(self) -> ResponseCache | None:
        """The response cache (None when it is off)."""
        return self._cache_round.cache if self._cache_round is not None else None

    # ---- the submitting side ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def auto_name(self, kind: Kind, process_set_id: int) -> str:
        """Horovod-style names for unnamed ops, counted per process set and kind so that
        ranks outside a set do not shift the names of others."""
        return noname(kind, self.next_counter(kind, process_set_id))

    def next_counter(self, kind: Kind, process_set_id: int) -> int:
        """The counter of the next unnamed op of this kind in this process set."""
        # setdefault and next() on a count are atomic under the GIL: no lock needed.
        key = (process_set_id, kind)
        counter = self._names.get(key) or self._names.setdefault(key, itertools.count())
        return next(counter)

    def new_handle(self) -> Handle:
        return Handle(self._flush_bound)

    def submit(self, request: Request, blocking: bool = False) -> Handle:
        """Queues a request for the next cycle; raises if this rank cannot run ops any more.

        ``blocking``: the caller waits on the handle right away, and that wait runs the
        cycle (see :meth:`flush`), so the engine thread is not woken: waking it costs a
        thread switch and a fight for the GIL on every synchronous op."""
        key = (request.process_set_id, request.name)
        with self._lock:
            if self._error is not None:
                raise HorovodInternalError(str(self._error))
            if self._leaving or not self._running:
                raise HorovodInternalError(
                    f"rank {self.rank}: hvdrun's collectives have been shut down; "
                    f"{request.label} cannot run"
                )
            if key in self._local:
                raise ValueError(
                    f"{request.label} is already in flight on rank {self.rank}: names of "
                    "ops that run at the same time must be unique (synchronize the first "
                    "one, or give this one another name)"
                )
            self._local[key] = request
            if not self._new:
                self._first_new = request.submitted
            if not blocking and not self._woken:
                self._woken = True
                self._cond.notify()
            self._new.append(request)
            self._last_submit = request.submitted
        return request.handle

    def flush(self) -> None:
        """Someone waits for a result: negotiate now instead of gathering a burst.

        When no cycle is running, the waiting thread runs the next one itself (its own op
        is in it): a synchronous op then costs no thread switch at all, only the
        negotiation round and its collective. Otherwise the engine thread is woken.
        """
        if threading.get_ident() != self._thread.ident and self._cycle_lock.acquire(blocking=False):
            try:
                with self._cond:
                    runnable = bool(self._new) and self._running
                if runnable:
                    self._guarded_cycle()
                    return
            finally:
                self._cycle_lock.release()
        with self._cond:
            if not self._flush:
                self._flush = True
                self._cond.notify()

    def run_now(self, request: Request) -> bool:
        """The fast lane of a blocking op: when the engine is idle and the response cache
        predicts exactly this op as the next round (a lone small allreduce repeated in a
        loop), the calling thread runs that round at once, without queueing the request,
        waking anyone or building the cycle's bookkeeping. True when the request is in the
        engine's hands (finished, failed, or pending after every rank fell back to the full
        negotiation because another rank's ops differed); False when the lane is closed and
        the caller submits it as usual."""
        cache_round = self._cache_round
        if cache_round is None or not cache_round.predicts_one() or not self._enter_lane():
            return False
        try:
            ran = False

            def lane() -> bool:
                nonlocal ran
                # Decided before any collective: every rank runs this cycle's cache round,
                # here or in _cycle, with the same vector.
                self._current = [request]  # (failed by _break if anything below fails)
                outcome = cache_round.run_one(self._control_group, request)
                if outcome is None:
                    self._current = []
                    return True  # not exactly the predicted op: nothing ran
                ran = True
                self._lane_ran(outcome)
                if outcome:
                    self._complete(request, None)
                    self._current = []
                    self._hot = _hot_print(request)
                    return True
                self._current = []
                return self._lane_fallback(request)

            self._guarded_cycle(lane)
            return ran
        finally:
            self._cycle_lock.release()

    def run_hot(
        self,
        name: str | None,
        tensor: torch.Tensor,
        common: tuple[Any, ...],
        build: Callable[[int], Request],
    ) -> Handle | None:
        """The hot lane: an in-place ``allreduce_`` on the global process set repeated in a
        loop, the op (``name``, None for an unnamed op) and ``tensor``'s dtype and shape
        alike the op that just ran in a lane, which the cache predicts again. The calling
        thread runs the predicted round on ``tensor`` directly: no request, no queue, no
        cycle bookkeeping, a few checks and two copies around the collective (a 4-byte op
        spends as much in Python as in Gloo, so each call here counts). Returns None when
        the lane is closed (nothing ran, no counter drawn); else the op's handle: finished,
        or as the op goes on as usual (``build`` makes its request from its counter) when
        it was not the one predicted, or when another rank's ops differed and every rank
        fell back to the full negotiation of this cycle."""
        hot = self._hot
        if (
            hot is None
            or hot[0] != name
            or hot[1] != common
            or not isinstance(tensor, torch.Tensor)
            or tensor.dtype is not hot[2]
            or tensor.shape != hot[3]
            # (no autograd history to keep out of the copies: grad mode may stay as it is)
            or tensor.requires_grad
            or not tensor.is_cpu
            or tensor.layout is not torch.strided
            or self.timeline is not None
            or not self._cycle_lock.acquire(blocking=False)
        ):
            return None
        try:
            # Idle, and no cycle ran since the lane's last round (a cycle clears _hot): the
            # table is empty and the cache's prediction, layout and staging are the lane's.
            # Reads without the condition's lock: an op another thread queues meanwhile
            # goes to the next cycle either way.
            if (
                self._hot is not hot
                or self._new
                or self._local
                or not self._running
                or self._leaving
                or self._abort_requested
            ):
                return None
            cache_round = self._cache_round
            assert cache_round is not None
            counter = -1 if name is not None else self.next_counter(Kind.ALLREDUCE, 0)
            try:
                agreed = cache_round.run_lone(self._control_group, counter + 1, tensor, common)
            except BaseException as error:
                self._cycle_failed(error)
                failed = Handle()
                failed.fail(HorovodInternalError(str(self._error)))
                return failed
            request = None if agreed else build(counter)
            if agreed is not None:
                self._lane_ran(agreed)
                if agreed:
                    self.stats["hot_rounds"] += 1
                    return _DONE
                assert request is not None
                self._guarded_cycle(lambda: self._lane_fallback(request))
                return request.handle
        finally:
            self._cycle_lock.release()
        # Not the op predicted after all (its counter differs): nothing ran; as usual.
        assert request is not None
        return request.handle if self.run_now(request) else self.submit(request, True)

    def _enter_lane(self) -> bool:
        """Whether a lane may run a round on the calling thread now: no timeline or
        autotune to feed, not the engine thread, and nothing pending or in flight while the
        engine runs as usual. True with the cycle lock taken (the caller releases it). Ops
        that other threads queue from here on go to the next cycle."""
        if (
            self.timeline is not None
            or self._tuner is not None
            or threading.get_ident() == self._thread.ident
            or not self._cycle_lock.acquire(blocking=False)
        ):
            return False
        with self._cond:
            idle = not (
                self._new
                or self._local
                or not self._running
                or self._leaving
                or self._abort_requested
                or self._table.entries
                or self._table.joined
            )
        if not idle:
            self._cycle_lock.release()
        return idle

    def _lane_ran(self, agreed: bool) -> None:
        """Bookkeeping of a lane's round, a cycle of its own (``agreed``: every rank ran the
        predicted op)."""
        now = time.monotonic()
        self._last_cycle = now
        self._cycle_no += 1
        if agreed:
            assert self._cache_round is not None
            self.stats["cache_rounds"] += 1
            self.stats["predicted_rounds"] = self._cache_round.predicted_rounds
            self._last_round = now

    def _lane_fallback(self, request: Request) -> bool:
        """A lane's round found that another rank's ops differed (every rank saw NaN): every
        rank goes on to the full negotiation of this cycle, ``request`` announced in it as if
        it had been queued."""
        self._hot = None
        with self._cond:
            self._local[(request.process_set_id, request.name)] = request
        return self._full_round([request], 0, None)

    def stop(self, timeout: float | None = None) -> None:
        """Announces this rank's departure, runs the last cycle and stops the thread."""
        with self._cond:
            self._leaving = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        tl, self.timeline = self.timeline, None
        if tl is not None:
            tl.close()
        if self._tuner is not None:
            self._tuner.close()
        self._executor.release_buffers()
        if not self._thread.is_alive():
            # The last cycle ran: the groups go now, while the interpreter is whole. Handles
            # still referenced (their flush is bound to the engine) would otherwise keep them
            # until the interpreter's finalization, when tearing down Gloo's threads can abort
            # the process ("terminate called without an active exception").
            self._abandon_groups()

    # ---- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        if self._cuda_device is not None:
            torch.cuda.set_device(self._cuda_device)
        while self._running:
            self._wait()
            with self._cycle_lock:
                with self._cond:
                    due = self._running and self._deadline(time.monotonic()) <= 0
                if due:
                    self._guarded_cycle()

    def _guarded_cycle(self, body: Callable[[], bool] | None = None) -> None:
        """Runs one cycle (holding the cycle lock; ``body`` instead of :meth:`_cycle`, for
        the fast lane); any failure stops the engine."""
        try:
            self._busy = False
            self._round_bytes = 0
            # Grad mode is per thread, and a caller's thread may run the cycle: the copies
            # into and out of staging buffers must not record autograd history (an in-place
            # op on a leaf that requires grad, such as a Parameter, would raise).
            # (torch.no_grad() as a context costs ~3 µs, a tenth of a lane's Python.)
            grad = torch.is_grad_enabled()
            if grad:
                torch.set_grad_enabled(False)
            try:
                going_on = self._cycle() if body is None else body()
            finally:
                if grad:
                    torch.set_grad_enabled(True)
            if not going_on:
                self._running = False
            elif self._busy and self._tuner is not None:
                self._autotune(self._tuner)
        except BaseException as error:
            self._cycle_failed(error)
            return
        if not self._running or (
            (self._awaiting or self._abort_requested)
            and threading.get_ident() != self._thread.ident
        ):
            with self._cond:  # the engine thread must act sooner than it planned
                self._cond.notify_all()

    def _cycle_failed(self, error: BaseException) -> None:
        """A cycle raised: the engine stops, every pending op fails, the groups go. Re-raises
        an interruption (Ctrl-C in a thread that ran the cycle)."""
        logger.debug("collectives engine of rank %d stopped", self.rank, exc_info=True)
        self._running = False
        self._break(self._describe_failure(error))
        # The failed call's frames still hold process groups in their locals: cleared, and
        # the error gone with this call, only the engine holds them (the engine has no
        # exceptions chained inside a cycle, so its traceback is all there is).
        traceback.clear_frames(error.__traceback__)
        interrupted = None if isinstance(error, Exception) else error
        del error
        self._abandon_groups()
        if interrupted is not None:
            raise interrupted
        with self._cond:  # the engine thread must act now
            self._cond.notify_all()

    def _autotune(self, tuner: Autotuner) -> None:
        """Counts a cycle that ran ops; at a sample's end, every rank takes rank 0's next
        setting (one broadcast on the negotiation's group, at the same cycle everywhere)."""
        if not tuner.step(self._round_bytes):
            return
        vector = torch.zeros(5, dtype=torch.float64)
        if self.rank == 0:
            cycles = tuner.next_sample_cycles()
            chosen = tuner.decide()
            vector[:] = torch.tensor(
                [
                    chosen.fusion_threshold,
                    chosen.cycle_time_ms,
                    float(chosen.cache),
                    float(tuner.finishing),
                    cycles,
                ],
                dtype=torch.float64,
            )
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        self._control_group.broadcast([vector], opts).wait()
        threshold, cycle_ms, cache, final, cycles = vector.tolist()
        setting = Setting(int(threshold), cycle_ms, cache >= 0.5)
        tuner.apply(setting, final >= 0.5, int(cycles))
        self.config = dataclasses.replace(
            self.config, fusion_threshold=setting.fusion_threshold, cycle_time_ms=cycle_ms
        )
        self._eager_budget = eager.budget(self.size, setting.fusion_threshold)
        if setting.cache != (self._cache_round is not None):
            capacity = self.config.cache_capacity or DEFAULT_CACHE_CAPACITY
            self._cache_round = CacheRound(ResponseCache(capacity), self.size) if cache else None
        if final >= 0.5:
            logger.info("autotune settled on %s", setting)

    def _abandon_groups(self) -> None:
        """Closes this engine's connections, so that peers still inside a collective with
        this rank fail at once instead of after the timeout.

        A process group closes its connections only when the last reference to it goes
        (destroying it does not, and Gloo's ``abort()`` does nothing): the engine drops its
        own references before it destroys them, and the connections close when this
        returns. Called after a failed cycle, whose frames must be gone, and once the engine
        stopped; nothing runs on the groups any more (process sets keep their ranks)."""
        groups = {id(group): group for group in (self._control_group, self._exchange.close())}
        self._control_group = None
        for registered in self.groups.values():
            groups[id(registered.group)] = registered.group
            registered.group = None
        for group in groups.values():
            if group is None:
                continue
            try:
                self._destroy_group(group)
            except Exception as error:  # already broken: nothing more to do
                logger.debug("destroying a process group failed: %s", error)

    def _describe_failure(self, error: BaseException) -> str:
        if isinstance(error, HorovodInternalError):
            return str(error)
        if from_peers(error):
            return (
                f"rank {self.rank}: a collective failed, so a peer process has probably died, "
                f"hung or lost its connection (HVDRUN_GLOO_TIMEOUT_SECONDS="
                f"{self.config.collective_timeout_seconds:g}); the job's collectives are "
                f"stopped: {error}"
            )
        return (
            f"rank {self.rank}: the collectives engine failed on this rank itself (not "
            f"because of a peer); the job's collectives are stopped: "
            f"{type(error).__name__}: {error}"
        )

    def _break(self, message: str) -> None:
        with self._cond:
            if self._error is None:
                self._error = HorovodInternalError(message)
            pending = [*self._local.values(), *self._new, *self._current]
            self._local.clear()
            self._new = []
        for request in pending:
            request.handle.fail(HorovodInternalError(message))

    def _deadline(self, now: float) -> float:
        """Seconds until the next cycle is due (<= 0: now). Call with ``_cond`` held."""
        if self._leaving or self._abort_requested:
            return 0.0
        if self._new:
            if self._flush:
                return 0.0
            # Gather for the cycle time; while submissions keep coming (a burst), wait until
            # they pause, up to a few cycle times: the submitting thread would otherwise
            # fight this one for the GIL on every torch call.
            cycle = self.config.cycle_time
            paused = min(
                self._last_submit + cycle * BURST_PAUSE, self._first_new + cycle * BURST_MAX
            )
            return max(self._first_new + cycle, paused) - now
        if self._awaiting:
            # Right away while announcements flow; at the cycle-time pace once a round
            # brought nothing new (ranks waiting on each other must not spin).
            return self._last_cycle + self.config.cycle_time - now if self._quiet else 0.0
        # From the end of the last round, which every rank saw at about the same moment:
        # the ranks' keepalive rounds then start together and block no one for long.
        return self._last_round + KEEPALIVE_SECONDS - now

    def _wait(self) -> None:
        with self._cond:
            while self._running:
                remaining = self._deadline(time.monotonic())
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def _cycle(self) -> bool:
        """One negotiation round and the ops it made ready; False when the engine stops."""
        self._hot = None
        start = time.monotonic()
        with self._cond:
            new, self._new = self._new, []
            self._flush = False
            self._woken = False
            leaving = self._leaving
            flags = (FLAG_LEAVING if leaving else 0) | (FLAG_ABORT if self._abort_requested else 0)
        self._last_cycle = start
        self._cycle_no += 1
        tl = self.timeline
        if tl is not None:
            tl.cycle(start)
            for request in new:
                tl.begin(request.name, "NEGOTIATE_" + request.kind.label.upper(), request.submitted)
        timeout = FINAL_CYCLE_SECONDS if leaving else None
        cache_round = self._cache_round
        if cache_round is not None and not self._table.entries and not self._table.joined:
            outcome = cache_round.run(self._control_group, new, bool(flags), timeout)
            if outcome is not None:
                self.stats["cache_rounds"] += 1
                self.stats["predicted_rounds"] = cache_round.predicted_rounds
                now = time.monotonic()
                self._last_round = now
                self._run_cached(*outcome, now)
                if tl is not None:
                    tl.flush()
                self._awaiting = False
                self._quiet = not outcome[0]
                return True
        return self._full_round(new, flags, timeout)

    def _full_round(self, new: list[Request], flags: int, timeout: float | None) -> bool:
        """The full negotiation of a cycle (see :mod:`negotiation`) and the ops it made
        ready; False when the engine stops."""
        tl = self.timeline
        cache_round = self._cache_round
        self.stats["full_rounds"] += 1
        if cache_round is not None:
            cache_round.forget()
        records = RECORD.join([request.record() for request in new]).encode()
        exchange = self._exchange
        riders = eager.select(records, new, exchange.room, self._eager_budget)
        gathered = exchange.round(
            riders.payload,
            flags,
            timeout=timeout,
            data=riders.tensors() if riders.inline else (),
            want=riders.want,
        )
        now = time.monotonic()
        self._last_round = now
        results = []
        datas: list[Any] = []
        for peer_flags, peer_payload in gathered:
            peer_records, peer_data = eager.split(peer_payload)
            results.append((peer_flags, peer_records))
            datas.append(peer_data)
        touched: list[Entry] = []
        everything = False
        leavers, abort = [], False
        if self._agreed(new, records, results):
            delivery = eager.delivery(riders, datas, exchange.wants)
            if delivery == eager.FOLLOW:
                datas = exchange.gather(riders.tensors(), riders.nbytes, timeout)
            self._run_agreed(new, now, riders if delivery else None, datas)
        else:
            for peer, (peer_flags, data) in enumerate(results):
                if peer_flags & FLAG_LEAVING:
                    leavers.append(peer)
                abort = abort or bool(peer_flags & FLAG_ABORT)
                entries, joined = self._table.add(peer, data, self._cycle_no, now)
                touched.extend(entries)
                everything = everything or joined
            self._run_ready(self._ready(touched, everything), now)
        if tl is not None:
            tl.flush()
        if abort:
            self._break(
                self._stall.report(self._table, self._members, time.monotonic(), aborting=True)
            )
            return False
        if leavers:
            who = "this rank" if leavers == [self.rank] else f"rank {leavers[0]}"
            self._break(
                f"rank {self.rank}: {who} shut down hvdrun's collectives (hvd.shutdown() or "
                "the end of its script), so no more collectives can run in this job"
            )
            return False
        self._awaiting = self._awaiting_others()
        self._quiet = not any(data for _, data in results)
        if self._stall.check(self._table, self._members, now):
            with self._cond:
                self._abort_requested = True
        return True

    def _run_cached(self, agreed: list[Request], riders: list[Request], now: float) -> None:
        """Runs the ops a cache round agreed on; the riders' results are already in."""
        self._count(agreed)
        if riders:
            with self._cond:
                local = self._local
                for request in riders:
                    local.pop((request.process_set_id, request.name), None)
            tl = self.timeline
            if tl is not None:
                seen = dict.fromkeys(range(self.size), now)
                for request in riders:
                    tl.negotiated(request.name, request.kind.label.upper(), seen, now)
            for request in riders:
                self._complete(request, None)
            if len(riders) == len(agreed):  # (riders are among the agreed ops)
                agreed = []
            else:
                rode = {id(request) for request in riders}
                agreed = [request for request in agreed if id(request) not in rode]
        if agreed:
            self._run_agreed(agreed, now, None, (), cache=False)

    def _count(self, requests: list[Request]) -> None:
        """Notes a round's ops for the autotuner (their bytes, on this rank)."""
        if requests:
            self._busy = True
            if self._tuner is not None:
                self._round_bytes += sum([spec.nbytes for r in requests for spec in r.specs])

    def _cache_ran(self, key: Key) -> None:
        """Records an op that ran alike on every rank (same order everywhere)."""
        if self._cache_round is not None:
            self._cache_round.cache.use(key)

    # ---- readiness -------------------------------------------------------------------

    def _members(self, entry: Entry) -> list[int]:
        group = self.groups.get(entry.process_set_id)
        return group.ranks if group is not None else []

    def _ready(self, touched: list[Entry], everything: bool) -> list[Entry]:
        candidates = list(self._table.entries.values()) if everything else touched
        ready: dict[int, Entry] = {}
        for entry in candidates:
            if id(entry) not in ready and not self._table.waiting_for(entry, self._members(entry)):
                ready[id(entry)] = entry
        result = sorted(ready.values(), key=lambda e: e.order)
        for entry in result:
            self._table.pop(entry)
        return result

    def _awaiting_others(self) -> bool:
        for entry in self._table.entries.values():
            waiting = self._table.waiting_for(entry, self._members(entry))
            if waiting and self.rank not in waiting:
                return True
        return False

    def _agreed(self, new: list[Request], payload: bytes, results: list[tuple[int, bytes]]) -> bool:
        """Whether every rank announced exactly the same ops, and nothing else is going on.

        The common case of an SPMD program: then every op of the round is ready and
        consistent (a rank cannot announce an op twice, so no earlier announcement is
        pending for any of them, and equal payloads mean equal signatures), and the round
        needs no per-op bookkeeping at all. Every rank sees the same results, so all take
        this path together.
        """
        if not payload or self._table.joined:
            return False
        for peer_flags, data in results:
            if peer_flags or data != payload:
                return False
        return all(request.kind <= Kind.BARRIER for request in new)

    def _run_agreed(
        self,
        new: list[Request],
        now: float,
        riders: eager.Riders | None,
        datas: Sequence[Any],
        cache: bool = True,
    ) -> None:
        members = self.groups[0].ranks
        if cache:
            self._count(new)
        if cache and self._cache_round is not None:
            cached = [request for request in new if request.kind <= Kind.REDUCESCATTER]
            for key, _ in keys_of(cached):
                self._cache_ran(key)
        with self._cond:
            local = self._local
            for request in new:
                local.pop((request.process_set_id, request.name), None)
        self._current.extend(new)
        tl = self.timeline
        seen = dict.fromkeys(range(self.size), now)
        if tl is not None:
            for request in new:
                tl.negotiated(request.name, request.kind.label.upper(), seen, now)
        if riders is not None:
            # Every rank's data came along with the announcements.
            if tl is not None:
                for request in riders.requests:
                    tl.end(request.name, "QUEUE", now)
                    tl.begin(request.name, "REDUCE_FROM_NEGOTIATION", now)
            eager.reduce_locally(riders, datas)
            done = time.monotonic()
            for request in riders.requests:
                if tl is not None:
                    tl.end(request.name, "REDUCE_FROM_NEGOTIATION", done)
                self._complete(request, None)
            rode = {id(request) for request in riders.requests}
            new = [request for request in new if id(request) not in rode]
        works: list[Work] = []
        controls: list[tuple[Entry | None, Request | None]] = []
        for request in new:
            kind = request.kind
            if kind == Kind.BARRIER:
                controls.append((None, request))
                continue
            vars_ = _NO_VARS
            if kind == Kind.ALLGATHER or kind == Kind.ALLTOALL:
                vars_ = {rank_: request.var for rank_ in members}
                if kind == Kind.ALLTOALL:
                    error = check_alltoall(request.name, members, vars_)
                    if error is not None:
                        request.handle.fail(TensorMismatchError(error))
                        continue
            works.append(
                Work(
                    kind,
                    request.name,
                    request.process_set_id,
                    request,
                    request.common,
                    request.specs,
                    vars_,
                    0,
                )
            )
        self._execute(works, controls)

    def _run_ready(self, ready: list[Entry], now: float) -> None:
        if not ready:
            return
        self._busy = True
        with self._cond:
            local = self._local
            requests = [local.pop(entry.key, None) for entry in ready]
        if self._tuner is not None:
            self._count([request for request in requests if request is not None])
        tl = self.timeline
        groups = self.groups
        works: list[Work] = []
        controls: list[tuple[Entry | None, Request | None]] = []
        unnamed: dict[Key, int] = {}  # (see cache.ordinal)
        for entry, request in zip(ready, requests, strict=True):
            if request is not None:
                self._current.append(request)
                if tl is not None:
                    seen = {r: max(t, request.submitted) for r, t in entry.seen_at.items()}
                    tl.negotiated(request.name, request.kind.label.upper(), seen, now)
            group = groups.get(entry.process_set_id)
            if group is None:
                error: Exception | None = ValueError(
                    f"{label(entry.kind, entry.name)}: process set {entry.process_set_id} "
                    "is not registered (it was removed)"
                )
            else:
                error = check(entry, group.ranks, self._table.joined)
            if error is not None:
                if request is not None:
                    request.handle.fail(error)
                continue
            assert group is not None
            kind = entry.kind
            if self._cache_round is not None and kind <= Kind.REDUCESCATTER:
                self._cache_entry(entry, group.ranks, unnamed)
            if kind > Kind.REDUCESCATTER:
                controls.append((entry, request))
            elif group.index < 0:
                continue
            elif request is not None:
                works.append(
                    Work(
                        kind,
                        entry.name,
                        entry.process_set_id,
                        request,
                        request.common,
                        request.specs,
                        entry.vars,
                        entry.order,
                    )
                )
            else:
                first_sig = next(iter(entry.sigs.values()))
                works.append(
                    Work.of(
                        kind,
                        entry.name,
                        entry.process_set_id,
                        None,
                        first_sig,
                        entry.vars,
                        entry.order,
                    )
                )
        self._execute(works, controls)

    def _cache_entry(self, entry: Entry, members: list[int], unnamed: dict[Key, int]) -> None:
        """Caches a ready, consistent op if every member described it alike. Only ops of
        every rank: a cache round agrees on what all ranks submitted. ``unnamed`` counts the
        round's unnamed ops cached so far (see ``cache.ordinal``)."""
        if len(members) != self.size:
            return
        if len(entry.sigs) != len(members) or len(set(entry.vars.values())) > 1:
            return
        if entry.vars and len(entry.vars) != len(members):
            return
        sig = next(iter(entry.sigs.values()))
        var = next(iter(entry.vars.values()), "")
        key, counter = key_of(entry.kind, entry.process_set_id, entry.name, sig, var)
        self._cache_ran(ordinal(key, counter, unnamed))

    def _execute(
        self, works: list[Work], controls: list[tuple[Entry | None, Request | None]]
    ) -> None:
        """Runs the data ops (fused into buckets), then the control ops, of one round."""
        groups = self.groups
        tl = self.timeline
        works = [work for work in works if self._supported(work)]
        members = {set_id: group.ranks for set_id, group in groups.items()}
        buckets = plan(works, members, self.config.fusion_threshold)
        for work in works:
            if work.remaining == 0:
                self._complete(work.request, None)
        for bucket in buckets:
            if tl is not None:
                started = time.monotonic()
                for queued in bucket.requests():
                    tl.end(queued.name, "QUEUE", started)
            event = self._executor.run(bucket, groups[bucket.process_set_id])
            for slot in bucket.slots:
                work = slot.work
                work.remaining -= 1
                if work.remaining == 0 and work.request is not None:
                    self._complete(work.request, event)
        for entry, control in controls:
            result = self._control(entry) if entry is not None else None
            self._complete(control, None, result)
        self._current = []

    def _trace_phase(self, bucket: Bucket, phase: str, start: float, end: float) -> None:
        tl = self.timeline
        if tl is not None:
            for request in bucket.requests():
                tl.begin(request.name, phase, start)
                tl.end(request.name, phase, end)

    def _supported(self, work: Work) -> bool:
        """Only CPU (Gloo) and CUDA (NCCL) tensors can move; every rank decides alike."""
        for spec in work.specs:
            if spec.device_type not in _MOVABLE:
                if work.request is not None:
                    work.request.handle.fail(
                        ValueError(
                            f"{label(work.kind, work.name)}: tensors on {spec.device_type} "
                            "devices are not supported (only CPU and CUDA tensors)"
                        )
                    )
                return False
        return True

    def _complete(self, request: Request | None, event: Any, result: Any = None) -> None:
        if request is None:
            return
        tl = self.timeline
        if tl is not None:
            tl.end(request.name, request.kind.label.upper(), time.monotonic())
        if request.kind <= Kind.REDUCESCATTER:  # moves data
            result = request.extra if request.finish is None else request.finish(request)
        request.handle.complete(result, event)

    def _control(self, entry: Entry) -> Any:
        kind = entry.kind
        if kind == Kind.JOIN:
            last = self._table.last_joined()
            self._table.joined.clear()
            return last
        if kind == Kind.ADD_PROCESS_SET:
            (ranks_text,) = parse_signature(kind, next(iter(entry.sigs.values()))).values(kind)
            ranks = [int(r) for r in ranks_text.split(",")]
            set_id = self._next_set_id
            self._next_set_id += 1
            group = self._make_group(ranks)
            index = ranks.index(self.rank) if self.rank in ranks else -1
            self.groups[set_id] = Group(set_id, ranks, group, index)
            return set_id
        if kind == Kind.REMOVE_PROCESS_SET:
            (set_id,) = parse_signature(kind, next(iter(entry.sigs.values()))).values(kind)
            removed = self.groups.pop(set_id, None)
            for other in list(self._table.entries.values()):
                if other.process_set_id == set_id:
                    self._table.pop(other)
                    with self._cond:
                        request = self._local.pop(other.key, None)
                    if request is not None:
                        request.handle.fail(
                            ValueError(f"{request.label}: its process set {set_id} was removed")
                        )
            if removed is not None and removed.group is not None:
                self._destroy_group(removed.group)
            return removed is not None
        return None  # a barrier: being ready is all it waits for


def _hot_print(request: Request) -> tuple[Any, ...] | None:
    """What an op that follows ``request`` in the hot lane must match (see run_hot)."""
    if request.process_set_id != 0:
        return None
    spec = request.specs[0]
    _, counter = request_key(request)
    name = None if counter else request.name
    return (name, request.common, spec.dtype, torch.Size(spec.shape))


#: The handle the hot lane returns: the op finished (the caller holds the result).
_DONE = Handle.finished(None)
