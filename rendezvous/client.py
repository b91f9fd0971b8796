"""The worker's side of the rendezvous: a small, thread-safe, synchronous gRPC client.

Why it looks the way it does:

* Synchronous calls on one gRPC channel: a channel is thread-safe, and the callers are
  synchronous too (``hvd.init()``, and torch's C++ store code, which calls the Store adapter
  from NCCL's background threads).
* Blocking calls (``get``/``wait``/``barrier``) carry their timeout to the server and get a
  gRPC deadline a few seconds longer, so the server's DEADLINE_EXCEEDED, which names the
  missing keys, normally wins over a bare client-side deadline.
* ``wait_for_ready=False``: a dead server fails a call at once instead of hanging it.
* Every ``grpc.RpcError`` becomes a :class:`RendezvousError` subclass whose message says which
  call failed and why, in words meant for a person reading a worker's stderr.
* ``watch`` holds the server's heartbeat stream in a daemon thread. A worker whose launcher
  died must notice: a SHUTDOWN event, a closed connection (hvdrun killed, even with -9) or,
  where no TCP reset ever arrives (a cut network), silence for ``lost_after`` seconds. The
  server's own view comes first, though: before a broken stream or a silence counts as a
  lost job, the watch asks the server directly (one short call); when it answers, the
  silence was this process's (starved of CPU) or the transport's, and the watch goes on
  (re-opening the stream if it broke). Only a server that does not answer is lost.

This module must not import torch.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from rendezvous import (
    JOB_METADATA_KEY,
    TOKEN_METADATA_KEY,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
    worker_env,
)
from rendezvous.addresses import DIRECT
from rendezvous.tls import TARGET_NAME, channel_credentials

__all__ = [
    "RankInfo",
    "RendezvousAuthError",
    "RendezvousClient",
    "RendezvousError",
    "RendezvousRemoved",
    "RendezvousTimeout",
    "RendezvousUnavailable",
]

logger = logging.getLogger(__name__)

# Extra time the gRPC deadline of a blocking call gets beyond the timeout sent to the server.
_DEADLINE_SLACK = 5.0
# How long close() waits for a watch stream's threads to end.
_CLOSE_WAIT = 2.0
# Message size limits: generous, the server enforces the real value limit with a clear error.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The keys and values one MultiSet call carries at most (but for a lone large value), with
# _ITEM_BYTES for each pair's framing: within every server's message limit (twice its value
# limit and 1 MiB), whatever that value limit.
_BATCH_BYTES = 512 * 1024
_ITEM_BYTES = 16

_Response = TypeVar("_Response")


class RendezvousError(Exception):
    """A rendezvous call failed; the message says which call and why, for a human.

    ``code`` is the gRPC status code when the server (or gRPC) gave one.
    """

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def unknown_call(self) -> bool:
        """The server does not know the call: a gRPC (or other HTTP/2) server that is not
        hvdrun's rendezvous holds the address, or one of an hvdrun without that call."""
        return self.code == grpc.StatusCode.UNIMPLEMENTED


#: How the server refuses a call about an older membership generation's keys (a worker that
#: bootstraps a generation a newer one has replaced: hosts joined or left meanwhile).
SUPERSEDED = "membership generation {old} was superseded by generation {new}"
_SUPERSEDED = re.compile(SUPERSEDED.format(old=r"(\d+)", new=r"(\d+)"))


#: How the server says a blocking get of one key ran out of time (the key quoted by repr).
NOT_SET = "key {key} was not set within"
_NOT_SET = re.compile(NOT_SET.format(key="'([^']*)'"))


def unset_key(error: BaseException) -> str | None:
    """The key whose blocking get ran out of time, when ``error`` (a call's, or torch's
    around a store call's) says so; None otherwise."""
    match = _NOT_SET.search(str(error))
    return match.group(1) if match else None


def superseded(error: BaseException) -> tuple[int, int] | None:
    """(old, new) generation when ``error`` (a call's, or torch's around a store call's)
    says the call's membership generation was superseded by a newer one; None otherwise."""
    match = _SUPERSEDED.search(str(error))
    return (int(match.group(1)), int(match.group(2))) if match else None


