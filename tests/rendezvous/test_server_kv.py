"""The server's key-value store and barriers on their own, driven directly on an asyncio loop.

No gRPC here: the parts answer with values or raise Refusal, which the servicer would turn
into the call's status (the tests through gRPC are test_rendezvous_kv.py and others).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import grpc
import pytest

from rendezvous.server.common import Refusal
from rendezvous.server.kv import Barriers, KeyValueStore
from tests.rendezvous.aio import refusal_of, run, settle

T = TypeVar("T")


def test_a_write_wakes_exactly_the_readers_of_its_key() -> None:
    async def test() -> None:
        store = KeyValueStore(1024)
        a1 = asyncio.create_task(store.get("a", 5000))
        a2 = asyncio.create_task(store.multi_get(["x", "a"], 5000))
        b = asyncio.create_task(store.get("b", 5000))
        await settle()
        assert not (a1.done() or a2.done() or b.done())
        store.set("x", b"X")
        await settle()
        assert not a2.done()  # still waits for "a"
        store.set("a", b"A")
        await settle()
        assert a1.result() == (b"A", [])
        assert a2.result() == [b"X", b"A"]
        assert not b.done()
        b.cancel()

    run(test)


def test_absent_keys_time_out_with_their_names() -> None:
    async def test() -> None:
        store = KeyValueStore(1024)
        with pytest.raises(Refusal) as now:
            await store.get("k", 0)
        assert now.value.code == grpc.StatusCode.NOT_FOUND
        assert now.value.message == "key 'k' is not set"
        with pytest.raises(Refusal) as late:
            await store.get("k", 20)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert late.value.message == "key 'k' was not set within 0.02 s"
        store.set("here", b"1")
        with pytest.raises(Refusal) as some:
            await store.wait(["here", "gone"], 20)
        assert some.value.message == "keys not set within 0.02 s: 'gone'"
        with pytest.raises(Refusal, match="must not be negative"):
            await store.multi_get(["here"], -1)

    run(test)


def test_read_ahead_returns_the_numbered_siblings_set_now() -> None:
    async def test() -> None:
        store = KeyValueStore(10)
        for number, value in enumerate([b"0", b"1", b"2", b"3", b"444444444"]):
            store.set(f"p/{number}", value)
        assert await store.get("p/0", 0, read_ahead=2) == (b"0", [b"1", b"2"])
        # stops at the first absent sibling, and before the answer passes the value limit
        assert await store.get("p/1", 0, read_ahead=100) == (b"1", [b"2", b"3"])
        assert await store.get("p/4", 0, read_ahead=100) == (b"444444444", [])
        store.set("q/01", b"x")
        store.set("q/02", b"y")
        assert await store.get("q/01", 0, read_ahead=5) == (b"x", [])  # not a plain number

    run(test)


def test_writes_check_their_values() -> None:
    store = KeyValueStore(4)
    with pytest.raises(Refusal) as big:
        store.set("k", b"12345")
    assert big.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "5 bytes, more than the limit of 4 bytes" in big.value.message
    with pytest.raises(Refusal, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])
    with pytest.raises(Refusal, match="more than the limit"):
        store.multi_set(["a", "b"], [b"1", b"12345"])
    assert not store.check(["a"])  # a refused multi_set writes nothing
    assert store.add("n", 5) == 5
    assert store.add("n", -7) == -2
    store.set("text", b"abc")
    with pytest.raises(Refusal, match="does not hold a decimal integer"):
        store.add("text", 1)
    for odd in (b"1_0", b" 7", "\u0663".encode()):  # int() would take each of them
        store.set("odd", odd[:4])
        with pytest.raises(Refusal, match="does not hold a decimal integer"):
            store.add("odd", 1)
    store.set("signed", b"+3")
    assert store.add("signed", 1) == 4
    counters = KeyValueStore(1024)
    counters.set("max", str(2**63 - 1).encode())
    with pytest.raises(Refusal) as over:
        counters.add("max", 1)
    assert over.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_compare_set_follows_tcpstore() -> None:
    store = KeyValueStore(1024)
    assert store.compare_set("k", b"old", b"new") == b"old"  # missing, but expected: unset
    assert not store.check(["k"])
    assert store.compare_set("k", b"", b"first") == b"first"
    assert store.compare_set("k", b"wrong", b"second") == b"first"
    assert store.compare_set("k", b"first", b"second") == b"second"
    assert store.num_keys() == 1
    assert store.delete("k")
    assert not store.delete("k")


def test_a_newer_generation_fails_waits_and_writes_of_older_ones() -> None:
    async def test() -> None:
        store = KeyValueStore(1024)
        for key in ("hvdrun/g1/addr/1", "hvdrun/g0/count", "hvdrun/g2/early", "user/key"):
            store.set(key, b"v")
        old = asyncio.create_task(store.get("hvdrun/g1/addr/0", 5000))
        current = asyncio.create_task(store.get("hvdrun/g2/addr/0", 5000))
        other = asyncio.create_task(store.get("plain", 5000))
        await settle()
        store.supersede(2)
        await settle()
        refusal = refusal_of(old)
        assert refusal.code == grpc.StatusCode.ABORTED
        assert refusal.message == (
            "membership generation 1 was superseded by generation 2 (hosts joined or left the job)"
        )
        assert not current.done() and not other.done()
        # the older generations' keys are gone (an elastic job kept every reset's keys)
        assert store.num_keys() == 2 and store.check(["hvdrun/g2/early", "user/key"])
        with pytest.raises(Refusal, match="generation 1 was superseded"):
            await store.wait(["hvdrun/g1/late"], 5000)  # fails at once, no waiting
        with pytest.raises(Refusal, match="generation 1 was superseded"):
            store.set("hvdrun/g1/late", b"x")
        with pytest.raises(Refusal, match="generation 0 was superseded"):
            store.add("hvdrun/g0/count", 1)
        store.set("hvdrun/g2/addr/0", b"ok")
        await settle()
        assert current.result() == (b"ok", [])
        other.cancel()

    run(test)


def test_shutdown_fails_blocked_and_later_readers() -> None:
    async def test() -> None:
        store = KeyValueStore(1024)
        store.set("here", b"1")
        blocked = asyncio.create_task(store.wait(["here", "missing"], 5000))
        await settle()
        store.shut_down("going away")
        await settle()
        refusal = refusal_of(blocked)
        assert (refusal.code, refusal.message) == (grpc.StatusCode.UNAVAILABLE, "going away")
        with pytest.raises(Refusal, match="going away"):
            await store.get("missing", 5000)
        assert await store.get("here", 5000) == (b"1", [])  # what is there is still read

    run(test)


def test_an_abandoned_store_fails_blocked_and_later_readers_and_serves_on() -> None:
    """A placed job's rank 0 abandons the store when a rank leaves while the ranks connect:
    every reader that waits fails with ABORTED and the reason; what is there is still read
    and written."""

    async def test() -> None:
        store = KeyValueStore(1024)
        blocked = asyncio.create_task(store.get("peer-address", 5000))
        await settle()
        store.abandon("rank 1 of 2 left the job")
        await settle()
        refusal = refusal_of(blocked)
        assert (refusal.code, refusal.message) == (
            grpc.StatusCode.ABORTED,
            "rank 1 of 2 left the job",
        )
        with pytest.raises(Refusal, match="rank 1 of 2 left the job"):
            await store.wait(["other"], 5000)
        store.set("here", b"1")
        assert await store.get("here", 5000) == (b"1", [])

    run(test)


def test_cancelled_readers_leave_no_waiters_behind() -> None:
    async def test() -> None:
        store = KeyValueStore(1024)
        readers = [asyncio.create_task(store.get("k", 5000)) for _ in range(3)]
        await settle()
        for reader in readers:
            reader.cancel()
        await settle()
        store.shut_down("bye")  # nobody left to fail
        assert all(reader.cancelled() for reader in readers)

    run(test)


def test_barrier_releases_everyone_with_the_last_arrival() -> None:
    async def test() -> None:
        barriers = Barriers()
        first = asyncio.create_task(barriers.arrive("b", 3, 5000))
        second = asyncio.create_task(barriers.arrive("b", 3, 5000))
        await settle()
        assert not first.done()
        with pytest.raises(Refusal, match="has 3 participants, this caller says 2"):
            await barriers.arrive("b", 2, 5000)
        await barriers.arrive("b", 3, 5000)
        await settle()
        assert first.done() and second.done()
        # the name is free again at once
        again = asyncio.create_task(barriers.arrive("b", 2, 5000))
        await barriers.arrive("b", 2, 5000)
        await settle()
        assert again.done()

    run(test)


def test_a_barrier_caller_that_gives_up_no_longer_counts() -> None:
    async def test() -> None:
        barriers = Barriers()
        quitter = asyncio.create_task(barriers.arrive("b", 2, 5000))
        await settle()
        quitter.cancel()
        await settle()
        late = asyncio.create_task(barriers.arrive("b", 2, 5000))
        await settle()
        assert not late.done()  # the one who left does not count
        with pytest.raises(Refusal) as timeout:
            await barriers.arrive("c", 2, 20)
        assert timeout.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert (
            timeout.value.message == "barrier 'c': only 1 of 2 participants arrived within 0.02 s"
        )
        await barriers.arrive("b", 2, 5000)
        await settle()
        assert late.done() and late.exception() is None

    run(test)


def test_barriers_fail_at_shutdown() -> None:
    async def test() -> None:
        barriers = Barriers()
        waiting = asyncio.create_task(barriers.arrive("b", 2, 5000))
        await settle()
        barriers.shut_down("stopped")
        await settle()
        assert refusal_of(waiting).code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(Refusal, match="stopped"):
            await barriers.arrive("b", 2, 5000)
        with pytest.raises(Refusal, match="participants must be at least 1, got 0"):
            await barriers.arrive("b", 0, 5000)

    run(test)
