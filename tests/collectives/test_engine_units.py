"""The engine's parts in one process: the scheduler with a fake clock, the queue under two
threads, the reduction's steps per dtype, the cache's keys and predictions, and the engine
itself on one-rank Gloo groups (lanes, process sets, failure, shutdown)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroupGloo

from collectives.common import ReduceOp
from collectives.engine import execute, streams
from collectives.engine.cache import ResponseCache, is_unnamed, key_of, keys_of, ordinal
from collectives.engine.config import EngineConfig
from collectives.engine.core import Engine
from collectives.engine.dispatch import Dispatch
from collectives.engine.execute import Group
from collectives.engine.handles import Handle
from collectives.engine.queue import Submissions
from collectives.engine.reduction import PLAIN_SUM, Reduction
from collectives.engine.requests import Computing, Kind, Request, TensorSpec, noname, signature
from collectives.engine.rounds import RODE, CacheRound
from collectives.engine.scheduler import KEEPALIVE_SECONDS, Due, Pace, seconds_until_cycle
from collectives.errors import HorovodInternalError

# ---- the scheduler, with a fake clock ------------------------------------------------

CYCLE = 0.001


def test_leaving_or_a_flush_cycles_at_once() -> None:
    pace = Pace(last_cycle=5.0, last_round=5.0, cycle_time=CYCLE)
    assert seconds_until_cycle(Due(urgent=True), pace, now=5.0) == 0.0
    flushed = Due(pending=True, flush=True, first_new=5.0, last_submit=5.0)
    assert seconds_until_cycle(flushed, pace, now=5.0) == 0.0


def test_new_ops_are_gathered_for_the_cycle_time_and_until_a_burst_pauses() -> None:
    pace = Pace(cycle_time=CYCLE)
    one = Due(pending=True, first_new=10.0, last_submit=10.0)
    assert seconds_until_cycle(one, pace, now=10.0) == pytest.approx(CYCLE)
    # A burst still coming: due one cycle time after its last submission...
    burst = Due(pending=True, first_new=10.0, last_submit=10.005)
    assert seconds_until_cycle(burst, pace, now=10.005) == pytest.approx(CYCLE)
    # ... but never later than BURST_MAX cycle times after its first.
    endless = Due(pending=True, first_new=10.0, last_submit=10.5)
    assert seconds_until_cycle(endless, pace, now=10.5) == pytest.approx(10.02 - 10.5)


def test_waiting_for_another_rank_paces_only_quiet_rounds() -> None:
    flowing = Pace(awaiting=True, quiet=False, last_cycle=3.0, last_round=3.0, cycle_time=CYCLE)
    assert seconds_until_cycle(Due(), flowing, now=3.0) == 0.0
    quiet = flowing._replace(quiet=True)
    assert seconds_until_cycle(Due(), quiet, now=3.0) == pytest.approx(CYCLE)


def test_idle_sets_keep_alive_from_the_end_of_the_last_round() -> None:
    pace = Pace(last_cycle=1.0, last_round=2.0, cycle_time=CYCLE)
    assert seconds_until_cycle(Due(), pace, now=2.5) == pytest.approx(KEEPALIVE_SECONDS - 0.5)


# ---- a CUDA op's completion, with stand-ins for the GPU --------------------------------


class _Stream:
    device_index = 0

    def __init__(self, raw: int) -> None:
        self.raw = raw
        self.waited_for: list[tuple[_Event, int]] = []  # (event, its records then)

    def wait_event(self, event: _Event) -> None:
        self.waited_for.append((event, len(event.recorded_on)))


class _Event:
    def __init__(self) -> None:
        self.waited_by: list[int] = []
        self.recorded_on: list[int] = []

    def wait(self, stream: _Stream) -> None:
        self.waited_by.append(stream.raw)

    def record(self, stream: _Stream) -> None:
        self.recorded_on.append(stream.raw)

    passed = False  # (its kernels ended)
    waited_on_host = False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.waited_on_host = self.passed = True


class _OnDevice:
    """A stand-in CUDA tensor: its device and nothing else."""

    is_cuda = False  # (so that the engine's stream records no use of it)

    def get_device(self) -> int:
        return 0


def test_a_finished_handle_no_longer_holds_what_it_would_flush() -> None:
    # A handle keeps its result until hvd.synchronize() (as Horovod's do), but one never
    # synchronized kept its set's controller through its flush, and with it a shut-down
    # engine (its cache, its staging buffers): one engine more per hvd.init() round.
    class Controller:
        def flush(self) -> None:
            pass

    for finish in (lambda h: h.complete(1), lambda h: h.fail(RuntimeError("peer died"))):
        controller = Controller()
        handle = Handle(controller.flush)
        alive = weakref.ref(controller)
        finish(handle)
        del controller
        gc.collect()
        assert alive() is None
        assert handle.done()


def test_a_cuda_result_orders_each_stream_that_waits_for_it_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A burst's handles share their bucket's event: the waiter's current stream waits for
    # it once, and a stream made current later waits too (CUDA stands in: no GPU here).
    cuda = _FakeCuda(monkeypatch)
    event = _Event()
    handles = [Handle() for _ in range(3)]
    for number, handle in enumerate(handles):
        handle.complete(number, event)
    assert [handle.wait() for handle in handles] == [0, 1, 2]
    assert event.waited_by == [7]
    cuda.current = 9  # another stream is current now (torch.cuda.stream(side))
    assert handles[0].wait() == 0 and handles[1].wait() == 1
    assert event.waited_by == [7, 9]


class _FakeCuda:
    """CUDA's streams and events stood in for (no GPU here): ``current`` is the raw id of
    the current stream; ``made`` the streams the engine made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.current = 7
        self.made: list[_Stream] = []
        monkeypatch.setattr(streams, "_raw", lambda device: self.current)
        monkeypatch.setattr(streams, "_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device: _Stream(self.current))
        monkeypatch.setattr(torch.cuda, "Stream", self._new_stream)
        monkeypatch.setattr(torch.cuda, "Event", _Event)
        monkeypatch.setattr(torch.cuda, "set_stream", self._set_stream)
        monkeypatch.setattr(streams, "_known", {})
        monkeypatch.setattr(streams, "_spare", {})

    def _new_stream(self, device: Any) -> _Stream:
        self.made.append(_Stream(99))
        return self.made[-1]

    def _set_stream(self, stream: _Stream) -> None:
        self.current = stream.raw


def test_a_submissions_event_is_recorded_again_only_once_a_stream_waited_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An asynchronous CUDA op marks its position on its stream with an event; once the
    # engine's stream waits for it, the event serves the next submission (CUDA stands in).
    cuda = _FakeCuda(monkeypatch)
    tensor: Any = _OnDevice()
    first, second, third, fourth = (_request(name) for name in ("a", "b", "c", "d"))
    first.stream, first.ready = streams.ready(tensor, blocking=False)
    second.stream, second.ready = streams.ready(tensor, blocking=False)
    event, other = first.ready, second.ready
    assert event is not other  # (both in flight: two events)
    with streams.EngineStreams().running([first], torch.device("cuda", 0)):
        pass
    (own,) = cuda.made
    assert own.waited_for == [(event, 1)] and cuda.current == 7  # (switched back)
    third.stream, third.ready = streams.ready(tensor, blocking=False)
    assert third.ready is event and event.recorded_on == [7, 7]  # recorded again
    fourth.stream, fourth.ready = streams.ready(tensor, blocking=False)
    assert fourth.ready is not event and fourth.ready is not other  # (none spare)


def test_a_bucket_waits_once_per_submitting_stream_for_its_last_position(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A burst of asynchronous CUDA ops from one stream and one op from another, fused in
    # another order than they were submitted: the engine's stream waits for the position
    # of the last op submitted on each stream (a stream runs in order), and every event is
    # spare afterwards (CUDA stands in).
    cuda = _FakeCuda(monkeypatch)
    tensor: Any = _OnDevice()
    burst = [_request(name) for name in ("a", "b", "c")]
    for request in burst:
        request.stream, request.ready = streams.ready(tensor, blocking=False)
    cuda.current = 8  # (a side stream)
    side = _request("d")
    side.stream, side.ready = streams.ready(tensor, blocking=False)
    events = [request.ready for request in (*burst, side)]
    cuda.current = 7
    bucket = [burst[2], burst[0], side, burst[1]]
    with streams.EngineStreams().running(bucket, torch.device("cuda", 0)):
        pass
    (own,) = cuda.made
    assert own.waited_for == [(events[2], 1), (events[3], 1)]
    again = [streams.ready(tensor, blocking=False)[1] for _ in range(4)]
    assert sorted(map(id, again)) == sorted(map(id, events))  # (no new event)


class _Held:
    """A stand-in CUDA tensor that a bucket used: who refers to it, and its record_stream."""

    is_cuda = True

    def __init__(self) -> None:
        self.recorded_on: list[int] = []

    def record_stream(self, stream: _Stream) -> None:
        self.recorded_on.append(stream.raw)


def test_a_bucket_holds_its_tensors_until_its_kernels_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The tensors a bucket used on the engine's stream stay referenced (so the caching
    # allocator cannot reuse their memory) until the event after its kernels passed: let go
    # at a later bucket, waited for on the host past KEEP_MAX buckets, and marked with
    # record_stream when the streams are released (CUDA stands in).
    _FakeCuda(monkeypatch)
    monkeypatch.setattr(streams, "KEEP_MAX", 3)
    engine = streams.EngineStreams()
    position: Any = _OnDevice()

    def bucket(name: str) -> tuple[weakref.ref[_Held], _Event]:
        held = _Held()
        request = _request(name)
        request.inputs = request.outputs = [held]  # type: ignore[list-item]
        request.stream, request.ready = streams.ready(position, blocking=False)
        with engine.running([request], torch.device("cuda", 0)) as done:
            pass
        return weakref.ref(held), done[0]

    first, first_end = bucket("a")
    assert first() is not None  # (its kernels may still run)
    first_end.passed = True
    engine.let_go()  # (what every cycle does, an idle set's keep-alive cycles included)
    assert first() is None and not first_end.waited_on_host
    second, second_end = bucket("b")
    assert second() is not None
    third, _ = bucket("c")
    fourth, _ = bucket("d")  # (three held now: b, c and d)
    assert second() is not None and not second_end.waited_on_host
    fifth, _ = bucket("e")
    assert second_end.waited_on_host and second() is None  # (the oldest, waited for)
    kept = [ref() for ref in (third, fourth, fifth)]
    engine.release()
    assert [held.recorded_on for held in kept if held is not None] == [[99]] * 3
    del kept
    assert [ref() for ref in (third, fourth, fifth)] == [None] * 3


def test_a_bucket_that_failed_partway_holds_what_it_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # A bucket that raises partway (its collective failed) may have queued kernels already:
    # its tensors stay held until the event after them, which becomes the device's latest,
    # so a fusion buffer replaced after it is held until then as well (CUDA stands in).
    _FakeCuda(monkeypatch)
    events: list[_Event] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: events.append(_Event()) or events[-1])
    engine, device = streams.EngineStreams(), torch.device("cuda", 0)
    held = _Held()
    request = _request("a")
    request.inputs = request.outputs = [held]  # type: ignore[list-item]
    request.stream, request.ready = streams.ready(_OnDevice(), blocking=False)
    with pytest.raises(RuntimeError, match="failed"), engine.running([request], device):
        raise RuntimeError("the collective failed")
    used = weakref.ref(held)
    del held, request
    buffer = torch.empty(4)
    replaced = weakref.ref(buffer)
    engine.retire(device, buffer)
    del buffer
    engine.let_go()
    assert used() is not None and replaced() is not None  # (the kernels may still run)
    events[-1].passed = True  # (the event recorded after the failed bucket)
    engine.let_go()
    assert used() is None and replaced() is None


def test_a_finish_that_computes_runs_after_the_ops_kernels_and_its_waiters_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Adasum's tree and a sparse sum compute on an op's CUDA outputs when the engine
    # completes it: on the stream that ran the op, after its kernels, while the submitting
    # stream goes on; the results are marked as used by the submitting stream, and the
    # handle carries the event after the finish's kernels. A finish that only hands out the
    # outputs costs none of this (CUDA stands in).
    cuda = _FakeCuda(monkeypatch)
    config = EngineConfig()
    dispatch = Dispatch(Group(0, [0], 0), Submissions(0), None, lambda entry: None, config)
    home = streams.current(0)  # (stream 7 submitted the op)
    cuda.current = 42
    engine_stream = streams.current(0)  # (stream 42 ran it)
    cuda.current = 5  # (the thread that completes it is on another stream)
    bucket_end, results = _Event(), [_Held(), _Held()]
    seen: list[tuple[int, int]] = []

    def tree(request: Request) -> list[_Held]:
        seen.append((cuda.current, len(engine_stream.waited_for)))
        return results

    computing = _request("a")
    computing.finish = Computing(tree)
    computing.stream, computing.home = engine_stream, home
    dispatch.complete(computing, bucket_end)
    assert seen == [(42, 1)] and engine_stream.waited_for == [(bucket_end, 0)]
    assert cuda.current == 5 and [held.recorded_on for held in results] == [[7], [7]]
    after = computing.handle.cuda_event
    assert after is not bucket_end and after.recorded_on == [42] and home.waited_for == []
    assert computing.handle.wait() is results and after.waited_by == [5]
    plain, other_end = _request("b"), _Event()
    plain.stream, plain.home = engine_stream, home
    dispatch.complete(plain, other_end)
    assert plain.handle.cuda_event is other_end and len(engine_stream.waited_for) == 1


def test_an_output_the_engine_allocates_is_marked_used_by_the_submitting_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An allgather's output is allocated on the stream that writes it (the engine's, which
    # waited for the op's position, no later), and marked as used by the stream the op was
    # submitted from, where its caller uses and frees it: the caching allocator then waits
    # for that stream's work before reusing the memory (CUDA stands in).
    cuda = _FakeCuda(monkeypatch)
    made_on: list[int] = []

    def empty(*args: Any, **kwargs: Any) -> _Held:
        made_on.append(cuda.current)
        return _Held()

    monkeypatch.setattr(torch, "empty", empty)
    request = _request("a")
    request.home = streams.current(0)  # (submitted from stream 7)
    cuda.current = 99  # (the engine's stream runs the bucket)
    out: Any = execute.engine_output(request, (2, 3), torch.float32, torch.device("cuda", 0))
    assert made_on == [99] and out.recorded_on == [7]
    joined: Any = execute.engine_output(None, (2, 3), torch.float32, torch.device("cuda", 0))
    cuda.current = 7  # (a blocking op run on its caller's stream)
    here: Any = execute.engine_output(request, (2, 3), torch.float32, torch.device("cuda", 0))
    assert joined.recorded_on == [] and here.recorded_on == [] and made_on == [99, 99, 7]


# ---- the queue, under two threads ----------------------------------------------------


def _request(
    name: str,
    tensor: torch.Tensor | None = None,
    reduction: Reduction = PLAIN_SUM,
    set_id: int = 0,
    handle: Handle | None = None,
    kind: Kind = Kind.ALLREDUCE,
) -> Request:
    tensor = torch.ones(2) if tensor is None else tensor
    common: tuple[Any, ...] = reduction if kind == Kind.ALLREDUCE else ()
    request = Request(
        kind,
        f"{kind.label}.{name}",
        set_id,
        [tensor],
        [tensor],
        handle or Handle(),
        reduction,
        sig=signature(kind, common, [tensor]),
        specs=[TensorSpec.of(tensor.dtype, tuple(tensor.shape), tensor.device.type)],
        finish=lambda r: r.outputs[0],
    )
    request.submitted = time.monotonic()
    return request


def test_two_threads_submit_and_one_cycle_takes_everything_in_order() -> None:
    queue = Submissions(rank=0)
    start = threading.Barrier(2)

    def submit(prefix: str) -> None:
        start.wait()
        for i in range(300):
            queue.add(_request(f"{prefix}{i}"), blocking=False)

    threads = [threading.Thread(target=submit, args=(p,)) for p in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    held, taken, flags = queue.take()
    assert held == [] and flags == 0 and len(taken) == 600
    for prefix in "ab":
        mine = [r.name for r in taken if r.name.startswith(f"allreduce.{prefix}")]
        assert mine == [f"allreduce.{prefix}{i}" for i in range(300)]
    assert queue.take() == ([], [], 0)
    with pytest.raises(ValueError, match="'a7' is already in flight"):
        queue.add(_request("a7"), blocking=False)  # taken, not finished: still in flight
    queue.finished(taken)
    queue.add(_request("a7"), blocking=False)


def test_a_waiting_thread_wakes_for_a_submission_and_stops_with_a_failure() -> None:
    queue = Submissions(rank=3)
    pace = Pace(last_cycle=time.monotonic(), last_round=time.monotonic(), cycle_time=CYCLE)
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(queue.wait_until_due(lambda: pace)))
    waiter.start()
    queued = _request("x")
    queue.add(queued, blocking=False)  # due one cycle time later, far before the keepalive
    waiter.join(KEEPALIVE_SECONDS / 2)
    assert woke == [True]
    waiter = threading.Thread(target=lambda: woke.append(queue.wait_until_due(lambda: pace)))
    queue.take()
    waiter.start()
    queue.fail("rank 3: a peer died")
    waiter.join(KEEPALIVE_SECONDS / 2)
    assert woke == [True, False]
    with pytest.raises(HorovodInternalError, match="a peer died"):
        queued.handle.wait()
    with pytest.raises(HorovodInternalError, match="a peer died"):
        queue.add(_request("y"), blocking=True)


def test_cancelled_ops_fail_and_the_set_keeps_running() -> None:
    queue = Submissions(rank=0)
    queued = _request("x", set_id=4)
    queue.add(queued, blocking=False)
    queue.fail_pending(lambda r: ValueError(f"{r.label}: its process set 4 was removed"))
    with pytest.raises(ValueError, match="allreduce 'x': its process set 4 was removed"):
        queued.handle.wait()
    assert queue.running and queue.idle()


def test_held_ops_come_first_in_the_next_cycle_unless_they_failed_meanwhile() -> None:
    queue = Submissions(rank=0)
    first, second = _request("a"), _request("b")
    queue.add(first, blocking=False)
    queue.add(second, blocking=False)
    assert queue.take() == ([], [first, second], 0)
    queue.hold([second])  # (a cache round ran the first; the second waits for a peer)
    later = _request("c")
    queue.add(later, blocking=False)
    assert queue.take() == ([second], [later], 0)
    queue.finished([first, later])
    assert not queue.idle()  # (the held op is still in flight)
    queue.hold([second])
    queue.fail_pending(lambda r: ValueError(f"{r.label}: cancelled"))
    queue.hold([second])  # (a cycle that ran meanwhile: the op failed, it stays failed)
    assert queue.take() == ([], [], 0)
    with pytest.raises(ValueError, match="'b': cancelled"):
        second.handle.wait()


# ---- the reduction's steps, per dtype ---------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.uint8,
    ],
)
def test_stage_and_finish_scale_as_horovod_does(dtype: torch.dtype) -> None:
    source = torch.tensor([3, 5, 7, 100], dtype=dtype)
    floating = dtype.is_floating_point
    reduction = Reduction(int(ReduceOp.AVERAGE), 0.5, 3.0)
    staged = torch.empty_like(source)
    reduction.stage(staged, source)
    if floating:
        assert torch.equal(staged, source * 0.5)
    else:  # scaled in float64, truncated toward zero
        assert torch.equal(staged, torch.trunc(source.double() * 0.5).to(dtype))
    summed = staged * 2  # two ranks sent the same
    reduction.finish(summed, size=2)
    expected = (source * 0.5 * 2) * (3.0 / 2) if floating else None
    if floating:
        assert torch.equal(summed, expected)
    else:
        want = torch.trunc(torch.trunc(source.double() * 0.5).to(dtype).double() * 2 * 1.5)
        assert torch.equal(summed, want.to(dtype))
    # An integer average with no scaling rounds toward zero; staging into float64 casts first.
    plain = torch.tensor([7, -7, 9], dtype=torch.int64)
    Reduction(int(ReduceOp.AVERAGE)).finish(plain, size=2)
    assert plain.tolist() == [3, -3, 4]
    wide = torch.empty(4, dtype=torch.float64)
    Reduction(int(ReduceOp.SUM), 0.25).stage(wide, source)
    assert torch.equal(wide, source.double() * 0.25)