class RendezvousTimeout(RendezvousError):
    """A blocking get/wait/barrier did not complete within its timeout."""


class RendezvousUnavailable(RendezvousError):
    """The rendezvous server cannot be reached or has gone away."""

    def not_grpc(self) -> tuple[str, bool] | None:
        """What the connection showed of the program at the address when it is not a gRPC
        server (another program holds the port): what it does, and whether that is certain
        at once (it spoke another protocol) or only once it lasts (it accepted and closed
        the connection, or said nothing: a server that is stopping or starting does that for
        a moment). None when nothing answered (refused: rank 0 does not serve yet)."""
        text = str(self)
        for sign, what, certain in _NOT_GRPC:
            if sign in text:
                return what, certain
        return None

    def tls_refusal(self) -> str | None:
        """How the TLS handshake failed, when this client speaks TLS and that is why it
        could not connect: the server's certificate is not one this client trusts (a job
        certificate or secret of another job), or the server speaks no TLS. None otherwise."""
        text = str(self)
        if "Tls handshake failed" not in text:
            return None
        if "WRONG_VERSION_NUMBER" in text:
            return "the program there speaks no TLS"
        return "its TLS certificate is not one this rank trusts"


#: What gRPC's connect errors say of a listener that is not a gRPC server, what that means,
#: and whether it is certain at once.
_NOT_GRPC = (
    ("http1.x server", "answers in HTTP/1", True),  # (first: gRPC says both of HTTP/1)
    ("Failed parsing HTTP/2", "answers in another protocol", True),
    ("Socket closed", "accepts connections and closes them", False),
    ("before receiving SETTINGS frame", "accepts connections but answers nothing", False),
)


class RendezvousRemoved(RendezvousError):
    """Elastic jobs: the newest membership generation no longer contains this worker's slot."""


class RendezvousAuthError(RendezvousError):
    """The server rejected the job secret (UNAUTHENTICATED) or the job id (FAILED_PRECONDITION)."""

    @property
    def refused_secret(self) -> bool:
        """The server refused the secret this client sent (not the job id)."""
        return self.code == grpc.StatusCode.UNAUTHENTICATED


