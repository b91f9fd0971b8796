"""One process set's cycles: a negotiation round and the ops it made ready.

A cycle takes what was submitted since the last one (:mod:`.queue`) and runs one round
among the set's members, on a Gloo group of the set's own:

* while no op is pending, the response cache's round first (see :mod:`.rounds`): one small
  allreduce agrees on ops every member ran before and carries the data of repeated small
  allreduces; cached ops that only some members submitted wait in the queue for a later
  cycle (:meth:`~collectives.engine.queue.Submissions.hold`); anything else falls back to
  the full round in the same cycle;
* the full round (see :mod:`.negotiation`): the allgather of every member's announcements
  into the table of pending ops, identical on every member, which all read alike. When every
  member announced exactly the same ops (the usual SPMD case), the round needs no per-op
  bookkeeping, and its small CPU allreduces are reduced locally from data that travelled
  with the announcements (see :mod:`.eager`).

The ops that became ready run through :class:`~collectives.engine.dispatch.Dispatch`. With
``--autotune`` (global set only, see :mod:`.autotune`), every rank takes rank 0's next tuning
at the end of each sample, at the same cycle everywhere.

A member that leaves (``hvd.shutdown()``, or its set was removed) says so in its last round;
every member stops after that round. The stall inspector's abort travels the same way.

Ownership: a :class:`CycleRunner` and everything it holds (the exchange, the table, the
cache's rounds, the dispatch, the statistics, the hot lane's fingerprint ``hot``, the tuning
it runs with) belong to whoever holds its set's cycle lock: the set's thread, or a caller's
thread that runs the cycle itself (see :mod:`.controller`). The one field read without that
lock is ``pace``, an immutable snapshot replaced after every cycle, which the set's thread
reads while it waits for the next one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, NamedTuple

import torch
from torch.distributed import AllreduceOptions, BroadcastOptions

from collectives.engine import eager
from collectives.engine.autotune import Autotuner, Setting
from collectives.engine.cache import (
    DEFAULT_CAPACITY,
    Key,
    ResponseCache,
    key_of,
    keys_of,
    ordinal,
    request_key,
)
from collectives.engine.config import EngineConfig
from collectives.engine.dispatch import Controls, Dispatch
from collectives.engine.execute import Group, reduces_directly
from collectives.engine.insight import IDLE, Arrivals
from collectives.engine.leaving import culprit, failure_of, left_message
from collectives.engine.leaving import payload as failed_payload
from collectives.engine.names import UnnamedCounters, unnamed_counter
from collectives.engine.negotiation import (
    FLAG_ABORT,
    FLAG_FAILED,
    FLAG_FLUSH,
    FLAG_LEAVING,
    Entry,
    Exchange,
    Table,
    check,
)
from collectives.engine.queue import Submissions
from collectives.engine.reduction import Reduction
from collectives.engine.requests import RECORD, Kind, Request
from collectives.engine.rounds import HOLD_SECONDS, CacheRound
from collectives.engine.scheduler import KEEPALIVE_SECONDS, Pace
from collectives.engine.stall import StallInspector
from collectives.engine.timeline import TimelineSlot

__all__ = ["FINAL_CYCLE_SECONDS", "CycleRunner", "HotPrint", "hot_print"]

logger = logging.getLogger("collectives.engine")

#: How long the last cycle of a rank that leaves waits for its peers.
FINAL_CYCLE_SECONDS = KEEPALIVE_SECONDS + 4.0


class HotPrint(NamedTuple):
    """What an in-place allreduce must match to take the hot lane (see :mod:`.lanes`): the
    op that just ran in a lane."""

    name: str | None  # None for an unnamed op (its counter must be the predicted one)
    reduction: Reduction
    dtype: torch.dtype
    shape: torch.Size
    device: int  # the CUDA device's index; -1 on the CPU (as ``Tensor.get_device()``)
    rode: bool  # its data rode the lane's round (else it runs on the tensor itself)


def hot_print(request: Request, rode: bool) -> HotPrint | None:
    """What an op that follows ``request`` in the hot lane must match (global set only):
    an allreduce of one tensor whose data rode its lane's round (``rode``), or that runs on
    the tensor itself (see :meth:`~collectives.engine.execute.Executor.reduce_in_place`)."""
    if request.process_set_id != 0 or request.kind != Kind.ALLREDUCE or len(request.specs) != 1:
        return None
    spec = request.specs[0]
    if not rode and not reduces_directly(spec.dtype, spec.device_type):
        return None
    _, counter = request_key(request)
    name = None if counter else request.name
    device = request.inputs[0].get_device()
    return HotPrint(name, request.reduction, spec.dtype, torch.Size(spec.shape), device, rode)


def _leaving(
    members: list[int], results: list[tuple[int, bytes]], datas: list[Any], agreed: bool
) -> tuple[list[int], dict[int, str], bool]:
    """From a full round's flags: the members that leave the set after it, how those that
    failed failed, and whether a member asked for an abort (none of it in an ``agreed``
    round: no member raised a flag in it)."""
    leavers: list[int] = []
    failed: dict[int, str] = {}
    abort = False
    if agreed:
        return leavers, failed, abort
    for peer, (peer_flags, _), data in zip(members, results, datas, strict=True):
        if peer_flags & FLAG_LEAVING:
            leavers.append(peer)
            if peer_flags & FLAG_FAILED:
                failed[peer] = failure_of(data)
        abort = abort or bool(peer_flags & FLAG_ABORT)
    return leavers, failed, abort


class CycleRunner:
    """Runs one process set's cycles on this rank (see the module docstring)."""

    def __init__(
        self,
        *,
        rank: int,
        group: Group,
        queue: Submissions,
        config: EngineConfig,
        control_pg: Any,
        data_pg: Any,
        controls: Controls,
        timeline: TimelineSlot,
        counters: UnnamedCounters | None = None,
        tuner: Autotuner | None = None,
    ) -> None:
        self.rank = rank
        self.group = group
        self.members = group.ranks
        self.size = group.size
        self.queue = queue
        self.config = config  # (autotune replaces it with the tuned values)
        self.control_pg = control_pg  # the set's Gloo group for rounds (None once released)
        self.exchange = Exchange(control_pg, group.index, group.size)
        self.table = Table(group.size)
        self.arrivals = Arrivals(group.index, group.size)
        self.rounds: CacheRound | None = None
        if config.cache_capacity > 0:
            cache = ResponseCache(config.cache_capacity)
            self.rounds = CacheRound(cache, group.size, self.arrivals)
        self.dispatch = Dispatch(group, queue, data_pg, self.control, config)
        self._controls = controls
        self._timeline = timeline
        self.tuner = tuner
        self.counters = counters if counters is not None else UnnamedCounters()
        self.stall = StallInspector(config, rank, group.index == 0, group.process_set_id)
        self.eager_budget = eager.budget(group.size, config.fusion_threshold)
        # Rounds run: cache rounds (predicted ones among them, and among those the ones of
        # the hot lane) and full negotiations.
        self.stats = {"cache_rounds": 0, "predicted_rounds": 0, "hot_rounds": 0, "full_rounds": 0}
        now = time.monotonic()
        self.pace = Pace(False, True, now, now, config.cycle_time)
        self.hot: HotPrint | None = None  # None once any other cycle ran
        self.cycle_no = 0
        self.busy = False  # the current cycle ran ops (alike on every member)
        self.round_bytes = 0
        self.ended_by: int | None = None  # the member whose leaving ended the set's rounds
        self.stalled_by: tuple[int, str] | None = None  # (stall shutdown) who held it up, how

    def current_pace(self) -> Pace:
        return self.pace

    def release(self) -> list[Any]:
        """Forgets the set's process groups (after a failure, or once stopped) and returns
        them, to be destroyed; no round can run after this."""
        groups = [self.exchange.close(), self.control_pg, self.dispatch.executor.release()]
        self.control_pg = None
        unique = {id(group): group for group in groups if group is not None}
        return list(unique.values())

    # ---- a cycle ---------------------------------------------------------------------

    def cycle(self) -> bool:
        """One cycle; False when the set stops (a member left, or the stall inspector gave up)."""
        self.hot = None
        self.dispatch.executor.let_go()  # (an idle set's keep-alive cycles free them too)
        start = time.monotonic()
        held, new, flags = self.queue.take()
        self.cycle_no += 1
        tl = self.dispatch.tl = self._timeline.current
        if tl is not None:
            self.dispatch.round_id = f"{self.group.process_set_id}:{self.cycle_no}"
            tl.cycle(start)
            for request in new:
                tl.begin(request.row, "NEGOTIATE_" + request.kind.label.upper(), request.submitted)
        if held:
            new = held + new
        timeout = FINAL_CYCLE_SECONDS if flags & FLAG_LEAVING else None
        rounds = self.rounds
        if rounds is not None and not self.table.entries and not self.table.joined:
            # Ops held back too long go to the full negotiation (every member follows).
            dirty = bool(flags) or any(start - r.submitted > HOLD_SECONDS for r in held)
            outcome = rounds.run(self.control_pg, new, dirty, timeout)
            if outcome is not None:
                self.stats["cache_rounds"] += 1
                self.stats["predicted_rounds"] = rounds.predicted_rounds
                now = time.monotonic()
                agreed, riders = outcome
                waiting = len(agreed) != len(new)
                if waiting:  # (not every member submitted these yet)
                    ran = {id(request) for request in agreed}
                    self.queue.hold([request for request in new if id(request) not in ran])
                self.count(agreed)
                self.dispatch.cached(agreed, riders, now)
                if tl is not None:
                    tl.flush()
                self.pace = Pace(waiting, not agreed, start, now, self.config.cycle_time)
                return True
        return self.full_round(new, flags, timeout, start)

    def full_round(
        self, new: list[Request], flags: int, timeout: float | None, start: float
    ) -> bool:
        """The full negotiation of a cycle and the ops it made ready; False when the set
        stops."""
        tl = self.dispatch.tl
        self.stats["full_rounds"] += 1
        if self.rounds is not None:
            self.rounds.forget()
        records = RECORD.join([request.record() for request in new]).encode()
        exchange = self.exchange
        if flags & FLAG_FAILED:  # (this rank leaves: the others are told how it failed)
            riders = failed_payload(records, exchange.room, self.queue.failure)
        else:
            riders = eager.select(records, new, exchange.room, self.eager_budget)
        arrivals = self.arrivals
        started = time.perf_counter()
        gathered = exchange.round(
            riders.payload,
            flags | FLAG_FLUSH if arrivals.want else flags,
            timeout=timeout,
            data=riders.tensors() if riders.inline else (),
            want=riders.want,
        )
        ended = time.perf_counter()
        arrivals.note(started, ended, self._label(new))
        now = time.monotonic()
        results = []
        datas: list[Any] = []
        flush = False
        for peer_flags, peer_payload in gathered:
            peer_records, peer_data = eager.split(peer_payload)
            if peer_flags & FLAG_FLUSH:
                flush = True
                peer_flags &= ~FLAG_FLUSH
            results.append((peer_flags, peer_records))
            datas.append(peer_data)
        agreed = self._agreed(new, records, results)
        leavers, failed, abort = _leaving(self.members, results, datas, agreed)
        ready: list[Entry] = []
        if not agreed:
            touched: list[Entry] = []
            everything = False
            for peer, (_, data) in zip(self.members, results, strict=True):
                entries, joined = self.table.add(peer, data, self.cycle_no, now)
                touched.extend(entries)
                everything = everything or joined
            ready = self._ready(touched, everything)
        # A member that leaves (or an abort) ends the set after this round: the last flush.
        arrivals.after(
            self.control_pg,
            flush or any(peer_flags for peer_flags, _ in results),
            timeout,
            progress=agreed or bool(ready),
        )
        if agreed:
            delivery = eager.delivery(riders, datas, exchange.wants)
            if delivery == eager.FOLLOW:
                datas = exchange.gather(riders.tensors(), riders.nbytes, timeout)
            self.count(new)
            if self.rounds is not None:
                cached = [request for request in new if request.kind <= Kind.REDUCESCATTER]
                for key, _ in keys_of(cached):
                    self._cache_ran(key)
            self.dispatch.agreed(new, now, riders if delivery else None, datas)
        else:
            self._run_ready(ready, now)
        if tl is not None:
            tl.flush()
        if abort:
            message = self.stall.report(self.table, self._members, time.monotonic(), aborting=True)
            self.stalled_by = self.stall.holdup(self.table, self._members)
            self.queue.fail(message, self.dispatch.current)
            return False
        if leavers:
            if self.rank not in leavers:
                self.ended_by = culprit(self.rank, leavers, failed)
            self.queue.fail(
                self.queue.leave_message or left_message(self.rank, leavers, failed),
                self.dispatch.current,
            )
            return False
        quiet = not any(data for _, data in results)
        self.pace = Pace(self._awaiting_others(), quiet, start, now, self.config.cycle_time)
        if self.stall.check(self.table, self._members, now):
            self.queue.request_abort()
        return True

    def _label(self, new: list[Request]) -> str:
        """What this member waits on in a round: its first new op, else the oldest op it
        announced before (the table holds only ops not run yet)."""
        if new:
            return new[0].name
        for entry in self.table.entries.values():
            if self.rank in entry.seen_at:
                return entry.name
        return IDLE

    def count(self, requests: list[Request]) -> None:
        """Notes a round's ops for the autotuner (their bytes, on this rank)."""
        if requests:
            self.busy = True
            if self.tuner is not None:
                self.round_bytes += sum([spec.nbytes for r in requests for spec in r.specs])

    def _cache_ran(self, key: Key) -> None:
        """Records an op that ran alike on every member (same order everywhere)."""
        if self.rounds is not None:
            self.rounds.cache.use(key)

    # ---- readiness -------------------------------------------------------------------

    def _members(self, entry: Entry) -> list[int]:
        return self.members

    def _ready(self, touched: list[Entry], everything: bool) -> list[Entry]:
        table, members = self.table, self.members
        candidates = list(table.entries.values()) if everything else touched
        ready: dict[int, Entry] = {}
        for entry in candidates:
            if id(entry) not in ready and not table.waiting_for(entry, members):
                ready[id(entry)] = entry
        result = sorted(ready.values(), key=lambda e: e.order)
        for entry in result:
            table.pop(entry)
        return result

    def _awaiting_others(self) -> bool:
        for entry in self.table.entries.values():
            waiting = self.table.waiting_for(entry, self.members)
            if waiting and self.rank not in waiting:
                return True
        return False

    def _agreed(self, new: list[Request], payload: bytes, results: list[tuple[int, bytes]]) -> bool:
        """Whether every member announced exactly the same ops, and nothing else is going on.

        The common case of an SPMD program: then every op of the round is ready and
        consistent (a rank cannot announce an op twice, so no earlier announcement is
        pending for any of them, and equal payloads mean equal signatures), and the round
        needs no per-op bookkeeping at all. Every member sees the same results, so all take
        this path together.
        """
        if not payload or self.table.joined:
            return False
        for peer_flags, data in results:
            if peer_flags or data != payload:
                return False
        return all(request.kind <= Kind.BARRIER for request in new)

    def _run_ready(self, ready: list[Entry], now: float) -> None:
        """Checks the ready ops (a mismatch fails every submitter's), caches the consistent
        ones, and runs them."""
        if not ready:
            return
        self.busy = True
        requests = self.queue.pop([entry.key for entry in ready])
        if self.tuner is not None:
            self.count([request for request in requests if request is not None])
        tl = self.dispatch.tl
        current = self.dispatch.current
        checked: list[tuple[Entry, Request | None]] = []
        unnamed: dict[Key, int] = {}  # (see cache.ordinal)
        for entry, request in zip(ready, requests, strict=True):
            if request is not None:
                current.append(request)
                if tl is not None:
                    seen = {r: max(t, request.submitted) for r, t in entry.seen_at.items()}
                    op = request.kind.label.upper()
                    tl.negotiated(request.row, op, seen, now, self.dispatch.round_id)
            else:
                self._catch_up(entry)
            error = check(entry, self.members, self.table.joined)
            if error is not None:
                if request is not None:
                    request.handle.fail(error)
                continue
            if self.rounds is not None and entry.kind <= Kind.REDUCESCATTER:
                self._cache_entry(entry, unnamed)
            checked.append((entry, request))
        self.dispatch.ready(checked)

    def _catch_up(self, entry: Entry) -> None:
        """An op this rank did not submit became ready (this rank has joined): if it is
        unnamed, this rank counts it too, whether it runs or is refused, so that its next
        unnamed op gets the same name as the others' (see :mod:`.names`)."""
        unnamed = unnamed_counter(entry.kind, entry.name)
        if unnamed is not None:
            self.counters.catch_up(unnamed[0], entry.process_set_id, unnamed[1])

    def _cache_entry(self, entry: Entry, unnamed: dict[Key, int]) -> None:
        """Caches a ready, consistent op if every member described it alike. ``unnamed``
        counts the round's unnamed ops cached so far (see ``cache.ordinal``)."""
        size = self.size
        if len(entry.sigs) != size or len(set(entry.vars.values())) > 1:
            return
        if entry.vars and len(entry.vars) != size:
            return
        sig = next(iter(entry.sigs.values()))
        var = next(iter(entry.vars.values()), "")
        key, counter = key_of(entry.kind, entry.process_set_id, entry.name, sig, var)
        self._cache_ran(ordinal(key, counter, unnamed))

    def control(self, entry: Entry, request: Request | None) -> Any:
        """A ready control op (``request``: this rank's): ``hvd.join()`` returns the rank
        that joined last; process sets are the engine's (``controls``)."""
        if entry.kind == Kind.JOIN:
            last = self._last_joined(request)
            self.table.clear_joins()
            return last
        return self._controls(entry)

    def _last_joined(self, request: Request | None) -> int:
        """The rank that joined last, alike on every member (``request``: this rank's join).
        Joins that reached the same round are told apart by how long each has waited since
        its ``hvd.join()`` call: the members leave the round together, so the last to call
        it waited least. (Not by the time spent inside rounds: with the response cache the
        early joiners wait in a cache round, and the join then runs in a full round that
        every member enters together.) Ties (none in practice) go to the highest rank."""
        joiners = self.table.last_joiners()
        if len(joiners) == 1:
            return joiners[0]
        waited = torch.zeros(self.size, dtype=torch.float64)
        if request is not None:
            waited[self.group.index] = time.monotonic() - request.submitted
        self.control_pg.allreduce([waited], AllreduceOptions()).wait()  # (a sum)
        where = self.members.index
        return min(joiners, key=lambda rank: (float(waited[where(rank)]), -rank))

    # ---- the lanes' bookkeeping (see :mod:`.lanes`) ----------------------------------

    def lane_ran(self, agreed: bool) -> None:
        """Bookkeeping of a lane's round, a cycle of its own (``agreed``: every member ran
        the predicted op)."""
        now = time.monotonic()
        self.cycle_no += 1
        p = self.pace
        # (tuple.__new__ builds the NamedTuple without its Python-level constructor: this
        # runs once per op of a loop)
        if agreed:
            assert self.rounds is not None
            self.stats["cache_rounds"] += 1
            self.stats["predicted_rounds"] = self.rounds.predicted_rounds
            self.pace = tuple.__new__(Pace, (p.awaiting, p.quiet, now, now, p.cycle_time))
        else:
            self.pace = tuple.__new__(Pace, (p.awaiting, p.quiet, now, p.last_round, p.cycle_time))

    def lane_fallback(self, request: Request) -> bool:
        """A lane's round found that another member's ops differed (every member saw NaN):
        every member goes on to the full negotiation of this cycle, ``request`` announced in
        it as if it had been queued."""
        self.hot = None
        self.queue.announce(request)
        return self.full_round([request], 0, None, self.pace.last_cycle)

    # ---- autotune --------------------------------------------------------------------

    def autotune(self, tuner: Autotuner) -> None:
        """Counts a cycle that ran ops; at a sample's end, every rank takes rank 0's next
        setting (one broadcast on the negotiation's group, at the same cycle everywhere)."""
        if not tuner.step(self.round_bytes):
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
        self.control_pg.broadcast([vector], opts).wait()
        threshold, cycle_ms, cache, final, cycles = vector.tolist()
        setting = Setting(int(threshold), cycle_ms, cache >= 0.5)
        tuner.apply(setting, final >= 0.5, int(cycles))
        # (CUDA reductions keep theirs: larger buckets there only wait longer, docs/gpu.md)
        self.config = dataclasses.replace(
            self.config, fusion_threshold=setting.fusion_threshold, cycle_time_ms=cycle_ms
        )
        self.dispatch.fusion_threshold = setting.fusion_threshold
        pace = self.pace
        self.pace = Pace(pace.awaiting, pace.quiet, pace.last_cycle, pace.last_round,
                         self.config.cycle_time)  # fmt: skip
        self.eager_budget = eager.budget(self.size, setting.fusion_threshold)
        if setting.cache != (self.rounds is not None):
            capacity = self.config.cache_capacity or DEFAULT_CAPACITY
            self.rounds = (
                CacheRound(ResponseCache(capacity), self.size, self.arrivals) if cache else None
            )
        if final >= 0.5:
            logger.info("autotune settled on %s", setting)
