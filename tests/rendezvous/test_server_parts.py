"""The server's membership, its Watch streams and the servicer that ties the parts together,
driven directly on an asyncio loop (no gRPC server, no network)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator
from typing import Any, NoReturn, TypeVar

import grpc
import pytest

from rendezvous import rendezvous_pb2
from rendezvous.server import RendezvousServer
from rendezvous.server.common import Refusal
from rendezvous.server.loop import LoopThread
from rendezvous.server.membership import Membership
from rendezvous.server.servicer import Servicer
from rendezvous.server.watch import Watches
from rendezvous.slots import assign_slots
from tests.rendezvous.aio import refusal_of, run, settle

T = TypeVar("T")
Kind = rendezvous_pb2.WatchEvent


# ---- membership ------------------------------------------------------------------------


def test_register_waits_for_its_generation_and_counts_as_waiting() -> None:
    async def test() -> None:
        members = Membership([], elastic=True)
        waiting = asyncio.create_task(members.register("b", 0, None, 1, 5000))
        await settle()
        assert members.waiting_slots() == {("b", 0)}
        assert members.publish(assign_slots([("a", 1), ("b", 1)], 2)) == 1
        await settle()
        slot, generation = waiting.result()
        assert (slot.rank, slot.size, generation) == (1, 2, 1)
        assert members.waiting_slots() == set()
        assert members.registered_count() == 1
        # a new generation: nobody has registered in it yet
        assert members.publish(assign_slots([("b", 1)], 1)) == 2
        assert members.registered_count() == 0
        with pytest.raises(Refusal) as removed:
            await members.register("a", 0, None, 2, 5000)
        assert removed.value.code == grpc.StatusCode.NOT_FOUND
        assert "is not part of generation 2 of this job (its host was removed)" in str(
            removed.value
        )
        with pytest.raises(Refusal) as late:
            await members.register("b", 0, None, 3, 20)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert late.value.message == (
            "no membership generation 3 was published within 0.02 s (newest: 2)"
        )
        assert members.waiting_slots() == set()  # the timed-out wait left nothing behind

    run(test)


def test_a_slot_waits_only_for_generations_newer_than_the_newest() -> None:
    async def test() -> None:
        members = Membership([], elastic=True)
        members.publish(assign_slots([("a", 2)], 2))
        host = asyncio.create_task(members.register_host("a", [0, 1], 2, 5000))
        await settle()
        assert members.waiting_slots() == {("a", 0), ("a", 1)}
        members.publish(assign_slots([("a", 2)], 2))
        await settle()
        assert [place.slot.rank for place in host.result()] == [0, 1]
        with pytest.raises(Refusal, match="a local rank is listed twice"):
            await members.register_host("a", [1, 1], 0, 5000)

    run(test)


def test_shutdown_fails_waiting_registers() -> None:
    async def test() -> None:
        members = Membership([], elastic=True)
        waiting = asyncio.create_task(members.register("a", 0, None, 1, 5000))
        await settle()
        members.shut_down("stopping")
        await settle()
        refusal = refusal_of(waiting)
        assert (refusal.code, refusal.message) == (grpc.StatusCode.UNAVAILABLE, "stopping")
        assert members.waiting_slots() == set()

    run(test)


def test_a_fixed_job_knows_its_hosts() -> None:
    async def test() -> None:
        members = Membership(assign_slots([("a", 2)], 2))
        place = await members.register("a", 1, None, 0, 0)
        assert (place.slot.rank, place.generation) == (1, 0)
        await members.register("a", 1, None, 0, 0)  # again: still one slot
        assert members.registered_count() == 1
        with pytest.raises(Refusal, match=r"no slot for host 'b' local_rank 0 .*hosts: 'a'"):
            await members.register("b", 0, None, 0, 0)
        with pytest.raises(Refusal, match="this worker registered with a rank of its own"):
            await members.register("a", 0, 0, 0, 0)
        members.check_ranks([0, 1])
        with pytest.raises(Refusal, match=r"rank 2 is outside this job's ranks \[0, 2\)"):
            members.check_ranks([2])

    run(test)


def test_a_placed_job_derives_its_table_when_every_rank_has_come() -> None:
    async def test() -> None:
        tables: list[int] = []
        members = Membership([], placed_size=3, on_table=lambda: tables.append(1))
        first = asyncio.create_task(members.register("x", -1, 2, 0, 5000))
        second = asyncio.create_task(members.register("y", -1, 0, 0, 5000))
        await settle()
        assert not first.done() and not tables
        with pytest.raises(Refusal, match="registered from host 'x' and again from 'z'"):
            await members.register("z", -1, 2, 0, 5000)
        with pytest.raises(Refusal, match="without its rank"):
            await members.register("x", -1, None, 0, 5000)
        last = await members.register("x", -1, 1, 0, 5000)
        await settle()
        assert tables == [1]
        ranks = {first.result().slot.rank, second.result().slot.rank, last.slot.rank}
        assert ranks == {0, 1, 2}
        assert {second.result().slot.hostname, last.slot.hostname} == {"y", "x"}
        assert members.registered_count() == 3

    run(test)


# ---- watch streams ---------------------------------------------------------------------


async def next_kind(stream: AsyncIterator[rendezvous_pb2.WatchEvent]) -> tuple[int, int]:
    event = await anext(stream)
    return event.kind, event.generation


def test_watch_streams_beat_together_and_hear_of_generations() -> None:
    async def test() -> None:
        watches = Watches(heartbeat_interval=0.05)
        loop = asyncio.get_running_loop()
        start = loop.time()
        one = watches.events([0])
        two = watches.events([1, 2])
        assert await next_kind(one) == (Kind.HEARTBEAT, 0)  # at once
        assert await next_kind(two) == (Kind.HEARTBEAT, 0)
        assert watches.watching_ranks() == {0, 1, 2}
        assert await next_kind(one) == (Kind.HEARTBEAT, 0)  # the pulse, an interval later
        assert loop.time() - start >= 0.045
        assert await next_kind(two) == (Kind.HEARTBEAT, 0)  # the same pulse
        watches.announce(3)
        assert await next_kind(one) == (Kind.HOSTS_UPDATED, 3)
        assert await next_kind(two) == (Kind.HOSTS_UPDATED, 3)
        assert await next_kind(one) == (Kind.HEARTBEAT, 3)
        assert watches.left_ranks() == set()
        await one.aclose()
        assert watches.watching_ranks() == {1, 2}
        assert watches.left_ranks() == {0}
        watches.shut_down("the end")
        event = await anext(two)
        assert (event.kind, event.message, event.generation) == (Kind.SHUTDOWN, "the end", 3)
        with pytest.raises(StopAsyncIteration):
            await anext(two)
        assert watches.watching_ranks() == set()
        await asyncio.wait_for(watches.wait_closed(5), 1)

    run(test)


def test_the_pulse_stops_when_no_stream_is_open() -> None:
    async def test() -> None:
        loop = asyncio.get_running_loop()
        interval = 0.0123
        timers: list[float] = []
        call_later = loop.call_later

        def counting(delay: float, callback: Any, *args: Any, **kwargs: Any) -> Any:
            if delay == interval:  # not asyncio.sleep's
                timers.append(delay)
            return call_later(delay, callback, *args, **kwargs)

        loop.call_later = counting  # type: ignore[method-assign, assignment]
        watches = Watches(heartbeat_interval=interval)
        streams = [watches.events([0]), watches.events([1])]
        for stream in streams:
            await anext(stream)
        for stream in streams:
            await anext(stream)  # one timer beats both
        armed = len(timers)
        assert armed >= 1  # one a beat (more only if this loop was held up)
        for stream in streams:
            await stream.aclose()
        await asyncio.sleep(0.05)  # the pending beat fires once and is not armed again
        assert len(timers) == armed

    run(test)


def test_wait_closed_gives_up_on_a_stream_that_never_ends() -> None:
    async def test() -> None:
        watches = Watches(heartbeat_interval=10)
        stream = watches.events([0])
        await anext(stream)
        watches.shut_down("bye")  # the stream is not read again: its SHUTDOWN never goes out
        loop = asyncio.get_running_loop()
        start = loop.time()
        await watches.wait_closed(0.05)
        assert 0.045 <= loop.time() - start < 5
        await stream.aclose()

    run(test)


# ---- the servicer: one RPC, one part; publish and shutdown across parts -----------------


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message


class FakeContext:
    """What the handlers use of grpc.aio.ServicerContext: abort()."""

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        raise Aborted(code, message)


def test_the_servicer_turns_refusals_into_statuses() -> None:
    async def test() -> None:
        servicer = Servicer(assign_slots([("a", 1)], 1), 1.0, 1024)
        context: Any = FakeContext()
        await servicer.Set(rendezvous_pb2.SetRequest(key="k", value=b"v"), context)
        got = await servicer.Get(rendezvous_pb2.GetRequest(key="k", timeout_ms=0), context)
        assert got.value == b"v"
        with pytest.raises(Aborted) as missing:
            await servicer.Get(rendezvous_pb2.GetRequest(key="nope", timeout_ms=0), context)
        assert (missing.value.code, missing.value.message) == (
            grpc.StatusCode.NOT_FOUND,
            "key 'nope' is not set",
        )
        info = await servicer.Register(
            rendezvous_pb2.RegisterRequest(host="a", local_rank=0, timeout_ms=1000), context
        )
        assert (info.rank, info.size, info.generation) == (0, 1, 0)
        assert servicer.registered_count() == 1
        with pytest.raises(Aborted) as outside:
            await anext(servicer.Watch(rendezvous_pb2.WatchRequest(rank=5), context))
        assert outside.value.code == grpc.StatusCode.INVALID_ARGUMENT

    run(test)


def test_publish_and_shutdown_reach_every_part() -> None:
    async def test() -> None:
        servicer = Servicer([], 10.0, 1024, elastic=True)
        context: Any = FakeContext()
        stale = asyncio.create_task(
            servicer.Get(rendezvous_pb2.GetRequest(key="hvdrun/g0/x", timeout_ms=5000), context)
        )
        register = asyncio.create_task(
            servicer.Register(
                rendezvous_pb2.RegisterRequest(
                    host="a", local_rank=0, min_generation=1, timeout_ms=5000
                ),
                context,
            )
        )
        stream = servicer.Watch(rendezvous_pb2.WatchRequest(rank=0), context)
        assert (await anext(stream)).kind == Kind.HEARTBEAT
        await settle()
        assert servicer.waiting_slots() == {("a", 0)}
        assert servicer.watching_ranks() == {0}
        assert servicer.publish(assign_slots([("a", 1)], 1)) == 1
        await settle()
        assert (await register).generation == 1
        with pytest.raises(Aborted, match="generation 0 was superseded by generation 1"):
            await stale
        event = await anext(stream)
        assert (event.kind, event.generation) == (Kind.HOSTS_UPDATED, 1)
        blocked = asyncio.create_task(
            servicer.Wait(rendezvous_pb2.WaitRequest(keys=["never"], timeout_ms=5000), context)
        )
        barrier = asyncio.create_task(
            servicer.Barrier(
                rendezvous_pb2.BarrierRequest(name="b", participants=2, timeout_ms=5000), context
            )
        )
        await settle()
        servicer.begin_shutdown("the server stops")
        await settle()
        for task in (blocked, barrier):
            error = task.exception()
            assert isinstance(error, Aborted)
            assert (error.code, error.message) == (
                grpc.StatusCode.UNAVAILABLE,
                "the server stops",
            )
        event = await anext(stream)
        assert (event.kind, event.message) == (Kind.SHUTDOWN, "the server stops")
        await servicer.wait_watches_closed(1)

    run(test)


# ---- the launcher's questions ----------------------------------------------------------


def test_the_launchers_questions_are_answered_on_the_loop() -> None:
    server = RendezvousServer(assign_slots([("a", 1)], 1), "s", "j", bind_host="127.0.0.1")
    # never started: nothing has registered or watched
    assert (server.registered_count(), server.waiting_slots(), server.watching_ranks()) == (
        0,
        set(),
        set(),
    )
    with server:
        answers: list[int] = []
        asker = threading.Thread(target=lambda: answers.append(server.registered_count()))
        asker.start()
        asker.join(10)
        assert answers == [0]
        # On the loop's own thread the question would wait for itself: refused at once.
        from_loop: concurrent.futures.Future[BaseException | None] = concurrent.futures.Future()

        def ask_on_loop() -> None:
            try:
                server.watching_ranks()
            except RuntimeError as error:
                from_loop.set_result(error)
            else:
                from_loop.set_result(None)

        LoopThread.get().loop.call_soon_threadsafe(ask_on_loop)
        assert "own thread" in str(from_loop.result(10))
    assert server.registered_count() == 0  # still answered after stop()