@dataclass(frozen=True)
class RankInfo:
    """A worker's place in the job, as the server's slot table says."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    generation: int


# Longest wait one call asks for (30 days): "forever" in practice, and a finite gRPC deadline.
_MAX_TIMEOUT = 30 * 24 * 3600.0


def _to_ms(timeout: float) -> int:
    """Milliseconds for the server: negatives become 0, NaN/inf/huge become _MAX_TIMEOUT."""
    if not timeout <= _MAX_TIMEOUT:  # also catches NaN
        timeout = _MAX_TIMEOUT
    return max(0, round(timeout * 1000))


def _batches(keys: list[str], values: list[bytes]) -> Iterator[Any]:
    """The MultiSet requests of ``keys`` and ``values``: consecutive batches of about
    ``_BATCH_BYTES`` (a larger value alone), within any server's message limit (one
    request when there is nothing to set)."""
    start, size = 0, 0
    for end, (key, value) in enumerate(zip(keys, values, strict=True)):
        item = len(key) + len(value) + _ITEM_BYTES
        size += item
        if size > _BATCH_BYTES and end > start:
            yield rendezvous_pb2.MultiSetRequest(keys=keys[start:end], values=values[start:end])
            start, size = end, item
    if start < len(keys) or not keys:
        yield rendezvous_pb2.MultiSetRequest(keys=keys[start:], values=values[start:])


class _Watch:
    """One Watch stream: a reader thread and a watchdog thread sharing a report-once flag."""

    def __init__(
        self,
        client: RendezvousClient,
        ranks: Sequence[int],
        on_lost: Callable[[str], None],
        lost_after: float,
        on_generation: Callable[[int], None] | None = None,
        *,
        per_host: bool = False,
        on_roll_call: Callable[[int], None] | None = None,
    ) -> None:
        self._client = client
        self._ranks = list(ranks)
        self._per_host = per_host
        rank = self._ranks[0] if len(self._ranks) == 1 else f"{self._ranks[0]}+"
        self._on_lost = on_lost
        self._on_generation = on_generation
        self._on_roll_call = on_roll_call
        self._answered = 0  # the latest roll call on_roll_call heard
        self._lost_after = lost_after
        self._lock = threading.Lock()
        self._done = False  # on_lost was called, or the watch was closed
        self._finished = threading.Event()
        self._call: Any = None  # the streaming call, for cancel()
        self._last_event = time.monotonic()
        self._reader = threading.Thread(
            target=self._read, name=f"hvdrun-rendezvous-watch-{rank}", daemon=True
        )
        self._watchdog = threading.Thread(
            target=self._guard, name=f"hvdrun-rendezvous-watchdog-{rank}", daemon=True
        )

    def start(self) -> None:
        self._reader.start()
        self._watchdog.start()

    def close(self, wait: float = 0.0) -> None:
        """Stops watching without calling on_lost; waits up to ``wait`` seconds for the
        stream's threads to end."""
        with self._lock:
            self._done = True
            call = self._call
        self._finished.set()
        if call is not None:
            call.cancel()
        deadline = time.monotonic() + wait
        for thread in (self._reader, self._watchdog):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0))

    def _report(self, reason: str) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            call = self._call
        self._finished.set()
        if call is not None:
            call.cancel()
        logger.info("lost the rendezvous server (rank(s) %s): %s", self._ranks, reason)
        try:
            self._on_lost(reason)
        except Exception:
            logger.exception("on_lost callback raised")

    def _alive(self) -> bool:
        """The server's own answer: whether it replies to a call now."""
        try:
            self._client.probe(min(PROBE_SECONDS, self._lost_after))
        except RendezvousError as error:
            logger.debug("the rendezvous server does not answer: %s", error)
            return False
        return True

    def _read(self) -> None:
        while not self._finished.is_set():
            reason = self._stream()
            if reason is None:
                return
            silent = time.monotonic() - self._last_event
            if silent <= self._lost_after and self._alive():
                logger.warning("the rendezvous watch stream broke (%s); the server answers: "
                               "watching again", reason)  # fmt: skip
                self._finished.wait(REOPEN_SECONDS)
                continue
            self._report(reason)
            return

    def _stream(self) -> str | None:
        """Holds one Watch stream until it ends; returns why it broke (None: the watch is
        over: reported, or closed)."""
        try:
            stub = self._client._stub
            if self._per_host:
                call = stub.WatchHost(
                    rendezvous_pb2.WatchHostRequest(ranks=self._ranks),
                    metadata=self._client._metadata,
                    wait_for_ready=False,
                )
            else:
                call = stub.Watch(
                    rendezvous_pb2.WatchRequest(rank=self._ranks[0]),
                    metadata=self._client._metadata,
                    wait_for_ready=False,
                )
            with self._lock:
                if self._done:
                    call.cancel()
                    return None
                self._call = call
            events: Iterator[rendezvous_pb2.WatchEvent] = call
            for event in events:
                self._last_event = time.monotonic()
                if self._on_generation is not None and event.generation > 0:
                    self._on_generation(event.generation)
                if self._on_roll_call is not None and event.roll_call > self._answered:
                    self._answered = event.roll_call
                    self._on_roll_call(event.roll_call)
                if event.kind == rendezvous_pb2.WatchEvent.SHUTDOWN:
                    detail = event.message or "no reason given"
                    lost = detail.startswith(RELAY_LOST)  # (its host's relay's, not the job's)
                    self._report(
                        detail if lost else f"the rendezvous server shut down the job: {detail}"
                    )
                    return None
            return "the rendezvous server closed the watch stream"
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and self._finished.is_set():
                return None  # our own cancel()
            if error.code() not in TRANSIENT_CODES:  # refused: asking again cannot help
                self._report(str(self._client._convert("watch", error)))
                return None
            return str(self._client._convert("watch", error))
        except Exception as error:  # a bug must still end in a report, not a silent thread
            self._report(f"watch stream failed: {error!r}")
            return None

    def _guard(self) -> None:
        poll = min(0.25, self._lost_after / 4)
        while not self._finished.wait(poll):
            silent = time.monotonic() - self._last_event
            if silent <= self._lost_after:
                continue
            if self._alive():  # this process was starved, or the stream is slow: go on
                logger.warning(
                    "no heartbeat from the rendezvous server for %.1f s, but it answers; going on",
                    silent,
                )
                self._last_event = time.monotonic()
                continue
            self._report(
                f"no heartbeat from the rendezvous server at {self._client.addr} "
                f"for {silent:.1f} s, and it does not answer (lost_after="
                f"{self._lost_after:g} s)"
            )
            return