# ---- the response cache's keys and rounds, on a one-rank Gloo group -------------------


def _gloo(store: Any, name: str) -> Any:
    return ProcessGroupGloo(dist.PrefixStore(name, store), 0, 1, datetime.timedelta(seconds=20))


@pytest.fixture
def store() -> Any:
    return dist.HashStore()


def test_unnamed_ops_share_a_key_by_their_place_in_the_round() -> None:
    key, counter = key_of(Kind.ALLREDUCE, 0, noname(Kind.ALLREDUCE, 41), "f32[2]@cpu", "")
    assert counter == 42 and is_unnamed(key)
    named, zero = key_of(Kind.ALLREDUCE, 0, "allreduce.noname.x", "f32[2]@cpu", "")
    assert zero == 0 and not is_unnamed(named)
    requests = [_request(f"noname.{i}") for i in range(3)]
    keys = keys_of(requests)
    assert [c for _, c in keys] == [1, 2, 3]
    assert len({k for k, _ in keys}) == 3  # the k-th alike op has an entry of its own
    assert ordinal(named, 0, {}) == named


def test_repeated_rounds_are_predicted_and_a_different_op_falls_back(store: Any) -> None:
    group = _gloo(store, "cache/")
    rounds = CacheRound(ResponseCache(16), size=1)
    step = [_request("a", torch.ones(3)), _request("b", torch.ones(2, 2))]
    for request in step:
        rounds.cache.use(keys_of([request])[0][0])
    outcomes = []
    for _ in range(4):
        for request in step:
            request.outputs = [torch.zeros_like(request.inputs[0])]
        outcomes.append(rounds.run(group, step, False, None))
        assert outcomes[-1] is not None
    assert rounds.predicted_rounds >= 1  # from the third alike round on
    agreed, riders = outcomes[-1]
    assert agreed == step and riders == step  # small sums carry their data in the round
    assert all(torch.equal(r.outputs[0], r.inputs[0]) for r in step)
    other = [_request("c", torch.ones(5))]
    assert rounds.run(group, other, False, None) is None  # not predicted: full negotiation
    assert rounds.run(group, step, True, None) is None  # dirty (a control op, a new op)


