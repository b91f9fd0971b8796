"""The rendezvous server: one job's control plane, run inside the launcher process.

Why it looks the way it does:

* It runs a ``grpc.aio`` server on a background asyncio loop in a daemon thread (one loop
  per process, shared by all servers in it: grpc.aio assumes its loops live for the whole
  process). Every blocking call (``Get``/``Wait``/``Barrier``/``Watch``) is then a suspended
  coroutine, not a parked thread, so thousands of workers blocked in ``get`` cost a few KB
  each and no thread pool can run dry. The launcher keeps its own (synchronous) code;
  :meth:`RendezvousServer.start` returns as soon as the port is bound.
* gRPC core's defaults assume a multi-threaded server: it randomly cancels new calls once
  1000 wait to be picked up. The server raises that backlog limit, since a job's workers
  all call at once by design.
* All job state lives on that loop and is touched only from it, so the key-value store needs
  no locks. Blocked readers wait on per-key futures that a write resolves directly: a write
  wakes exactly the callers of that key, never scans all waiters.
* Every call is authenticated by an interceptor before its request is even parsed: the job
  secret (compared in constant time) and the job id travel as metadata. A rejected call changes
  nothing. The secret never appears in a log line or an error message.
* Elastic jobs (``elastic=True``) change membership while they run: the launcher publishes
  generation after generation of the slot table (:meth:`RendezvousServer.publish`). A
  worker's ``Register`` names the oldest generation it accepts and waits for it, so survivors
  of a failure simply re-register and wait for the launcher's next table. Every Watch event
  carries the newest generation number, so running workers learn of added or removed hosts.
  Publishing generation G fails every store call still waiting on a key of an older
  generation (``hvdrun/g<N>/...``, N < G) with ABORTED: a worker stuck bootstrapping a
  generation that can never complete moves on at once instead of waiting for its timeout.
  Writes to such keys (a late or replaying client) are refused with ABORTED as well.
* This module must not import torch: the CLI imports it and has to start fast.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio

from rendezvous import rendezvous_pb2, rendezvous_pb2_grpc
from rendezvous.server.common import Refusal
from rendezvous.server.guard import GuardInterceptor
from rendezvous.server.kv import Barriers, KeyValueStore
from rendezvous.server.membership import Membership, Place
from rendezvous.server.watch import Watches
from rendezvous.slots import SlotInfo
from rendezvous.tls import JobCertificate

__all__ = ["RendezvousServer"]

logger = logging.getLogger(__name__)


class _Servicer(rendezvous_pb2_grpc.RendezvousServicer):
    """The RPC handlers. Every method runs on the server's loop; state is loop-confined."""

    def __init__(
        self,
        slots: Sequence[SlotInfo],
        heartbeat_interval: float,
        max_value_bytes: int,
        elastic: bool = False,
        placed_size: int | None = None,
    ) -> None:
        self._watches = Watches(heartbeat_interval)
        self._membership = Membership(slots, elastic, placed_size, on_table=self._watches.beat)
        self._store = KeyValueStore(max_value_bytes)
        self._barriers = Barriers()

    def publish(self, slots: Sequence[SlotInfo]) -> int:
        """Makes ``slots`` the newest generation (on the loop); returns its number."""
        generation = self._membership.publish(slots)
        self._store.supersede(generation)
        self._watches.announce(generation)
        logger.info("published generation %d: %d slot(s)", generation, len(slots))
        return generation

    def begin_shutdown(self, message: str) -> None:
        """Ends every Watch stream with SHUTDOWN and fails every blocked call (on the loop)."""
        self._membership.shut_down(message)
        self._watches.shut_down(message)
        self._store.shut_down(message)
        self._barriers.shut_down(message)

    async def wait_watches_closed(self, timeout: float) -> None:
        """Waits (up to ``timeout``) until every Watch stream has ended, i.e. sent SHUTDOWN."""
        await self._watches.wait_closed(timeout)

    def registered_count(self) -> int:
        return self._membership.registered_count()

    def waiting_slots(self) -> set[tuple[str, int]]:
        return self._membership.waiting_slots()

    def watching_ranks(self) -> set[int]:
        return self._watches.watching_ranks()

    # ---- RPCs --------------------------------------------------------------------------

    async def Register(
        self, request: rendezvous_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.RankInfo:
        rank = request.rank if request.HasField("rank") else None
        try:
            place = await self._membership.register(
                request.host, request.local_rank, rank, request.min_generation, request.timeout_ms
            )
        except Refusal as refusal:
            await _refuse(context, refusal)
        return _rank_info(place)

    async def RegisterHost(
        self, request: rendezvous_pb2.RegisterHostRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.RegisterHostResponse:
        try:
            places = await self._membership.register_host(
                request.host, list(request.local_ranks), request.min_generation, request.timeout_ms
            )
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.RegisterHostResponse(ranks=[_rank_info(place) for place in places])

    async def Set(
        self, request: rendezvous_pb2.SetRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.Empty:
        try:
            self._store.set(request.key, request.value)
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.Empty()

    async def Get(
        self, request: rendezvous_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.GetResponse:
        try:
            value, ahead = await self._store.get(
                request.key, request.timeout_ms, request.read_ahead
            )
        except Refusal as refusal:
            await _refuse(context, refusal)
        if ahead:
            return rendezvous_pb2.GetResponse(value=value, ahead=ahead)
        return rendezvous_pb2.GetResponse(value=value)

    async def Wait(
        self, request: rendezvous_pb2.WaitRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.Empty:
        try:
            await self._store.wait(list(request.keys), request.timeout_ms)
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.Empty()

    async def MultiGet(
        self, request: rendezvous_pb2.MultiGetRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.MultiGetResponse:
        try:
            values = await self._store.multi_get(list(request.keys), request.timeout_ms)
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.MultiGetResponse(values=values)

    async def MultiSet(
        self, request: rendezvous_pb2.MultiSetRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.Empty:
        try:
            self._store.multi_set(list(request.keys), list(request.values))
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.Empty()

    async def Add(
        self, request: rendezvous_pb2.AddRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.AddResponse:
        try:
            value = self._store.add(request.key, request.amount)
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.AddResponse(value=value)

    async def CompareSet(
        self, request: rendezvous_pb2.CompareSetRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.GetResponse:
        try:
            value = self._store.compare_set(request.key, request.expected, request.desired)
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.GetResponse(value=value)

    async def Check(
        self, request: rendezvous_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.CheckResponse:
        return rendezvous_pb2.CheckResponse(ready=self._store.check(list(request.keys)))

    async def Delete(
        self, request: rendezvous_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.DeleteResponse:
        return rendezvous_pb2.DeleteResponse(deleted=self._store.delete(request.key))

    async def NumKeys(
        self, request: rendezvous_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.NumKeysResponse:
        return rendezvous_pb2.NumKeysResponse(count=self._store.num_keys())

    async def Barrier(
        self, request: rendezvous_pb2.BarrierRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.Empty:
        try:
            await self._barriers.arrive(request.name, request.participants, request.timeout_ms)
        except Refusal as refusal:
            await _refuse(context, refusal)
        return rendezvous_pb2.Empty()

    async def Watch(
        self, request: rendezvous_pb2.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rendezvous_pb2.WatchEvent]:
        try:
            self._membership.check_ranks([request.rank])
        except Refusal as refusal:
            await _refuse(context, refusal)
        async for event in self._watches.events([request.rank]):
            yield event

    async def WatchHost(
        self, request: rendezvous_pb2.WatchHostRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rendezvous_pb2.WatchEvent]:
        ranks = list(request.ranks)
        if not ranks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "WatchHost lists no ranks")
        try:
            self._membership.check_ranks(ranks)
        except Refusal as refusal:
            await _refuse(context, refusal)
        async for event in self._watches.events(ranks):
            yield event


_T = TypeVar("_T")


async def _refuse(context: grpc.aio.ServicerContext, refusal: Refusal) -> NoReturn:
    """Ends the call with the refusal's status and message."""
    await context.abort(refusal.code, refusal.message)
    raise AssertionError("unreachable")  # pragma: no cover


def _rank_info(place: Place) -> rendezvous_pb2.RankInfo:
    slot, generation = place
    return rendezvous_pb2.RankInfo(
        rank=slot.rank,
        size=slot.size,
        local_rank=slot.local_rank,
        local_size=slot.local_size,
        cross_rank=slot.cross_rank,
        cross_size=slot.cross_size,
        generation=generation,
    )


def _check_slots(slots: Sequence[SlotInfo]) -> None:
    seen: set[tuple[str, int]] = set()
    for slot in slots:
        if (slot.hostname, slot.local_rank) in seen:
            raise ValueError(f"duplicate slot: host {slot.hostname!r} local_rank {slot.local_rank}")
        seen.add((slot.hostname, slot.local_rank))


class _LoopThread:
    """The process's one asyncio loop for gRPC servers, in a daemon thread.

    grpc.aio binds its completion-queue poller to the loops it serves and assumes they live
    as long as the process; a loop per server that is closed on stop() leaves the poller
    dispatching late events to a closed loop. So every RendezvousServer in a process shares
    this loop, which is started on first use and never closed.
    """

    _lock = threading.Lock()
    _current: _LoopThread | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="hvdrun-rendezvous", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            current = cls._current
            # A forked child inherits the object but not the thread: start a new one.
            if current is None or current.pid != os.getpid() or not current.thread.is_alive():
                current = cls._current = _LoopThread()
            return current

    def run(self, coroutine: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Runs ``coroutine`` on the loop and waits for its result (from another thread)."""
        if threading.current_thread() is self.thread:
            coroutine.close()
            raise RuntimeError("must not be called from the rendezvous server's own thread")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


class RendezvousServer:
    """One job's rendezvous service, served from a daemon thread of the calling process.

    ``slots`` is the job's slot table (see :func:`rendezvous.slots.assign_slots`); workers
    register with ``(hostname, local_rank)`` and learn their :class:`SlotInfo`. A job that
    another launcher placed passes ``placed_size`` (its number of ranks) and no slots:
    workers register with the rank that launcher gave them, and the table is derived from the
    hosts they register from (:func:`rendezvous.slots.derive_slots`).

    ``tls`` (the job's :class:`~rendezvous.tls.JobCertificate`) makes it serve TLS only; its
    clients then pin that certificate. Without it the server speaks plain HTTP/2, which is
    only for servers bound to loopback.
    """

    def __init__(
        self,
        slots: Sequence[SlotInfo],
        secret: str,
        job_id: str,
        *,
        bind_host: str = "0.0.0.0",
        port: int = 0,
        heartbeat_interval: float = 1.0,
        max_value_bytes: int = 4 * 1024 * 1024,
        elastic: bool = False,
        placed_size: int | None = None,
        tls: JobCertificate | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the job secret must not be empty")
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval must be positive, got {heartbeat_interval}")
        if max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be positive, got {max_value_bytes}")
        if placed_size is not None and (placed_size < 1 or slots or elastic):
            raise ValueError("placed_size: a positive job size, with no slots, not elastic")
        _check_slots(slots)
        self._slots = list(slots)
        self._secret = secret
        self._job_id = job_id
        self._bind_host = bind_host
        self._requested_port = port
        self._max_value_bytes = max_value_bytes
        self._tls = tls
        self._servicer = _Servicer(
            self._slots, heartbeat_interval, max_value_bytes, elastic, placed_size
        )
        self._loop_thread: _LoopThread | None = None
        self._server: grpc.aio.Server | None = None
        self._port: int | None = None
        self._state_lock = threading.Lock()
        self._stopped = False

    def __repr__(self) -> str:  # never shows the secret
        with self._state_lock:
            port = self._port
        return f"RendezvousServer(job_id={self._job_id!r}, port={port})"

    @property
    def port(self) -> int:
        """The bound port; only valid after :meth:`start`."""
        with self._state_lock:
            port = self._port
        if port is None:
            raise RuntimeError("the rendezvous server has not been started")
        return port

    def start(self) -> int:
        """Binds and starts serving on the rendezvous loop thread; returns the bound port."""
        with self._state_lock:
            if self._stopped:
                raise RuntimeError("a stopped rendezvous server cannot be started again")
            if self._port is not None:
                return self._port
            loop_thread = _LoopThread.get()
            port = loop_thread.run(self._start_server(), timeout=30)
            self._loop_thread = loop_thread
            self._port = port
        logger.info("rendezvous server for job %s listening on port %d", self._job_id, port)
        return port

    async def _start_server(self) -> int:
        message_limit = 2 * self._max_value_bytes + 1024 * 1024
        server = grpc.aio.server(
            interceptors=[GuardInterceptor(self._secret, self._job_id)],
            options=[
                # A value somewhat over the limit must still reach the handler, which answers
                # INVALID_ARGUMENT with a clear message instead of a transport error.
                ("grpc.max_receive_message_length", message_limit),
                ("grpc.max_send_message_length", message_limit),
                # Two servers must never share a port silently.
                ("grpc.so_reuseport", 0),
                # gRPC core randomly cancels new calls once more than 1000 wait to be picked
                # up by the (single-threaded) server loop. Thousands of workers calling at
                # once are normal here, so allow a deep backlog instead.
                ("grpc.server.max_pending_requests", 100_000),
                ("grpc.server.max_pending_requests_hard_limit", 200_000),
                # Clients ping during long blocking calls to notice a cut network.
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
        )
        rendezvous_pb2_grpc.add_RendezvousServicer_to_server(self._servicer, server)
        host = self._bind_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        address = f"{host}:{self._requested_port}"
        try:
            if self._tls is not None:
                port = server.add_secure_port(address, self._tls.server_credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as error:
            raise OSError(f"rendezvous server cannot listen on {address}: {error}") from None
        if port == 0:
            raise OSError(f"rendezvous server cannot listen on {address}")
        await server.start()
        self._server = server
        return port

    def stop(self, grace: float = 0.5) -> None:
        """Sends SHUTDOWN on every Watch stream, fails blocked calls, and stops serving."""
        with self._state_lock:
            if self._stopped:
                return
            self._stopped = True
            loop_thread = self._loop_thread
        if loop_thread is None:
            return
        try:
            loop_thread.run(self._stop_server(grace), timeout=max(grace, 1.0) + grace + 10)
        except Exception:
            logger.exception("error while stopping the rendezvous server")
        logger.info("rendezvous server for job %s stopped", self._job_id)

    async def _stop_server(self, grace: float) -> None:
        self._servicer.begin_shutdown("the rendezvous server is shutting down")
        # Let every Watch stream send its SHUTDOWN before the server cancels what is left
        # (bounded: a stalled client must not hold up the launcher).
        await self._servicer.wait_watches_closed(max(grace, 1.0))
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    def registered_count(self) -> int:
        """How many distinct slots have registered so far (elastic: in the newest generation)."""
        return self._ask(self._servicer.registered_count, 0)

    def publish(self, slots: Sequence[SlotInfo]) -> int:
        """Elastic jobs: makes ``slots`` the newest membership generation; returns its number.

        Workers waiting in ``Register`` for it get their new places; running workers see the
        number on their Watch stream; bootstraps of older generations that still wait fail.
        """
        _check_slots(slots)
        with self._state_lock:
            loop_thread = self._loop_thread
        if loop_thread is None:
            raise RuntimeError("the rendezvous server has not been started")

        async def publish() -> int:
            return self._servicer.publish(slots)

        return loop_thread.run(publish(), timeout=30)

    def waiting_slots(self) -> set[tuple[str, int]]:
        """Elastic jobs: (host, local_rank) of workers blocked in Register until a generation
        newer than the newest is published (survivors of a failed collective)."""
        return self._ask(self._servicer.waiting_slots, set())

    def watching_ranks(self) -> set[int]:
        """Ranks that hold an open Watch stream right now."""
        return self._ask(self._servicer.watching_ranks, set())

    def _ask(self, question: Callable[[], _T], unstarted: _T) -> _T:
        """``question()`` answered on the server's loop, which owns the job's state: callers
        on any other thread see it as the loop left it between two steps, with no lock. (Not
        from the loop's own thread.) A server never started has served nothing, so
        ``unstarted`` is its answer."""
        with self._state_lock:
            loop_thread = self._loop_thread
        if loop_thread is None:
            return unstarted

        async def ask() -> _T:
            return question()

        return loop_thread.run(ask(), timeout=30)

    def __enter__(self) -> RendezvousServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
