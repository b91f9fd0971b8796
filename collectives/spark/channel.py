"""The line between the driver and its Spark tasks: one gRPC stream per task.

Each Spark task opens one bidirectional stream to the driver for its whole life. Over it the
task says who it is (:data:`HELLO`), forwards its worker's output line by line
(:data:`OUTPUT`) and finally its worker's exit and result (:data:`EXIT`); the driver answers
with what the worker needs to join the job (:data:`START`) or tells the task to stop its
worker (:data:`STOP`). The stream itself is the liveness signal both ways: a driver that
dies closes it (the task then stops its worker), and so does a task or an executor that is
lost (the driver then counts the task as failed). Keepalive pings find a peer whose host
vanished without closing anything.

Why gRPC and not a plain socket: the stream needs the rendezvous's protections (the job
secret checked in constant time before anything is read, TLS with the job's pinned
certificate when tasks run on other hosts), and gRPC takes the certificate's private key
from memory, so it never touches a disk. The server runs on the process's rendezvous loop
(:class:`rendezvous.server.loop.LoopThread`) behind the rendezvous's own
:class:`~rendezvous.server.guard.GuardInterceptor`.

A frame is one gRPC message of raw bytes: a kind byte, then the kind's body (JSON for the
small control frames; raw bytes for output lines and pickled results).

Threads: the server's streams live on the loop; the driver's thread hands frames to them
with :meth:`TaskChannelServer.send`, and every frame that arrives, and every stream that
ends, is put on the driver's ``events`` queue, which only the driver's thread reads. The
task side is synchronous: :class:`TaskChannelClient` sends from any thread (a queue feeds
the request stream) and one reader thread turns the driver's frames into a queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import queue
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

# (rendezvous first: importing it turns off gRPC's tracers that print headers, see there)
from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY

# isort: split
import grpc
import grpc.aio

from rendezvous.addresses import DIRECT, join_addr
from rendezvous.server.guard import GuardInterceptor
from rendezvous.server.loop import LoopThread
from rendezvous.tls import TARGET_NAME, JobCertificate, channel_credentials

__all__ = [
    "EXIT",
    "HELLO",
    "OUTPUT",
    "START",
    "STOP",
    "Closed",
    "Received",
    "TaskChannelClient",
    "TaskChannelServer",
    "decode_exit",
    "encode_exit",
    "json_frame",
    "read_json",
]

logger = logging.getLogger(__name__)

METHOD = "/hvdrun.spark.Tasks/Task"
#: task -> driver
HELLO = b"H"
OUTPUT = b"O"
EXIT = b"X"
#: driver -> task
START = b"S"
STOP = b"Q"
#: A result travels as one frame; Spark's own default cap on results is 1 GiB too.
MAX_FRAME = 1024 * 1024 * 1024 - 1024
#: Pings find a peer whose host vanished without closing the connection.
KEEPALIVE_MS = 5000
_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME + 1024),
    ("grpc.max_send_message_length", MAX_FRAME + 1024),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    DIRECT,
]
_SERVER_OPTIONS = [
    *_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS),
    ("grpc.http2.max_ping_strikes", 0),
]


def json_frame(kind: bytes, body: dict[str, Any]) -> bytes:
    return kind + json.dumps(body).encode("utf-8")


def read_json(frame: bytes) -> dict[str, Any]:
    body = json.loads(frame[1:].decode("utf-8"))
    if not isinstance(body, dict):
        raise ValueError("a control frame's body must be a JSON object")
    return body


def encode_exit(header: dict[str, Any], result: bytes) -> bytes:
    head = json.dumps(header).encode("utf-8")
    return EXIT + struct.pack(">I", len(head)) + head + result


def decode_exit(frame: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack(">I", frame[1:5])
    header = json.loads(frame[5 : 5 + length].decode("utf-8"))
    return header, frame[5 + length :]


# ---- the driver's side ----------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """A frame from the task on stream ``stream``."""

    stream: int
    frame: bytes


@dataclass(frozen=True)
class Closed:
    """Stream ``stream`` ended: the task finished, failed, or was lost (``reason``)."""

    stream: int
    reason: str


class TaskChannelServer:
    """The driver's end: accepts the tasks' streams and reports them on ``events``."""

    def __init__(
        self,
        secret: str,
        job_id: str,
        events: queue.Queue[Any],
        *,
        bind_host: str = "127.0.0.1",
        tls: JobCertificate | None = None,
    ) -> None:
        self._secret = secret
        self._job_id = job_id
        self._events = events
        self._bind_host = bind_host
        self._tls = tls
        self._loop_thread = LoopThread.get()
        self._server: grpc.aio.Server | None = None
        self._ids = itertools.count()
        self._outboxes: dict[int, asyncio.Queue[bytes | None]] = {}  # loop-only

    def start(self) -> int:
        """Binds and serves; returns the port."""
        return self._loop_thread.run(self._start(), timeout=30)

    async def _start(self) -> int:
        server = grpc.aio.server(
            interceptors=[GuardInterceptor(self._secret, self._job_id)], options=_SERVER_OPTIONS
        )
        handler = grpc.stream_stream_rpc_method_handler(self._serve)
        service, method = METHOD.rsplit("/", 1)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service.strip("/"), {method: handler}),)
        )
        address = join_addr(self._bind_host, 0)
        if self._tls is not None:
            port = server.add_secure_port(address, self._tls.server_credentials())
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"the Spark task channel cannot listen on {address}")
        await server.start()
        self._server = server
        return port

    async def _serve(self, requests: AsyncIterator[bytes], context: Any) -> None:
        stream = next(self._ids)
        outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._outboxes[stream] = outbox

        async def write() -> None:
            while (frame := await outbox.get()) is not None:
                await context.write(frame)

        writer = asyncio.ensure_future(write())
        reason = "the task closed its stream"
        try:
            async for frame in requests:
                self._events.put(Received(stream, frame))
        except (asyncio.CancelledError, Exception) as error:
            reason = f"the connection to the task broke ({type(error).__name__})"
        finally:
            self._outboxes.pop(stream, None)
            self._events.put(Closed(stream, reason))
            outbox.put_nowait(None)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(writer, 5)

    def send(self, stream: int, frame: bytes) -> None:
        """Queues ``frame`` for the task on ``stream`` (dropped if the stream has ended)."""
        self._loop_thread.loop.call_soon_threadsafe(self._put, stream, frame)

    def end(self, stream: int) -> None:
        """Ends the driver's side of ``stream`` once what was queued before has gone out."""
        self._loop_thread.loop.call_soon_threadsafe(self._put, stream, None)

    def _put(self, stream: int, frame: bytes | None) -> None:
        outbox = self._outboxes.get(stream)
        if outbox is not None:
            outbox.put_nowait(frame)

    def stop(self, grace: float = 1.0) -> None:
        async def stop() -> None:
            server, self._server = self._server, None
            if server is not None:
                await server.stop(grace)

        try:
            self._loop_thread.run(stop(), timeout=grace + 10)
        except Exception:
            logger.exception("error while stopping the Spark task channel")


