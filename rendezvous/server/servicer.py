"""The gRPC face of the rendezvous service: one handler per RPC, each a thin delegation.

The work is done by the parts, which know nothing of gRPC calls: the key-value store and
its barriers (:mod:`rendezvous.server.kv`), registration and generations
(:mod:`rendezvous.server.membership`) and the Watch streams (:mod:`rendezvous.server.watch`).
A handler unpacks its request, calls one part, and packs the answer; a part that refuses
raises :class:`~rendezvous.server.common.Refusal`, which the handler turns into the call's
status. The few operations that span parts (publishing a generation, shutting down) are
here, so that each part stays ignorant of the others.

Threads: the servicer and its parts are made on the thread that builds the server and, from
the moment the server is started, are used only on the server's asyncio loop: the RPC
handlers run there, and :class:`~rendezvous.server.serving.RendezvousServer` runs
:meth:`Servicer.publish`, :meth:`Servicer.begin_shutdown` and the queries there too. Its own
fields (the four parts) never change.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import NoReturn

import grpc
import grpc.aio

from rendezvous import rendezvous_pb2, rendezvous_pb2_grpc, worker_env
from rendezvous.server.common import LOGGER_NAME, Refusal
from rendezvous.server.kv import Barriers, KeyValueStore
from rendezvous.server.membership import Membership, Place
from rendezvous.server.watch import Watches
from rendezvous.slots import SlotInfo

logger = logging.getLogger(LOGGER_NAME)


class Servicer(rendezvous_pb2_grpc.RendezvousServicer):
    """The RPC handlers, and what the server does across parts; see the module docstring."""

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

    def abandon(self, message: str) -> None:
        """Fails every blocked and later read of the store with ABORTED ``message``."""
        self._store.abandon(message)

    async def wait_watches_closed(self, timeout: float) -> None:
        """Waits (up to ``timeout``) until every Watch stream has ended, i.e. sent SHUTDOWN."""
        await self._watches.wait_closed(timeout)

    def registered_count(self) -> int:
        return self._membership.registered_count()

    def registered_slots(self) -> frozenset[tuple[str, int]]:
        return self._membership.registered_slots()

    def waiting_slots(self) -> set[tuple[str, int]]:
        return self._membership.waiting_slots()

    def state_holders(self) -> dict[int, int]:
        """Elastic jobs: worker number -> the generation it last synced the training state
        in, as the workers reported it (see ``worker_env.STATE_KEY_PREFIX``)."""
        return self._by_worker(worker_env.STATE_KEY_PREFIX)

    def _by_worker(self, prefix: str) -> dict[int, int]:
        """The workers' numeric reports under ``prefix``: worker number -> its number."""
        reports = {}
        for key, value in self._store.values_under(prefix).items():
            worker, text = key[len(prefix) :], value.decode("ascii", "replace")
            if worker.isdigit() and text.isdigit():
                reports[int(worker)] = int(text)
        return reports

    def call_roll(self) -> int:
        return self._watches.call_roll()

    def present_workers(self, roll: int) -> set[int]:
        """Elastic jobs: the workers (by number) that answered roll call ``roll`` or a later
        one (see ``worker_env.PRESENT_KEY_PREFIX``)."""
        answers = self._by_worker(worker_env.PRESENT_KEY_PREFIX)
        return {worker for worker, answered in answers.items() if answered >= roll}

    def watching_ranks(self) -> set[int]:
        return self._watches.watching_ranks()

    def left_ranks(self) -> set[int]:
        return self._watches.left_ranks()

    def values_under(self, prefix: str) -> dict[str, bytes]:
        """Every key of the store under ``prefix`` (the workers' reports), and its value."""
        return self._store.values_under(prefix)

    def put_values(self, values: Mapping[str, bytes]) -> None:
        """Stores every pair (what the launcher hands its workers), or none if one is
        refused (a value over the limit)."""
        self._store.multi_set(list(values), list(values.values()))

    # ---- RPCs --------------------------------------------------------------------------

    async def Register(
        self, request: rendezvous_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> rendezvous_pb2.RankInfo:
        rank = request.rank if request.HasField("rank") else None
        size = request.size if request.HasField("size") else None
        try:
            place = await self._membership.register(
                request.host,
                request.local_rank,
                rank,
                request.min_generation,
                request.timeout_ms,
                size=size,
                process=request.process,
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
            self._store.multi_set(request.keys, request.values)
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
        return rendezvous_pb2.CheckResponse(ready=self._store.check(request.keys))

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
