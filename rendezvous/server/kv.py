"""The job's key-value store and its named barriers, as torch.distributed's stores use them.

Why it looks the way it does:

* A blocked reader (``get``/``wait``/``multi_get`` of a key not set yet) waits on a future of
  its own, filed under the key; a write resolves exactly the futures of the key it writes,
  never scans all waiters. Thousands of workers blocked in ``get`` cost a few KB each.
* Values are bytes; ``add`` keeps its counter as ASCII decimal, like torch's TCPStore, so
  ``get`` after ``add`` returns ``b"5"``.
* Keys ``hvdrun/g<N>/...`` belong to membership generation N (the workers' bootstrap of that
  generation). Once a newer generation is published (:meth:`KeyValueStore.supersede`),
  waiting for such a key fails with ABORTED at once, and so does writing one: a worker stuck
  bootstrapping a generation that can never complete moves on instead of waiting for its
  timeout, and a late or replaying client cannot pile up keys nobody will read. The keys of
  older generations are dropped then too.
* When the server stops, every blocked caller fails at once (UNAVAILABLE), instead of
  holding the server's shutdown until its own timeout.

Threads: every field of both classes belongs to the server's asyncio loop. They are created
before the server starts serving and from then on are read and written only by coroutines and
callbacks on that loop (the RPC handlers, publish, shutdown), so no lock guards them:

* :class:`KeyValueStore` -- ``_data``, ``_waiters``, ``_generation`` (its copy of the newest
  published generation) and ``_ended`` (None while serving and not abandoned): loop-only;
  ``_max_value_bytes`` never changes.
* :class:`Barriers` -- ``_barriers`` (each :class:`Barrier` in it too) and ``_shutdown``:
  loop-only.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from rendezvous.client import NOT_SET
from rendezvous.server.common import (
    Refusal,
    ShuttingDown,
    Superseded,
    check_timeout,
    generation_of,
    quote,
    quote_keys,
    seconds,
)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: The most numbered siblings one Get reads ahead (GetRequest.read_ahead).
MAX_READ_AHEAD = 65536

# What ``add`` takes for a number: ASCII digits with an optional sign, as torch writes them.
_DECIMAL = re.compile(rb"[+-]?[0-9]+")


class KeyValueStore:
    """Keys to byte values, with blocking reads; see the module docstring."""

    def __init__(self, max_value_bytes: int) -> None:
        self._max_value_bytes = max_value_bytes
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, set[asyncio.Future[bytes]]] = {}
        self._generation = 0
        # The refusal every blocked and later reader gets, once stopping or abandoned.
        self._ended: Callable[[], Refusal] | None = None

    # ---- writes ------------------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        self._check_value(key, value)
        self._refuse_stale_write(key)
        self._store(key, value)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Writes all pairs, or none if one of them is refused."""
        if len(keys) != len(values):
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(values)} values"
            )
        for key, value in zip(keys, values, strict=True):
            self._check_value(key, value)
            self._refuse_stale_write(key)
        for key, value in zip(keys, values, strict=True):
            self._store(key, value)

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the decimal integer at ``key`` (0 when absent); returns the sum."""
        self._refuse_stale_write(key)
        current = self._data.get(key, b"0")
        if _DECIMAL.fullmatch(current) is None:  # (int() would take "1_0", " 7" and "٣")
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"key {quote(key)} does not hold a decimal integer",
            )
        number = int(current) + amount
        if not INT64_MIN <= number <= INT64_MAX:
            raise Refusal(
                grpc.StatusCode.OUT_OF_RANGE,
                f"adding {amount} to key {quote(key)} overflows a 64-bit integer",
            )
        self._store(key, str(number).encode("ascii"))
        return number

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's compare-and-set; returns the value the key holds afterwards (or, for a
        missing key the caller did not expect to be missing, ``expected``, as TCPStore does)."""
        self._check_value(key, desired)
        self._refuse_stale_write(key)
        current = self._data.get(key)
        if current is None:
            # TCPStore: a missing key is set only when the caller expected it to be empty.
            if expected:
                return expected
            self._store(key, desired)
            return desired
        if current == expected:
            self._store(key, desired)
            return desired
        return current

    def delete(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    # ---- reads -------------------------------------------------------------------------

    def check(self, keys: Iterable[str]) -> bool:
        return all(key in self._data for key in keys)

    def values_under(self, prefix: str) -> dict[str, bytes]:
        """Every key that starts with ``prefix``, and its value."""
        return {key: value for key, value in self._data.items() if key.startswith(prefix)}

    def num_keys(self) -> int:
        return len(self._data)

    async def get(
        self, key: str, timeout_ms: int, read_ahead: int = 0
    ) -> tuple[bytes, list[bytes]]:
        """The key's value, waiting up to ``timeout_ms`` for it (0: NOT_FOUND at once when
        absent), and the values of up to ``read_ahead`` numbered siblings set right now."""
        check_timeout(timeout_ms)
        if key in self._data:
            value = self._data[key]
        elif timeout_ms == 0:
            raise Refusal(grpc.StatusCode.NOT_FOUND, f"key {quote(key)} is not set")
        else:
            (value,) = await self._values([key], timeout_ms, one_key=True)
        return value, self._read_ahead(key, read_ahead) if read_ahead else []

    async def multi_get(self, keys: list[str], timeout_ms: int) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout_ms`` for those not set yet."""
        check_timeout(timeout_ms)
        data = self._data
        if all(key in data for key in keys):  # the common case: no waiting, no coroutines
            return [data[key] for key in keys]
        return await self._values(keys, timeout_ms)

    async def wait(self, keys: list[str], timeout_ms: int) -> None:
        """Returns once every key is set; DEADLINE_EXCEEDED after ``timeout_ms``."""
        check_timeout(timeout_ms)
        await self._values(keys, timeout_ms)

    # ---- membership generations and shutdown -------------------------------------------

    def supersede(self, generation: int) -> None:
        """Generation ``generation`` is published: callers still waiting on keys of older
        generations fail with ABORTED, such keys are refused from now on, and those set go
        (no one reads them again: a long elastic job kept every reset's keys)."""
        self._generation = generation
        for key in list(self._data):
            old = generation_of(key)
            if old is not None and old < generation:
                del self._data[key]
        for key, waiters in list(self._waiters.items()):
            old = generation_of(key)
            if old is not None and old < generation:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(Superseded(old, generation))

    def shut_down(self, message: str) -> None:
        """Fails every blocked caller, and every later one that would block, with
        UNAVAILABLE ``message``."""
        self._end_waits(lambda: ShuttingDown(message))

    def abandon(self, message: str) -> None:
        """The job cannot connect (a rank it waits for has left): every blocked reader, and
        every later one that would block, fails with ABORTED ``message``; the server
        serves on (the ranks leave it as they fail)."""
        self._end_waits(lambda: Refusal(grpc.StatusCode.ABORTED, message))

    def _end_waits(self, refusal: Callable[[], Refusal]) -> None:
        self._ended = refusal
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(refusal())

    # ---- helpers -----------------------------------------------------------------------

    def _store(self, key: str, value: bytes) -> None:
        """Writes a value and wakes exactly the callers blocked on this key."""
        self._data[key] = value
        waiters = self._waiters.pop(key, None)
        if waiters:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(value)

    def _check_value(self, key: str, value: bytes) -> None:
        if len(value) > self._max_value_bytes:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"value for key {quote(key)} is {len(value)} bytes, "
                f"more than the limit of {self._max_value_bytes} bytes",
            )

    def _refuse_stale_write(self, key: str) -> None:
        """A write to a superseded generation's keys (a late or replaying client) is refused
        with ABORTED: nobody will read it, and it must not pile up in the store."""
        old = generation_of(key)
        if old is not None and old < self._generation:
            raise Superseded(old, self._generation)

    async def _values(self, keys: list[str], timeout_ms: int, one_key: bool = False) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout_ms`` for the missing ones one after
        the other (each wait is a per-key future). A timeout is DEADLINE_EXCEEDED (``one_key``:
        a Get, whose message names its key); the server's shutdown and a superseded
        generation end the wait with their own refusals."""
        deadline = asyncio.get_running_loop().time() + timeout_ms / 1000
        try:
            return [await self._wait_for_key(key, deadline) for key in keys]
        except asyncio.TimeoutError:
            if one_key:
                message = f"{NOT_SET.format(key=quote(keys[0]))} {seconds(timeout_ms)}"
            else:
                missing = [key for key in keys if key not in self._data]
                message = f"keys not set within {seconds(timeout_ms)}: {quote_keys(missing)}"
            raise Refusal(grpc.StatusCode.DEADLINE_EXCEEDED, message) from None

    async def _wait_for_key(self, key: str, deadline: float) -> bytes:
        """Returns the key's value, waiting until ``deadline`` (loop time) if it is absent.

        Raises asyncio.TimeoutError at the deadline, ShuttingDown when the server stops and
        Superseded when the key's generation is."""
        if key in self._data:
            return self._data[key]
        if self._ended is not None:
            raise self._ended()
        old = generation_of(key)
        if old is not None and old < self._generation:
            raise Superseded(old, self._generation)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bytes] = loop.create_future()
        self._waiters.setdefault(key, set()).add(waiter)
        try:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise asyncio.TimeoutError
            return await asyncio.wait_for(waiter, remaining)
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[key]

    def _read_ahead(self, key: str, count: int) -> list[bytes]:
        """The values of ``key``'s numbered siblings after it (``p/3`` -> ``p/4``, ``p/5``, ...)
        that are set now: at most ``count``, stopping at the first absent one and before the
        answer would pass ``max_value_bytes`` (so it stays within the message limit)."""
        last = key.rpartition("/")[2]
        base = key[: len(key) - len(last)]
        if not last.isdigit() or (last != "0" and last.startswith("0")) or not last.isascii():
            return []
        data, budget, number = self._data, self._max_value_bytes, int(last)
        ahead: list[bytes] = []
        for sibling in range(number + 1, number + 1 + min(count, MAX_READ_AHEAD)):
            value = data.get(f"{base}{sibling}")
            if value is None or len(value) > budget:
                break
            budget -= len(value)
            ahead.append(value)
        return ahead


