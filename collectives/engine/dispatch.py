"""Running the ops a round made ready: fusion into buckets, the collectives, completion.

A round (see :mod:`.cycle`) ends with the ops every member announced, in the same order on
every member. :class:`Dispatch` turns them into :class:`~collectives.engine.fusion.Work`
(this rank's own request, or the description of an op this rank takes part in without having
submitted it, after ``hvd.join()``), plans the buckets (:func:`~collectives.engine.fusion.plan`,
alike on every member), runs them (:class:`~collectives.engine.execute.Executor`), then the
control ops, and completes the handles.

Ownership: a Dispatch belongs to one process set's cycle runner and is used only by the
holder of that set's cycle lock; ``current`` (the requests of the round being run, failed
with the round if it fails) and ``tl`` (the engine's timeline, read by the runner at the
start of each cycle, with its ``round_id``) are its only state besides the executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from collectives.engine import eager, streams
from collectives.engine.config import EngineConfig
from collectives.engine.execute import Executor, Group
from collectives.engine.fusion import Bucket, Work, plan
from collectives.engine.negotiation import Entry
from collectives.engine.queue import Submissions
from collectives.engine.requests import (
    ALLGATHER,
    ALLTOALL,
    BARRIER,
    REDUCESCATTER,
    Computing,
    Request,
    check_alltoall,
    label,
)
from collectives.engine.timeline import Timeline
from collectives.errors import InvalidArgumentsError

__all__ = ["Controls", "Dispatch"]

#: The per-rank parts of ops that have none (never written to).
_NO_VARS: dict[int, str] = {}
#: Device types whose tensors the executor can move (Gloo and NCCL).
_MOVABLE = frozenset(("cpu", "cuda"))
_PER_RANK = (ALLGATHER, ALLTOALL)  # (ops with a per-rank part)

#: Runs a ready control op (join, process sets; a barrier has none) and returns its result.
Controls = Callable[[Entry], Any]
#: The same, also given this rank's request of the op (None if it did not submit it).
RunControl = Callable[[Entry, Request | None], Any]
#: A control op that is ready, with this rank's request (None if it did not submit it).
Control = tuple[Entry | None, Request | None]


def _rode(tl: Timeline, riders: list[Request], start: float, end: float) -> None:
    """The timeline of ops whose data rode the round that made them ready (see
    :mod:`.eager`, :mod:`.rounds`): no queue to wait in, and their reduction from the round's
    data (``start`` to ``end``) as their collective, REDUCE_FROM_NEGOTIATION."""
    for request in riders:
        tl.end(request.row, "QUEUE", start)
        tl.begin(request.row, "REDUCE_FROM_NEGOTIATION", start)
        tl.end(request.row, "REDUCE_FROM_NEGOTIATION", end)


class Dispatch:
    """Runs one process set's ready ops on this rank."""

    def __init__(
        self,
        group: Group,
        queue: Submissions,
        data_pg: Any,
        controls: RunControl,
        config: EngineConfig,
    ) -> None:
        self.group = group
        self.queue = queue
        self.executor = Executor(self.trace_phase, group, data_pg)
        #: The engine's timeline as the runner read it at the start of the cycle, and the
        #: cycle's round ("set:cycle", alike on every member) for its NEGOTIATE phases.
        self.tl: Timeline | None = None
        self.round_id = ""
        self.controls = controls
        self.fusion_threshold = config.fusion_threshold
        self.cuda_fusion_threshold = config.cuda_fusion_threshold
        self.current: list[Request] = []  # the round's requests until they completed

    def agreed(
        self,
        new: list[Request],
        now: float,
        riders: eager.Riders | None,
        datas: Sequence[Any],
    ) -> None:
        """Runs a round every member announced alike (``new``, in order); ``riders``' data
        came along with the announcements (``datas``: every member's, in set order)."""
        self.queue.finished(new)
        self.current.extend(new)
        tl = self.tl
        if tl is not None:
            self._negotiated(tl, new, now)
        if riders is not None:
            eager.reduce_locally(riders, datas)
            if tl is not None:
                _rode(tl, riders.requests, now, time.monotonic())
            for request in riders.requests:
                self.complete(request, None)
            rode = {id(request) for request in riders.requests}
            new = [request for request in new if id(request) not in rode]
        members = self.group.ranks
        works: list[Work] = []
        controls: list[Control] = []
        for request in new:
            kind = request.kind
            if kind == BARRIER:
                controls.append((None, request))
                continue
            vars_ = _NO_VARS
            if kind in _PER_RANK:
                vars_ = {rank_: request.var for rank_ in members}
                if kind == ALLTOALL:
                    error = check_alltoall(request.name, members, vars_)
                    if error is not None:
                        request.handle.fail(InvalidArgumentsError(error))
                        continue
            works.append(Work.of(request, vars_, 0))
        self.execute(works, controls)

    def cached(self, agreed: list[Request], riders: list[Request], now: float) -> None:
        """Runs the ops a cache round agreed on; the riders' results are already in."""
        if riders:
            self.queue.finished(riders)
            tl = self.tl
            if tl is not None:  # (reduced by the round itself: nothing left to time)
                self._negotiated(tl, riders, now)
                _rode(tl, riders, now, now)
            for request in riders:
                self.complete(request, None)
            if len(riders) == len(agreed):  # (riders are among the agreed ops)
                agreed = []
            else:
                rode = {id(request) for request in riders}
                agreed = [request for request in agreed if id(request) not in rode]
        if agreed:
            self.agreed(agreed, now, None, ())

    def ready(self, ready: list[tuple[Entry, Request | None]]) -> None:
        """Runs ops that became ready and passed their checks, in order (``Request`` None:
        this rank takes part without having submitted the op)."""
        works: list[Work] = []
        controls: list[Control] = []
        for entry, request in ready:
            kind = entry.kind
            if kind > REDUCESCATTER:
                controls.append((entry, request))
            elif request is not None:
                works.append(Work.of(request, entry.vars, entry.order))
            else:
                first_sig = next(iter(entry.sigs.values()))
                works.append(
                    Work.joined(
                        kind, entry.name, entry.process_set_id, first_sig, entry.vars, entry.order
                    )
                )
        self.execute(works, controls)

    def execute(self, works: list[Work], controls: list[Control]) -> None:
        """Runs the data ops (fused into buckets), then the control ops, of one round."""
        tl = self.tl
        works = [work for work in works if self._supported(work)]
        members = {self.group.process_set_id: self.group.ranks}
        buckets = plan(works, members, self.fusion_threshold, self.cuda_fusion_threshold)
        for work in works:
            if work.remaining == 0:
                self.complete(work.request, None)
        for bucket in buckets:
            if tl is not None:
                started = time.monotonic()
                for queued in bucket.requests():
                    tl.end(queued.row, "QUEUE", started)
            event = self.executor.run(bucket)
            for slot in bucket.slots:
                work = slot.work
                work.remaining -= 1
                if work.remaining == 0 and work.request is not None:
                    self.complete(work.request, event)
        for entry, control in controls:
            result = self.controls(entry, control) if entry is not None else None
            self.complete(control, None, result)
        self.current = []

    def _negotiated(self, tl: Timeline, requests: list[Request], now: float) -> None:
        """Every member announced ``requests`` together (the timeline's ticks)."""
        seen = dict.fromkeys(self.group.ranks, now)
        for request in requests:
            tl.negotiated(request.row, request.kind.label.upper(), seen, now, self.round_id)

    def trace_phase(self, bucket: Bucket, phase: str, start: float, end: float) -> None:
        """The executor's tracer: a phase of every request in the bucket."""
        tl = self.tl
        if tl is not None:
            for request in bucket.requests():
                tl.begin(request.row, phase, start)
                tl.end(request.row, phase, end)

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

    def complete(self, request: Request | None, event: Any, result: Any = None) -> None:
        """Completes a request's handle: a data op with its finished outputs."""
        if request is None:
            return
        tl = self.tl
        if tl is not None:
            tl.end(request.row, request.kind.label.upper(), time.monotonic())
        if request.kind <= REDUCESCATTER:  # moves data
            finish = request.finish
            if finish is None:
                result = request.extra
            elif event is not None and type(finish) is Computing:
                # Kernels on the outputs, on the stream that ran the op's: its waiters wait
                # for them too.
                result, event = streams.computed(
                    event, request.stream, request.home, lambda: finish(request)
                )
            else:
                result = finish(request)
        request.handle.complete(result, event)