#: How long a watch's question to the server may take before the server counts as lost.
PROBE_SECONDS = 5.0
#: A broken watch stream of a server that still answers is opened again after this long.
REOPEN_SECONDS = 1.0
#: How a host's relay ends its workers' streams when it lost the server (SHUTDOWN's message
#: starts so): the server did not shut the job down, its host lost it.
RELAY_LOST = "the host's rendezvous relay lost the server"
#: Stream errors after which the server may still be there (the transport broke).
TRANSIENT_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
)


class RendezvousClient:
    """Synchronous client of a job's rendezvous server; safe to share between threads."""

    def __init__(
        self,
        addr: str,
        secret: str,
        job_id: str,
        *,
        rpc_timeout: float = 30.0,
        cert_pem: bytes | str | None = None,
    ) -> None:
        """``cert_pem``: the job's certificate (``HVDRUN_RENDEZVOUS_CERT``); when given, the
        client speaks TLS and trusts that certificate alone."""
        self.addr = addr
        self._rpc_timeout = rpc_timeout
        self._metadata: tuple[tuple[str, str], ...] = (
            (TOKEN_METADATA_KEY, secret),
            (JOB_METADATA_KEY, job_id),
        )
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            # Ping during long blocking calls so a cut network fails them.
            ("grpc.keepalive_time_ms", 30_000),
            # (generous: a briefly stopped or overloaded hvdrun is not a cut network)
            ("grpc.keepalive_timeout_ms", 20_000),
            # Its own connection: a client's calls never queue behind another client's.
            ("grpc.use_local_subchannel_pool", 1),
            # Reconnect soon after a refused connection: under another launcher the
            # ranks dial while rank 0 may still be starting its server, and gRPC's
            # default first backoff (1 s) would be most of a job's start-up.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            DIRECT,
        ]
        if cert_pem:
            # The certificate names TARGET_NAME, whatever address the worker dials.
            options.append(("grpc.ssl_target_name_override", TARGET_NAME))
            self._channel = grpc.secure_channel(addr, channel_credentials(cert_pem), options)
        else:
            self._channel = grpc.insecure_channel(addr, options=options)
        self._stub = rendezvous_pb2_grpc.RendezvousStub(self._channel)
        self._watches: list[_Watch] = []
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:  # never shows the secret
        return f"RendezvousClient(addr={self.addr!r})"

    @classmethod
    def from_environment(
        cls, env: Mapping[str, str] | None = None, *, rpc_timeout: float = 30.0
    ) -> RendezvousClient:
        """The client of a worker that hvdrun started: through its host's relay where there
        is one (``HVDRUN_RENDEZVOUS_RELAY_ADDR``), else to the server itself, over TLS with
        the job's certificate where it speaks TLS (``HVDRUN_RENDEZVOUS_CERT``)."""
        env = os.environ if env is None else env
        secret = env.get(worker_env.SECRET, "")
        job_id = env.get(worker_env.JOB_ID, "")
        relay = env.get(worker_env.RENDEZVOUS_RELAY_ADDR)
        if relay:  # a private local socket: no TLS on this leg
            return cls(relay, secret, job_id, rpc_timeout=rpc_timeout)
        return cls(
            env[worker_env.RENDEZVOUS_ADDR],
            secret,
            job_id,
            rpc_timeout=rpc_timeout,
            cert_pem=env.get(worker_env.RENDEZVOUS_CERT) or None,
        )

    # ---- plumbing -------------------------------------------------------------------

    def _convert(self, call: str, error: grpc.RpcError) -> RendezvousError:
        """A readable RendezvousError for a failed call (no gRPC debug strings)."""
        code: grpc.StatusCode | None = None
        details = ""
        if isinstance(error, grpc.Call):
            code = error.code()
            details = error.details() or ""
        prefix = f"rendezvous {call} at {self.addr} failed"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if details and details != "Deadline Exceeded":
                return RendezvousTimeout(f"{prefix}: {details}", code)
            return RendezvousTimeout(f"{prefix}: the server did not answer in time", code)
        if code == grpc.StatusCode.UNAVAILABLE:
            reason = details.splitlines()[0] if details else "unreachable"
            return RendezvousUnavailable(
                f"{prefix}: the rendezvous server is unavailable ({reason})", code
            )
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION):
            return RendezvousAuthError(f"{prefix}: {details}", code)
        if code == grpc.StatusCode.CANCELLED:
            return RendezvousUnavailable(f"{prefix}: the call was cancelled ({details})", code)
        name = code.name if code is not None else "unknown error"
        return RendezvousError(f"{prefix}: {name}: {details}", code)

    def _call(
        self,
        name: str,
        method: Callable[..., _Response],
        request: Any,
        timeout: float | None = None,
    ) -> _Response:
        if self._closed:
            raise RendezvousError(f"rendezvous {name}: the client is closed")
        try:
            return method(
                request,
                timeout=self._rpc_timeout if timeout is None else timeout,
                metadata=self._metadata,
                wait_for_ready=False,
            )
        except grpc.RpcError as error:
            raise self._convert(name, error) from None
        except ValueError as error:  # e.g. a closed channel
            raise RendezvousError(f"rendezvous {name} at {self.addr} failed: {error}") from None

    # ---- API --------------------------------------------------------------------------

    def register(
        self,
        host: str,
        local_rank: int,
        min_generation: int = 0,
        timeout: float = 0.0,
        *,
        rank: int | None = None,
        size: int | None = None,
        deadline: float | None = None,
        process: str = "",
    ) -> RankInfo:
        """Announces this worker's slot and returns its place in the job.

        Elastic jobs: waits up to ``timeout`` seconds for membership generation
        ``min_generation`` (or a newer one) and returns the slot's place in the newest;
        raises :class:`RendezvousRemoved` when that generation does not contain the slot.
        Workers another launcher started pass the ``rank`` and job ``size`` it gave them
        (and its local rank, or -1) and who they are (``process``): the call waits up to
        ``timeout`` s for every rank, and fails on every rank if one's size differs.
        ``deadline``: how long the call may go unanswered (default: ``timeout`` and a
        margin, at least ``rpc_timeout``), shorter for a caller that asks again.
        """
        request = rendezvous_pb2.RegisterRequest(
            host=host, local_rank=local_rank, min_generation=min_generation,
            timeout_ms=_to_ms(timeout), rank=rank, size=size, process=process,
        )  # fmt: skip
        what = f"rank={rank}, host={host!r}" if rank is not None else f"host={host!r}"
        info = self._register_call(
            f"register({what}, local_rank={local_rank})", self._stub.Register, request, deadline
        )
        return _rank_info(info)

    def register_host(
        self,
        host: str,
        local_ranks: Sequence[int],
        min_generation: int = 0,
        timeout: float = 0.0,
    ) -> list[RankInfo]:
        """:meth:`register` for several local ranks of one host in one call (what a host's
        agent sends for its workers); the places come back in the order asked."""
        request = rendezvous_pb2.RegisterHostRequest(
            host=host, local_ranks=list(local_ranks), min_generation=min_generation,
            timeout_ms=_to_ms(timeout),
        )  # fmt: skip
        response = self._register_call(
            f"register_host(host={host!r}, {len(request.local_ranks)} local ranks)",
            self._stub.RegisterHost,
            request,
        )
        return [_rank_info(info) for info in response.ranks]

    def _register_call(
        self,
        name: str,
        method: Callable[..., _Response],
        request: Any,
        deadline: float | None = None,
    ) -> Any:
        """A Register or RegisterHost call, which may block up to the request's own timeout;
        NOT_FOUND for a later generation means the host was removed from the job."""
        longest = max(request.timeout_ms / 1000 + _DEADLINE_SLACK, self._rpc_timeout)
        try:
            return self._call(name, method, request, timeout=deadline or longest)
        except RendezvousError as error:
            if request.min_generation > 0 and error.code == grpc.StatusCode.NOT_FOUND:
                raise RendezvousRemoved(str(error), error.code) from None
            raise

    def multi_get(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        """The keys' values, waiting up to ``timeout`` seconds for all of them: one call, or,
        where the values together pass the server's message limit (each within its value
        limit), the keys in halves, each half asked again."""
        keys = list(keys)
        deadline = time.monotonic() + min(timeout, _MAX_TIMEOUT)
        timeout_ms = _to_ms(timeout)
        try:
            response = self._call(
                f"multi_get({keys!r})" if len(keys) <= 5 else f"multi_get({len(keys)} keys)",
                self._stub.MultiGet,
                rendezvous_pb2.MultiGetRequest(keys=keys, timeout_ms=timeout_ms),
                timeout=timeout_ms / 1000 + _DEADLINE_SLACK,
            )
        except RendezvousError as error:
            if error.code != grpc.StatusCode.RESOURCE_EXHAUSTED or len(keys) < 2:
                raise
            half = len(keys) // 2
            first = self.multi_get(keys[:half], deadline - time.monotonic())
            return first + self.multi_get(keys[half:], deadline - time.monotonic())
        return list(response.values)

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        """Sets every key: one call per batch (see :func:`_batches`), stored in order, each
        at once; a refused value leaves the batches before it stored."""
        keys = list(keys)
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        for part in _batches(keys, list(values)):
            self._call(f"multi_set({len(part.keys)} keys)", self._stub.MultiSet, part)

    def set(self, key: str, value: bytes) -> None:
        self._call(f"set({key!r})", self._stub.Set, rendezvous_pb2.SetRequest(key=key, value=value))

    def get(self, key: str, timeout: float) -> bytes:
        """The key's value, waiting up to ``timeout`` seconds for it to be set.

        ``timeout <= 0`` does not wait. Raises :class:`RendezvousTimeout` when the key stays
        absent.
        """
        timeout_ms = _to_ms(timeout)
        try:
            response = self._call(
                f"get({key!r})",
                self._stub.Get,
                rendezvous_pb2.GetRequest(key=key, timeout_ms=timeout_ms),
                timeout=timeout_ms / 1000 + _DEADLINE_SLACK,
            )
        except RendezvousError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:  # timeout 0 and absent
                raise RendezvousTimeout(str(error), error.code) from None
            raise
        return response.value

    def get_ahead(self, key: str, timeout: float, read_ahead: int) -> tuple[bytes, list[bytes]]:
        """Like :meth:`get`, and also the values of the key's numbered siblings after it that
        are set now (``p/3`` -> ``p/4``, ``p/5``, ... up to the first absent one, at most
        ``read_ahead``; the server may return fewer, and an older server none)."""
        timeout_ms = _to_ms(timeout)
        try:
            response = self._call(
                f"get({key!r})",
                self._stub.Get,
                rendezvous_pb2.GetRequest(key=key, timeout_ms=timeout_ms, read_ahead=read_ahead),
                timeout=timeout_ms / 1000 + _DEADLINE_SLACK,
            )
        except RendezvousError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:  # timeout 0 and absent
                raise RendezvousTimeout(str(error), error.code) from None
            raise
        return response.value, list(response.ahead)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Waits up to ``timeout`` seconds until every key is set."""
        keys = list(keys)
        timeout_ms = _to_ms(timeout)
        self._call(
            f"wait({keys!r})" if len(keys) <= 5 else f"wait({len(keys)} keys)",
            self._stub.Wait,
            rendezvous_pb2.WaitRequest(keys=keys, timeout_ms=timeout_ms),
            timeout=timeout_ms / 1000 + _DEADLINE_SLACK,
        )

    def add(self, key: str, amount: int) -> int:
        """Adds to a decimal counter (missing counts as 0); returns the new value."""
        response = self._call(
            f"add({key!r})", self._stub.Add, rendezvous_pb2.AddRequest(key=key, amount=amount)
        )
        return response.value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """TCPStore's compare-and-set: returns the value after the call.

        Missing key: set to ``desired`` if ``expected`` is empty, else returns ``expected``.
        Present key: set to ``desired`` if it equals ``expected``, else returns its value.
        """
        response = self._call(
            f"compare_set({key!r})",
            self._stub.CompareSet,
            rendezvous_pb2.CompareSetRequest(key=key, expected=expected, desired=desired),
        )
        return response.value

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set, without waiting."""
        response = self._call(
            "check", self._stub.Check, rendezvous_pb2.CheckRequest(keys=list(keys))
        )
        return response.ready

    def delete(self, key: str) -> bool:
        """Deletes the key; returns whether it existed."""
        response = self._call(
            f"delete({key!r})", self._stub.Delete, rendezvous_pb2.DeleteRequest(key=key)
        )
        return response.deleted

    def probe(self, timeout: float) -> None:
        """One short call that the server answers at once: raises when it does not."""
        self._call("probe", self._stub.NumKeys, rendezvous_pb2.Empty(), timeout=timeout)

    def num_keys(self) -> int:
        """Number of keys in the whole store (all prefixes)."""
        response = self._call("num_keys", self._stub.NumKeys, rendezvous_pb2.Empty())
        return response.count

    def barrier(self, name: str, participants: int, timeout: float) -> None:
        """Returns once ``participants`` callers have arrived under ``name``."""
        timeout_ms = _to_ms(timeout)
        self._call(
            f"barrier({name!r})",
            self._stub.Barrier,
            rendezvous_pb2.BarrierRequest(
                name=name, participants=participants, timeout_ms=timeout_ms
            ),
            timeout=timeout_ms / 1000 + _DEADLINE_SLACK,
        )

    def watch(
        self,
        rank: int,
        on_lost: Callable[[str], None],
        *,
        lost_after: float = 5.0,
        on_generation: Callable[[int], None] | None = None,
        on_roll_call: Callable[[int], None] | None = None,
    ) -> None:
        """Holds the server's heartbeat stream in a daemon thread.

        Calls ``on_lost(reason)`` exactly once, from that thread, when the stream fails, the
        server sends SHUTDOWN, or no event arrives for ``lost_after`` seconds. Never called
        after :meth:`close`. ``on_generation(n)`` hears the newest membership generation
        with every event of an elastic job, ``on_roll_call(n)`` each new roll call once.
        """
        if lost_after <= 0:
            raise ValueError(f"lost_after must be positive, got {lost_after}")
        with self._lock:
            if self._closed:
                raise RendezvousError("rendezvous watch: the client is closed")
            watch = _Watch(
                self, [rank], on_lost, lost_after, on_generation, on_roll_call=on_roll_call
            )
            self._watches.append(watch)
        watch.start()

    def watch_host(
        self,
        ranks: Sequence[int],
        on_lost: Callable[[str], None],
        *,
        lost_after: float = 5.0,
        on_generation: Callable[[int], None] | None = None,
    ) -> None:
        """:meth:`watch` for several ranks (one host's) on one stream: the server counts
        each of them as watching while it is open."""
        if lost_after <= 0:
            raise ValueError(f"lost_after must be positive, got {lost_after}")
        if not ranks:
            raise ValueError("watch_host needs at least one rank")
        with self._lock:
            if self._closed:
                raise RendezvousError("rendezvous watch: the client is closed")
            watch = _Watch(self, ranks, on_lost, lost_after, on_generation, per_host=True)
            self._watches.append(watch)
        watch.start()

    def close(self) -> None:
        """Stops every watch (without calling on_lost) and closes the channel. Idempotent.

        Waits (briefly) for the watch threads to leave gRPC: a process that exits while one
        of its threads is still inside a call can abort in gRPC's teardown."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches, self._watches = self._watches, []
        for watch in watches:
            watch.close(wait=_CLOSE_WAIT)
        self._channel.close()

    def __enter__(self) -> RendezvousClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _rank_info(info: Any) -> RankInfo:
    """A RankInfo message (of Register or RegisterHost) as the client's dataclass."""
    return RankInfo(
        rank=info.rank,
        size=info.size,
        local_rank=info.local_rank,
        local_size=info.local_size,
        cross_rank=info.cross_rank,
        cross_size=info.cross_size,
        generation=info.generation,
    )