# ---- the task's side ------------------------------------------------------------------


class TaskChannelClient:
    """A task's end of its stream. :meth:`receive` returns the driver's frames, or None
    once the stream has ended (:attr:`ended` says why)."""

    def __init__(self, addr: str, secret: str, job_id: str, cert_pem: str = "") -> None:
        options: list[tuple[str, Any]] = list(_OPTIONS)
        if cert_pem:
            options.append(("grpc.ssl_target_name_override", TARGET_NAME))
            self._channel = grpc.secure_channel(addr, channel_credentials(cert_pem), options)
        else:
            self._channel = grpc.insecure_channel(addr, options=options)
        self._outgoing: queue.Queue[bytes | None] = queue.Queue()
        self._incoming: queue.Queue[bytes | None] = queue.Queue()
        self.ended = ""
        self._over = threading.Event()  # the stream has ended, either way
        self._call = self._channel.stream_stream(METHOD, None, None)(
            self._requests(),
            metadata=((TOKEN_METADATA_KEY, secret), (JOB_METADATA_KEY, job_id)),
        )
        self._reader = threading.Thread(target=self._read, name="hvdrun-spark-channel")
        self._reader.daemon = True
        self._reader.start()

    def _requests(self) -> Iterator[bytes]:
        while (frame := self._outgoing.get()) is not None:
            yield frame

    def _read(self) -> None:
        try:
            for frame in self._call:
                self._incoming.put(frame)
            self.ended = "the driver ended the stream"
        except grpc.RpcError as error:
            details = error.details() if hasattr(error, "details") else str(error)
            self.ended = f"the connection to the driver broke: {details}"
        finally:
            self._over.set()
            self._incoming.put(None)

    def send(self, frame: bytes) -> None:
        self._outgoing.put(frame)

    def finish(self) -> None:
        """Half-closes: the driver sees the end of this task's frames."""
        self._outgoing.put(None)

    def receive(self, timeout: float | None = None) -> bytes | None:
        """The driver's next frame; None once the stream has ended; raises queue.Empty
        after ``timeout`` seconds without one."""
        return self._incoming.get(timeout=timeout)

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Waits until the stream has ended (the driver ended it, or the connection broke:
        a closed socket at once, a vanished host within two keepalive periods); whether it
        has."""
        return self._over.wait(timeout)

    def close(self) -> None:
        self._outgoing.put(None)
        with contextlib.suppress(Exception):
            self._call.cancel()
        self._channel.close()
        self._reader.join(5)