def test_ops_that_take_turns_are_predicted_round_by_round(store: Any) -> None:
    # A loss and an accuracy averaged in turn, then an unnamed op whose counter moves on:
    # a pattern of three rounds, predicted once it repeated; each round carries its own
    # op's data.
    group = _gloo(store, "turns/")
    rounds = CacheRound(ResponseCache(16), size=1)
    loss, accuracy = _request("loss", torch.ones(3)), _request("acc", torch.full((2,), 2.0))
    for request in (loss, accuracy, _request("noname.0", torch.zeros(4))):
        rounds.cache.use(keys_of([request])[0][0])
    for turn in range(5):
        unnamed = _request(f"noname.{turn}", torch.full((4,), float(turn)))
        for request in (loss, accuracy, unnamed):
            request.outputs = [torch.zeros_like(request.inputs[0])]
            outcome = rounds.run(group, [request], False, None)
            assert outcome is not None and outcome[0] == [request], (turn, request.name)
            if turn >= 2:  # predicted: its data rode the round
                assert outcome[1] == [request], (turn, request.name)
                assert torch.equal(request.outputs[0], request.inputs[0])
    assert rounds.predicted_rounds == 9  # from the third turn on
    assert rounds.predicts_one()  # (the loss's round is next: the hot lane may run it)
    assert rounds.run_lone(group, 0, torch.full((3,), 5.0), PLAIN_SUM, "allreduce.loss") == RODE
    assert rounds.run(group, [loss], False, None) is None  # out of turn: full negotiation
    assert rounds.predicted_rounds == 10 and not rounds.predicts_one()