def _new_future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


@dataclass
class Barrier:
    """One named barrier while its participants arrive (made on the loop)."""

    participants: int
    arrived: int = 0
    released: asyncio.Future[None] = field(default_factory=_new_future)


class Barriers:
    """Named barriers: the last of ``participants`` callers releases them all, and the name
    can be used again at once. A caller that gives up (its timeout, or it went away) no
    longer counts as arrived."""

    def __init__(self) -> None:
        self._barriers: dict[str, Barrier] = {}
        self._shutdown: str | None = None  # the message callers get, once stopping

    async def arrive(self, name: str, participants: int, timeout_ms: int) -> None:
        """Returns once ``participants`` callers (this one included) have arrived."""
        check_timeout(timeout_ms)
        if participants < 1:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"barrier {quote(name)}: participants must be at least 1, got {participants}",
            )
        if self._shutdown is not None:
            raise ShuttingDown(self._shutdown)
        barrier = self._barriers.get(name)
        if barrier is None:
            barrier = self._barriers[name] = Barrier(participants)
        elif barrier.participants != participants:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"barrier {quote(name)} has {barrier.participants} participants, "
                f"this caller says {participants}",
            )
        barrier.arrived += 1
        if barrier.arrived == barrier.participants:
            # Release everyone and forget the barrier, so the name can be used again.
            del self._barriers[name]
            barrier.released.set_result(None)
            return
        try:
            await asyncio.wait_for(asyncio.shield(barrier.released), timeout_ms / 1000)
        except asyncio.TimeoutError:
            arrived = barrier.arrived
            self._leave(name, barrier)
            raise Refusal(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"barrier {quote(name)}: only {arrived} of {barrier.participants} "
                f"participants arrived within {seconds(timeout_ms)}",
            ) from None
        except asyncio.CancelledError:
            # The caller went away (its deadline, or it died): it no longer counts as arrived.
            self._leave(name, barrier)
            raise

    def shut_down(self, message: str) -> None:
        """Fails every caller waiting at a barrier, and every later one, with UNAVAILABLE."""
        self._shutdown = message
        for barrier in self._barriers.values():
            if not barrier.released.done():
                barrier.released.set_exception(ShuttingDown(message))

    def _leave(self, name: str, barrier: Barrier) -> None:
        if barrier.released.done():
            return
        barrier.arrived -= 1
        if barrier.arrived == 0 and self._barriers.get(name) is barrier:
            del self._barriers[name]
            barrier.released.cancel()
