"""A host's rendezvous relay: the job's workers on one host reach the server through it.

Why it exists: with every worker holding its own connection and heartbeat stream, the
launcher's rendezvous server does work for every rank every second, and a job of thousands
of ranks spends a core on heartbeats alone. The agent that already runs on every host runs
this relay instead (``launcher.agent``), so the server sees hosts, not ranks:

* Workers dial the relay on a Unix socket in a directory only the job's user can enter; the
  relay forwards their calls, unchanged (their own secret and job id travel with them, so
  the server still authenticates every call), over one connection per host (TLS where
  the server speaks it).
* Heartbeats: the relay holds one ``WatchHost`` stream for all the host's ranks and beats
  its workers' ``Watch`` streams locally. A stream that breaks (a reset connection, a
  network down for a while) is opened again; when the server ends the job or refuses the
  stream, or stays silent for ``lost_after`` seconds, every local stream ends with SHUTDOWN
  at once: a worker notices a lost job within the same bound as with a stream of its own.
* Reads of the same key by several local workers at once (the NCCL unique id, a peer's
  Gloo address) go to the server once; every waiting worker gets that answer. Registers of
  the host's workers that arrive within a few milliseconds go as one ``RegisterHost``.

Only fixed (non-elastic) jobs use it: the host's ranks are known when it starts.
This module must not import torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY, rendezvous_pb2
from rendezvous.addresses import DIRECT
from rendezvous.client import RELAY_LOST, REOPEN_SECONDS, TRANSIENT_CODES
from rendezvous.tls import TARGET_NAME, channel_credentials

__all__ = ["HostRelay"]

logger = logging.getLogger(__name__)

_SERVICE = rendezvous_pb2.DESCRIPTOR.services_by_name["Rendezvous"]
_PREFIX = f"/{_SERVICE.full_name}/"
_STREAMING = {method.name for method in _SERVICE.methods if method.server_streaming}
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


#: The relay's directory: ``<tmp>/hvdrun-relay-<host>-<pid of the agent>-<random>``, where
#: ``<host>`` is a short digest of the host's name: a TMPDIR shared between hosts (an HPC
#: scratch directory) holds other hosts' directories, whose pids mean nothing here.
_DIR_PREFIX = "hvdrun-relay-"


def _host_prefix() -> str:
    digest = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
    return f"{_DIR_PREFIX}{digest}-"


#: The socket in it, and the longest path a Unix socket may have (``sun_path``, less its NUL).
_SOCKET = "rendezvous.sock"
_MAX_SOCKET_PATH = 107


def remove_stale_dirs(parent: str) -> list[str]:
    """Removes the relay directories of this host in ``parent`` whose agent has died without
    cleaning up (killed, out of memory): nothing else on the host would. Returns those
    removed."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    mine = _host_prefix()
    removed = []
    for name in names:
        pid_text = name[len(mine) :].split("-", 1)[0]
        if not name.startswith(mine) or not pid_text.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            found = os.lstat(path)  # (a link of that name is no relay's: left alone)
            if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
            continue  # its agent still runs
        except ProcessLookupError:
            pass
        except OSError:  # gone already, or a live process of another user
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


#: How long the relay holds a worker's Register for the host's other workers to join it.
_REGISTER_WINDOW = 0.02
#: (host, min_generation, timeout_ms, metadata) of Registers that can go as one RegisterHost
_BatchKey = tuple[str, int, int, tuple[tuple[str, str], ...]]
#: a waiting Register: (local rank, its request, where its answer goes)
_Pending = tuple[int, bytes, "asyncio.Future[bytes]"]