def test_an_op_that_only_some_members_submitted_waits_for_the_others(store: Any) -> None:
    # Two members, one thread each: a burst split differently over their cycles. What both
    # submitted runs; the rest waits on the member that has it until the other submits it
    # too; a round that held an op back starts no pattern. An unnamed op that only one
    # member submitted falls back to the full negotiation on both.
    def member(rank: int) -> list[Any]:
        group = ProcessGroupGloo(
            dist.PrefixStore("pair/", store), rank, 2, datetime.timedelta(seconds=20)
        )
        rounds = CacheRound(ResponseCache(16), size=2)
        x = _request("x", torch.full((3,), rank + 1.0))  # small: rides once planned
        y = _request("y", torch.full((2,), rank + 1, dtype=torch.int32))  # never rides
        for request in (x, y, _request("noname.0")):
            rounds.cache.use(keys_of([request])[0][0])
        script = [[x, y], [y], [x, y], [x, y], [x], [_request("noname.0")]]
        if rank == 1:  # (y late, then x late; no unnamed op)
            script = [[x], [y], [x, y], [y], [x], []]
        seen: list[Any] = []  # per round: agreed, riders (None: fell back), predicted
        for ops in script:
            for request in ops:
                request.outputs = [torch.zeros_like(request.inputs[0])]
            outcome = rounds.run(group, ops, False, None)
            names = None if outcome is None else tuple([r.name for r in o] for o in outcome)
            seen.append((names, rounds.predicted_rounds))
        seen.append(x.outputs[0].tolist())  # (x rode the fifth round: both members' data)
        return seen

    results: list[list[Any]] = [[], []]
    threads = [threading.Thread(target=lambda r=r: results[r].extend(member(r))) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    x, y = "allreduce.x", "allreduce.y"
    both = [
        (([x], []), 0),  # y waits on member 0
        (([y], []), 0),  # and runs once member 1 has it
        (([x, y], [x]), 0),  # counted rounds carry the small ops they agreed on lately
        (([y], []), 0),  # x waits on member 0: its data in this round is not used
        (([x], [x]), 0),  # and rides the next one; no pattern across rounds that held ops
        (None, 0),  # the unnamed op
        [3.0, 3.0, 3.0],
    ]
    assert results[0] == both
    assert results[1] == both


# ---- the engine on one-rank groups ---------------------------------------------------


class Groups:
    """One-rank Gloo groups for an engine, as ``make_groups`` makes them."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.names = itertools.count()
        self.destroyed: list[Any] = []

    def make(self, ranks: list[int]) -> tuple[Any, Any]:
        assert ranks == [0]
        number = next(self.names)
        return _gloo(self.store, f"c{number}/"), _gloo(self.store, f"d{number}/")


@contextlib.contextmanager
def one_rank_engine(store: Any) -> Iterator[tuple[Engine, Groups]]:
    """A started engine of one rank on Gloo groups over ``store``, and its groups."""
    groups = Groups(store)
    control, data = groups.make([0])
    engine = Engine(
        rank=0,
        size=1,
        config=EngineConfig(),
        control_group=control,
        global_group=data,
        make_groups=groups.make,
        destroy_group=groups.destroyed.append,
    )
    engine.start()
    try:
        yield engine, groups
    finally:
        engine.stop(timeout=10)


@pytest.fixture
def engine(store: Any) -> Iterator[tuple[Engine, Groups]]:
    with one_rank_engine(store) as started:
        yield started


def _submit(engine: Engine, request: Request, blocking: bool = True) -> Any:
    request.handle = engine.new_handle(request.process_set_id)
    return engine.submit(request, blocking).wait()


def _blocking(engine: Engine, request: Request) -> tuple[Any, bool]:
    """A blocking op as ``ops.submit`` runs it (the request lane, else the queue): its
    result, and whether the lane took it."""
    request.handle = engine.new_handle(request.process_set_id)
    lane = engine.run_now(request)
    if not lane:
        engine.submit(request, True)
    return request.handle.wait(), lane


def test_ops_complete_with_their_scaling_and_the_lanes_take_a_repeated_op(
    engine: tuple[Engine, Groups],
) -> None:
    hvd, _ = engine
    scaled = _submit(hvd, _request("s", torch.ones(3), Reduction(int(ReduceOp.SUM), 2.0, 3.0)))
    assert torch.equal(scaled, torch.full((3,), 6.0))
    asynchronous = [_request(f"a{i}", torch.full((2,), float(i))) for i in range(5)]
    handles = [_submit_async(hvd, r) for r in asynchronous]
    assert [h.wait().tolist() for h in handles] == [[float(i)] * 2 for i in range(5)]
    lanes = 0
    for i in range(8):  # the same blocking op in a loop: predicted, then run on this thread
        request = _request("loop", torch.full((4,), float(i)))
        request.outputs = [None]
        result, lane = _blocking(hvd, request)
        lanes += lane
        assert torch.equal(result, torch.full((4,), float(i)))
    assert lanes >= 3 and hvd.stats["predicted_rounds"] >= 3, hvd.stats
    # The hot lane: allreduce_ of the op that just ran in a lane, no request at all.
    tensor = torch.full((4,), 7.0)
    done = hvd.run_hot("allreduce.loop", tensor, Reduction(int(ReduceOp.SUM)), _no_request)
    assert done is not None and done.done() and torch.equal(tensor, torch.full((4,), 7.0))
    assert hvd.stats["hot_rounds"] == 1


def test_the_hot_lane_takes_ops_that_take_turns_each_in_its_turn(
    engine: tuple[Engine, Groups],
) -> None:
    # A loss (riding) and an integer count (reduced on the tensor itself) in turn: once each
    # ran in a lane, both take the hot lane in their turn; out of turn, neither does.
    hvd, _ = engine
    loss, count = torch.zeros(2), torch.zeros(3, dtype=torch.int64)
    plain = Reduction(int(ReduceOp.SUM))
    for i in range(6):
        for name, tensor in (("turn.loss", loss), ("turn.count", count)):
            tensor.fill_(i)
            result, _ = _blocking(hvd, _request(name, tensor, plain))
            assert result.tolist() == [i] * tensor.numel()
    assert hvd.stats["hot_rounds"] == 0
    assert hvd.run_hot("allreduce.turn.count", count, plain, _no_request) is None  # not its turn
    for i in range(3):
        loss.fill_(10.0 + i)
        done = hvd.run_hot("allreduce.turn.loss", loss, plain, _no_request)
        assert done is not None and done.done() and loss.tolist() == [10.0 + i] * 2
        count.fill_(20 + i)
        done = hvd.run_hot("allreduce.turn.count", count, plain, _no_request)
        assert done is not None and done.done() and count.tolist() == [20 + i] * 3
    assert hvd.stats["hot_rounds"] == 6


def test_a_loop_of_twenty_metrics_in_turn_takes_the_lanes(engine: tuple[Engine, Groups]) -> None:
    # A loop that averages 20 metrics one by one is a pattern of 20 rounds: once it
    # repeated, every metric takes the request lane, then the hot lane, in its turn.
    hvd, _ = engine
    metrics = [torch.zeros(i + 1) for i in range(20)]
    plain = Reduction(int(ReduceOp.SUM))
    lanes = []
    for step in range(5):
        for i, tensor in enumerate(metrics):
            tensor.fill_(step + i)
            result, lane = _blocking(hvd, _request(f"metric.{i}", tensor, plain))
            assert result.tolist() == [step + i] * tensor.numel()
            lanes.append(lane)
    assert all(lanes[-20:]), lanes  # (predicted once the cached rounds repeated)
    for step in range(2):
        for i, tensor in enumerate(metrics):
            tensor.fill_(100 + step + i)
            done = hvd.run_hot(f"allreduce.metric.{i}", tensor, plain, _no_request)
            assert done is not None and done.done()
            assert tensor.tolist() == [100 + step + i] * tensor.numel()
    assert hvd.stats["hot_rounds"] == 40


def test_the_lanes_run_ops_that_do_not_ride_on_the_tensor_itself(
    engine: tuple[Engine, Groups],
) -> None:
    # An integer allreduce (its data never rides a round), scaled: once predicted, the
    # request lane runs its collective on the calling thread; then the hot lane on the
    # tensor itself, with the integer scaling truncating as the cycle's path does.
    hvd, _ = engine
    scaled = Reduction(int(ReduceOp.SUM), 2.5)
    lanes = 0
    for i in range(8):
        result, lane = _blocking(
            hvd, _request("ints", torch.full((4,), i, dtype=torch.int64), scaled)
        )
        lanes += lane
        want = torch.full((4,), int(2.5 * i), dtype=torch.int64)
        assert torch.equal(result, want)
    assert lanes >= 3, hvd.stats
    tensor = torch.full((4,), 3, dtype=torch.int64)
    done = hvd.run_hot("allreduce.ints", tensor, scaled, _no_request)
    assert done is not None and done.done() and tensor.tolist() == [7] * 4
    assert hvd.stats["hot_rounds"] == 1
    # A strided view is not reduced in place by the lane (it goes the usual way).
    strided = torch.zeros(4, 2, dtype=torch.int64)[:, 0]
    assert hvd.run_hot("allreduce.ints", strided, scaled, _no_request) is None


def _submit_async(engine: Engine, request: Request) -> Handle:
    request.handle = engine.new_handle()
    return engine.submit(request, blocking=False)


def _no_request(counter: int) -> Request:
    raise AssertionError("the hot lane built a request for an op it predicted")


def test_process_sets_are_added_used_and_removed(engine: tuple[Engine, Groups]) -> None:
    hvd, groups = engine
    add = _control(Kind.ADD_PROCESS_SET, ("0",))
    set_id = _submit(hvd, add)
    assert set_id == 1 and hvd.groups[1].ranks == [0] and hvd.groups[1].index == 0
    before = hvd.groups
    out = _submit(hvd, _request("on_set", torch.ones(2), set_id=1))
    assert torch.equal(out, torch.ones(2))
    # An op in flight on the set when it is removed fails; the table is a new snapshot.
    pending = _request("pending", torch.ones(2), set_id=1)
    pending.handle = hvd.new_handle(1)
    hvd.controller(1).queue.add(pending, blocking=True)  # (queued, no cycle run yet)
    assert _submit(hvd, _control(Kind.REMOVE_PROCESS_SET, (1,))) is True
    with pytest.raises(ValueError, match="its process set 1 was removed"):
        pending.handle.wait()
    assert 1 in before and 1 not in hvd.groups
    assert len(groups.destroyed) == 2  # the set's Gloo and data groups
    with pytest.raises(ValueError, match="process set 1 is not registered"):
        hvd.submit(_request("late", set_id=1))
    assert _submit(hvd, _control(Kind.REMOVE_PROCESS_SET, (1,))) is False


def _control(kind: Kind, args: tuple[Any, ...]) -> Request:
    return Request(
        kind,
        noname(kind, int(time.monotonic_ns())),
        0,
        [],
        [],
        Handle(),
        sig=signature(kind, args, []),
    )


def test_a_failed_cycle_stops_every_set_and_later_ops_raise(engine: tuple[Engine, Groups]) -> None:
    hvd, _ = engine
    set_id = _submit(hvd, _control(Kind.ADD_PROCESS_SET, ("0",)))
    queued = _request("queued", set_id=set_id)
    queued.handle = hvd.new_handle(set_id)
    hvd.controller(set_id).queue.add(queued, blocking=True)
    resized = _request("resized", torch.ones(4))
    resized.handle = hvd.new_handle()
    hvd.submit(resized, blocking=True)
    resized.inputs[0].resize_(8)  # resized in flight: this rank's own error, named
    with pytest.raises(HorovodInternalError, match=r"failed on this rank itself.*resized"):
        resized.handle.wait()
    with pytest.raises(HorovodInternalError, match="failed on this rank itself"):
        queued.handle.wait()  # the other set stopped too
    with pytest.raises(HorovodInternalError):
        hvd.submit(_request("later"))


def test_shutdown_refuses_later_ops_and_closes_the_groups(store: Any) -> None:
    groups = Groups(store)
    control, data = groups.make([0])
    hvd = Engine(
        rank=0,
        size=1,
        config=EngineConfig(cache_capacity=0),
        control_group=control,
        global_group=data,
        make_groups=groups.make,
        destroy_group=groups.destroyed.append,
    )
    hvd.start()
    assert torch.equal(_submit(hvd, _request("x")), torch.ones(2))
    hvd.stop(timeout=10)
    assert {id(g) for g in groups.destroyed} == {id(control), id(data)}
    with pytest.raises(HorovodInternalError, match="shut down hvdrun's collectives"):
        hvd.submit(_request("y"))
