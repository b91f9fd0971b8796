"""The lanes: a blocking op runs its predicted round on the caller's thread, at once.

A training loop that repeats one blocking op (a loss, a metric, ``hvd.allreduce_`` of a
scalar, a broadcast, an allgather of ids) would otherwise pay for a request, a queue, a
cycle's bookkeeping and maybe a thread switch per call. When the set's response cache
predicts exactly that op as the next round (see :mod:`.rounds`), the calling thread takes the
set's cycle lock and runs that round itself:

* :func:`run_now` (the request lane) for a blocking op that already has its request: a
  small allreduce rides the round; any other op, once the round agreed, runs its
  collectives here as the cycle's dispatch would;
* :func:`run_hot` (the hot lane) for ``allreduce_`` of the global set repeated in a loop:
  the op alike the one that ran in a lane in the round the cache predicts next (its
  :class:`~collectives.engine.cycle.HotPrint`: the op just run, when one op repeats; in a
  pattern of ops that take turns, the one whose turn it is),
  reduced in place with no request, handle or lock built at all: a few checks and two
  copies around the round for a small op that rides it (a 4-byte op spends as much time in
  Python as in Gloo), or the round and then the allreduce of the tensor itself
  (:meth:`~collectives.engine.execute.Executor.reduce_in_place`) for one that does not: a
  large one, an integer one, a CUDA one (on the caller's current stream, which a blocking
  op runs on anyway; see :mod:`.streams`). At size 1 the round costs no collective, and a
  CUDA op costs its NCCL call and a few microseconds of Python.

If another member's ops differ (every member sees NaN), every member falls back to the full
negotiation of that same cycle, the op announced in it as if it had been queued. Both lanes
run only while the set is idle (nothing queued or in flight, no pending table, no timeline
or autotune to feed) and never on the set's own thread.

Ownership: the lanes are functions over a :class:`~collectives.engine.controller.Controller`;
everything they touch of its runner they touch holding its cycle lock. The one read before
taking the lock is the runner's ``hot`` fingerprint in :func:`run_hot`, an immutable value
used as a hint and checked again under the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from collectives.engine.cycle import hot_print
from collectives.engine.execute import dense
from collectives.engine.handles import Handle
from collectives.engine.reduction import Reduction
from collectives.engine.requests import Request
from collectives.engine.rounds import AGREED, DIFFERED, RODE
from collectives.errors import HorovodInternalError

if TYPE_CHECKING:
    from collectives.engine.controller import Controller

__all__ = ["run_hot", "run_now"]

#: The handle the hot lane returns: the op finished (the caller holds the result).
DONE = Handle.finished(None)


def _enter(controller: Controller) -> bool:
    """Whether a lane may run a round on the calling thread now; True with the cycle lock
    taken (the caller releases it). Ops that other threads queue from here on go to the
    next cycle."""
    runner = controller.runner
    if (
        controller.timeline.current is not None  # (the lanes do not feed a timeline)
        or runner.tuner is not None
        or threading.get_ident() == controller.thread_ident
        or not controller.cycle_lock.acquire(blocking=False)
    ):
        return False
    rounds = runner.rounds
    idle = (
        rounds is not None
        and rounds.predicts_one()
        and not runner.table.entries
        and not runner.table.joined
        and controller.queue.idle()
    )
    if not idle:
        controller.cycle_lock.release()
    return idle


def run_now(controller: Controller, request: Request) -> bool:
    """The request lane. True when the request is in the engine's hands (finished,
    failed, or pending after every member fell back to the full negotiation); False when
    the lane is closed and the caller submits it as usual."""
    if not _enter(controller):
        return False
    runner = controller.runner
    try:
        ran = False

        def lane() -> bool:
            nonlocal ran
            rounds = runner.rounds
            assert rounds is not None
            dispatch = runner.dispatch
            # Decided before any collective: every member runs this cycle's cache round,
            # here or in a cycle, with the same vector.
            dispatch.current = [request]  # (failed with the cycle if anything below fails)
            outcome = rounds.run_one(runner.control_pg, request)
            dispatch.current = []
            if outcome is None:
                return True  # not exactly the predicted op: nothing ran
            ran = True
            runner.lane_ran(outcome != DIFFERED)
            if outcome == DIFFERED:
                return runner.lane_fallback(request)
            if outcome == RODE:
                dispatch.complete(request, None)
            else:  # agreed: its collectives run here, as the cycle's dispatch would run them
                dispatch.cached([request], [], time.monotonic())
            runner.hot = rounds.next_hot(hot_print(request, outcome == RODE))
            return True

        controller.guarded_cycle(lane)
        return ran
    finally:
        controller.cycle_lock.release()


def run_hot(
    controller: Controller,
    draw: Callable[[], int],
    name: str | None,
    tensor: torch.Tensor,
    reduction: Reduction,
    build: Callable[[int], Request],
) -> Handle | None:
    """The hot lane: ``tensor`` reduced in place with ``reduction``, the op ``name`` (None
    for an unnamed op, whose counter ``draw`` draws) alike the op predicted next, as it ran in
    a lane before.
    Returns None when the lane is closed (nothing ran, no counter drawn); else the op's
    handle: finished, or as the op goes on as usual (``build`` makes its request from its
    counter) when it was not the one predicted, or when another member's ops differed."""
    runner = controller.runner
    hot = runner.hot  # (a hint, checked again under the lock)
    if (
        hot is None
        or hot.name != name
        or hot.reduction != reduction
        or not isinstance(tensor, torch.Tensor)
        or tensor.dtype is not hot.dtype
        or tensor.shape != hot.shape
        # (no autograd history to keep out of the copies: grad mode may stay as it is)
        or tensor.requires_grad
        or tensor.get_device() != hot.device
        or tensor.layout is not torch.strided
        or (not hot.rode and not dense(tensor))
        or controller.timeline.current is not None  # (the lanes do not feed a timeline)
        or not controller.cycle_lock.acquire(blocking=False)
    ):
        return None
    try:
        # No cycle ran since the lanes' last round (a cycle clears ``hot``), and the set is
        # idle: the table is empty and the cache's prediction and layout are the ones the
        # lanes left, for the op ``hot`` prints.
        if runner.hot is not hot or not controller.queue.idle():
            return None
        rounds = runner.rounds
        assert rounds is not None
        counter = -1 if name is not None else draw()
        try:
            outcome = rounds.run_lone(runner.control_pg, counter + 1, tensor, reduction, name)
            if outcome == AGREED:
                started = time.perf_counter()
                runner.dispatch.executor.reduce_in_place(tensor, reduction)
                runner.arrivals.busy += time.perf_counter() - started
        except BaseException as error:
            controller.cycle_failed(error)
            failed = Handle()
            failed.fail(HorovodInternalError(str(controller.queue.error)))
            return failed
        request = build(counter) if outcome is None or outcome == DIFFERED else None
        if outcome is not None:
            runner.lane_ran(outcome != DIFFERED)
            if outcome != DIFFERED:
                runner.stats["hot_rounds"] += 1
                runner.hot = rounds.next_hot(hot)
                return DONE
            assert request is not None
            fallback = request
            controller.guarded_cycle(lambda: runner.lane_fallback(fallback))
            return request.handle
    finally:
        controller.cycle_lock.release()
    # Not the op predicted after all (its counter differs): nothing ran; as usual.
    assert request is not None
    return request.handle if run_now(controller, request) else controller.submit(request, True)