class _Failed(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class HostRelay:
    """Relays one host's workers to the rendezvous server at ``upstream``.

    ``ranks`` are the host's ranks (its ``WatchHost`` stream carries them). :meth:`start`
    returns the address workers dial (``unix:...``).
    """

    def __init__(
        self,
        upstream: str,
        secret: str,
        job_id: str,
        ranks: Sequence[int],
        *,
        cert_pem: bytes | str | None = None,
        heartbeat_interval: float = 1.0,
        lost_after: float = 5.0,
    ) -> None:
        if not ranks:
            raise ValueError("a relay needs the host's ranks")
        self.upstream = upstream
        self._secret = secret.encode("utf-8")
        self._metadata = ((TOKEN_METADATA_KEY, secret), (JOB_METADATA_KEY, job_id))
        self._ranks = list(ranks)
        self._cert_pem = cert_pem
        self._heartbeat_interval = heartbeat_interval
        self._lost_after = lost_after
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="hvdrun-relay", daemon=True)
        self._dir = ""
        self.addr = ""
        # Loop-confined state.
        self._channel: grpc.aio.Channel | None = None
        self._server: grpc.aio.Server | None = None
        self._calls: dict[str, Any] = {}
        self._inflight: dict[tuple[bytes, tuple[tuple[str, str], ...]], asyncio.Future[bytes]] = {}
        self._batches: dict[_BatchKey, list[_Pending]] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        self._pulse = asyncio.Event()
        self._ended: str | None = None  # why the upstream stream ended (then every Watch ends)
        self._last_heard = 0.0  # loop time of the server's latest event
        self._generation = 0
        self._upstream_task: asyncio.Task[None] | None = None
        #: Calls sent to the server (a coalesced read counts once); for tests and benchmarks.
        self.upstream_calls = 0

    def __repr__(self) -> str:  # never shows the secret
        return f"HostRelay(upstream={self.upstream!r}, addr={self.addr!r})"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _on_loop(self, coroutine: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # ---- lifetime ------------------------------------------------------------------------

    def start(self) -> str:
        """Binds the local socket, opens the server's heartbeat stream; returns the address."""
        parent = tempfile.gettempdir()
        prefix = f"{_host_prefix()}{os.getpid()}-"
        longest = os.path.join(parent, f"{prefix}12345678", _SOCKET)
        if len(os.fsencode(longest)) > _MAX_SOCKET_PATH and os.access("/tmp", os.W_OK):
            parent = "/tmp"  # (a long TMPDIR: the socket's path would not fit)
        stale = remove_stale_dirs(parent)
        if stale:
            logger.info("removed relay directories of agents that died: %s", stale)
        # 0700: only this user
        self._dir = tempfile.mkdtemp(prefix=prefix, dir=parent)
        self._thread.start()
        self.addr = self._on_loop(self._start())
        logger.info("rendezvous relay for ranks %s at %s", self._ranks, self.addr)
        return self.addr

    async def _start(self) -> str:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            DIRECT,
        ]
        if self._cert_pem:
            options.append(("grpc.ssl_target_name_override", TARGET_NAME))
            self._channel = grpc.aio.secure_channel(
                self.upstream, channel_credentials(self._cert_pem), options
            )
        else:
            self._channel = grpc.aio.insecure_channel(self.upstream, options)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ]
        )
        server.add_generic_rpc_handlers([_Handler(self)])
        address = f"unix:{os.path.join(self._dir, _SOCKET)}"
        server.add_insecure_port(address)
        await server.start()
        self._server = server
        self._upstream_task = asyncio.ensure_future(self._watch_upstream())
        self._schedule_pulse()
        return address

    def stop(self) -> None:
        """Ends the workers' streams and stops relaying. Idempotent."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._on_loop(self._stop(), timeout=10)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    async def _stop(self) -> None:
        self._end("the host's rendezvous relay stopped", expected=True)
        if self._upstream_task is not None:
            self._upstream_task.cancel()
        if self._server is not None:
            await self._server.stop(0.5)
        if self._channel is not None:
            await self._channel.close(None)

    # ---- heartbeats ----------------------------------------------------------------------

    def _schedule_pulse(self) -> None:
        if self._ended is None:
            self._loop.call_later(self._heartbeat_interval, self._beat_and_reschedule)

    def _beat_and_reschedule(self) -> None:
        self._beat()
        self._schedule_pulse()

    def _beat(self) -> None:
        old, self._pulse = self._pulse, asyncio.Event()
        old.set()

    def _end(self, reason: str, expected: bool = False, by_server: bool = False) -> None:
        """Ends the workers' streams for ``reason`` (``by_server``: the server's SHUTDOWN
        message); a warning unless the agent stopped the relay (``expected``: the end of
        every job)."""
        if self._ended is None:
            self._ended = reason
            said = f"the rendezvous server shut down the job: {reason}" if by_server else reason
            logger.log(logging.DEBUG if expected else logging.WARNING, "rendezvous relay: %s", said)
        self._beat()

    async def _watch_upstream(self) -> None:
        """Holds the host's WatchHost stream; a stream that breaks (a reset connection, a
        network that was down a while) is opened again, as a worker's own watch does, until
        the server has been silent for ``lost_after`` seconds: only then, or when the server
        ends the job or refuses the stream, do the workers' streams end."""
        self._last_heard = self._loop.time()
        while self._ended is None:
            broke = await self._hold_upstream()
            if broke is None:
                return
            silent = self._loop.time() - self._last_heard
            if silent >= self._lost_after:
                self._end(
                    f"{RELAY_LOST} at {self.upstream}: no heartbeat for {silent:.0f} s; "
                    f"the last stream {broke}"
                )
                return
            logger.warning("rendezvous relay: the host's watch stream %s; opening it again", broke)
            await asyncio.sleep(min(REOPEN_SECONDS, self._lost_after - silent))

    async def _hold_upstream(self) -> str | None:
        """One WatchHost stream until it ends: why it broke, or None once the relay ended."""
        assert self._channel is not None
        call = self._channel.unary_stream(
            _PREFIX + "WatchHost",
            request_serializer=rendezvous_pb2.WatchHostRequest.SerializeToString,
            response_deserializer=rendezvous_pb2.WatchEvent.FromString,
        )(rendezvous_pb2.WatchHostRequest(ranks=self._ranks), metadata=self._metadata)
        self.upstream_calls += 1
        try:
            while True:
                left = self._lost_after - (self._loop.time() - self._last_heard)
                try:
                    event = await asyncio.wait_for(call.read(), max(left, 0.0))
                except asyncio.TimeoutError:
                    self._end(
                        f"{RELAY_LOST} at {self.upstream}: no heartbeat for {self._lost_after:g} s"
                    )
                    return None
                if event is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return "was closed by the server"
                self._last_heard = self._loop.time()
                beat: rendezvous_pb2.WatchEvent = event  # type: ignore[assignment]
                self._generation = beat.generation
                if beat.kind == rendezvous_pb2.WatchEvent.SHUTDOWN:
                    # (passed on as the server said it: a worker's watch says who ended the job)
                    self._end(beat.message or "no reason given", by_server=True)
                    return None
        except grpc.aio.AioRpcError as error:
            failed = f"{error.code().name}: {error.details()}"
            if error.code() not in TRANSIENT_CODES:  # refused: asking again cannot help
                self._end(f"{RELAY_LOST} at {self.upstream}: it refused the watch stream: {failed}")
                return None
            return f"failed: {failed}"
        finally:
            call.cancel()

    async def local_watch(
        self, metadata: Sequence[tuple[str, str | bytes]]
    ) -> AsyncIterator[rendezvous_pb2.WatchEvent]:
        kinds = rendezvous_pb2.WatchEvent
        while self._ended is None:
            pulse = self._pulse
            yield kinds(kind=kinds.HEARTBEAT, generation=self._generation)
            await pulse.wait()
        yield kinds(kind=kinds.SHUTDOWN, message=self._ended, generation=self._generation)

    def authentic(self, metadata: Sequence[tuple[str, str | bytes]]) -> bool:
        token = dict(metadata).get(TOKEN_METADATA_KEY, b"")
        if isinstance(token, str):
            token = token.encode("utf-8")
        return hmac.compare_digest(token, self._secret)

    # ---- forwarding ----------------------------------------------------------------------

    def _unary(self, method: str) -> Any:
        call = self._calls.get(method)
        if call is None:
            assert self._channel is not None
            # No (de)serializers: requests and answers pass through as the workers' bytes.
            call = self._calls[method] = self._channel.unary_unary(  # type: ignore[call-arg]
                _PREFIX + method
            )
        return call

    async def forward(
        self,
        method: str,
        request: bytes,
        metadata: tuple[tuple[str, str], ...],
        timeout: float | None,
    ) -> bytes:
        """One call to the server; concurrent identical Gets share one, and Registers of
        this host's workers that arrive together go as one RegisterHost."""
        if method == "Register":
            return await self._register(request, metadata, timeout)
        if method != "Get":
            return await self._send(method, request, metadata, timeout)
        key = (request, metadata)
        shared = self._inflight.get(key)
        if shared is None:
            shared = self._inflight[key] = asyncio.ensure_future(
                self._send(method, request, metadata, timeout)
            )
            shared.add_done_callback(lambda _: self._inflight.pop(key, None))
        return await asyncio.shield(shared)

    async def _register(
        self, request: bytes, metadata: tuple[tuple[str, str], ...], timeout: float | None
    ) -> bytes:
        try:
            parsed = rendezvous_pb2.RegisterRequest.FromString(request)
        except Exception:  # the server gives the malformed request its answer
            return await self._send("Register", request, metadata, timeout)
        if parsed.HasField("rank"):  # placed by another launcher: the server waits for all
            return await self._send("Register", request, metadata, timeout)
        key = (parsed.host, parsed.min_generation, parsed.timeout_ms, metadata)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = []
            self._loop.call_later(_REGISTER_WINDOW, self._flush_registers, key, timeout)
        waiter: asyncio.Future[bytes] = self._loop.create_future()
        batch.append((parsed.local_rank, request, waiter))
        if len(batch) >= len(self._ranks):  # every local worker is here: no need to wait
            self._flush_registers(key, timeout)
        return await waiter

    def _flush_registers(self, key: _BatchKey, timeout: float | None) -> None:
        batch = self._batches.pop(key, None)
        if batch:
            task = asyncio.ensure_future(self._register_batch(key, batch, timeout))
            self._tasks.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(self._tasks.discard)

    async def _register_batch(
        self, key: _BatchKey, batch: list[_Pending], timeout: float | None
    ) -> None:
        host, min_generation, timeout_ms, metadata = key
        if len(batch) > 1:
            request = rendezvous_pb2.RegisterHostRequest(
                host=host,
                local_ranks=[local_rank for local_rank, _, _ in batch],
                min_generation=min_generation,
                timeout_ms=timeout_ms,
            )
            try:
                answer = await self._send(
                    "RegisterHost", request.SerializeToString(), metadata, timeout
                )
                infos = rendezvous_pb2.RegisterHostResponse.FromString(answer).ranks
                for (_, _, waiter), info in zip(batch, infos, strict=True):
                    if not waiter.done():
                        waiter.set_result(info.SerializeToString())
                return
            except Exception:
                pass  # each worker gets its own answer (and its own error) below
        for _, request_bytes, waiter in batch:
            try:
                result = await self._send("Register", request_bytes, metadata, timeout)
            except Exception as error:
                if not waiter.done():
                    waiter.set_exception(error)
            else:
                if not waiter.done():
                    waiter.set_result(result)

    async def _send(
        self,
        method: str,
        request: bytes,
        metadata: tuple[tuple[str, str], ...],
        timeout: float | None,
    ) -> bytes:
        self.upstream_calls += 1
        try:
            response: bytes = await self._unary(method)(request, metadata=metadata, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise _Failed(error.code(), error.details() or "") from None
        return response


def _forwarded_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    keep = (TOKEN_METADATA_KEY, JOB_METADATA_KEY)
    return tuple(
        (key, value if isinstance(value, str) else value.decode("utf-8", "replace"))
        for key, value in context.invocation_metadata() or ()
        if key in keep
    )


class _Handler(grpc.GenericRpcHandler):
    """Every method of the service: Watch served here, the rest sent on as raw bytes."""

    def __init__(self, relay: HostRelay) -> None:
        self._relay = relay

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if not method.startswith(_PREFIX):
            return None
        name = method[len(_PREFIX) :]
        relay = self._relay
        if name == "Watch":

            async def watch(request: bytes, context: grpc.aio.ServicerContext) -> Any:
                metadata: Sequence[tuple[str, str | bytes]] = tuple(
                    context.invocation_metadata() or ()
                )
                if not relay.authentic(metadata):
                    await context.abort(
                        grpc.StatusCode.UNAUTHENTICATED,
                        f"missing or invalid job token (metadata {TOKEN_METADATA_KEY!r})",
                    )
                async for event in relay.local_watch(metadata):
                    yield event

            return grpc.unary_stream_rpc_method_handler(
                watch, response_serializer=rendezvous_pb2.WatchEvent.SerializeToString
            )
        if name in _STREAMING:
            return None  # WatchHost is the relay's own business with the server
        forward = _forwarder(relay, name)
        return grpc.unary_unary_rpc_method_handler(forward)


def _forwarder(relay: HostRelay, name: str) -> Callable[..., Any]:
    async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            return await relay.forward(
                name, request, _forwarded_metadata(context), context.time_remaining()
            )
        except _Failed as failed:
            await context.abort(failed.code, failed.details)
            raise AssertionError("unreachable") from None  # pragma: no cover

    return forward
