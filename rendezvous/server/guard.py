"""The guard in front of every RPC: job secret and job id first, then a request that parses.

Why an interceptor: it sees the call's metadata before gRPC deserializes the request, so a
rejected call costs no parsing and changes nothing, whatever its payload. The secret is
compared in constant time and never appears in a log line or an error message. A wrong job
id is reported first: it is the more useful diagnosis (a worker of an old job reaching a new
server on the same port) and reveals nothing secret.

A rejected call is answered without its request ever being read: the refusal is a
request-streaming handler that never pulls a message, so a caller without the secret cannot
make the server hold megabytes per call (gRPC reads a unary request whole before a unary
handler runs, and an unknown caller could open thousands of such calls at once).

Each refusal is logged with the caller's address, as a warning the first time a kind of
refusal comes from that address and at debug level after that: a stale worker retrying, or
anyone knocking on the port, gets one line in the job's output, not one per call.

Requests that do not parse get INVALID_ARGUMENT from the handler wrapper here, instead of
gRPC's own UNKNOWN plus an ERROR-level traceback in the server's log.

Threads: the interceptor and its handlers run on the server's loop. Its mutable fields, the
cache of lenient handlers and the refusals already warned about, are touched there alone;
the secret and job id never change.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast
from urllib.parse import unquote

import grpc
import grpc.aio

from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY
from rendezvous.server.common import LOGGER_NAME, quote
from rendezvous.worker_env import other_round

logger = logging.getLogger(LOGGER_NAME)

#: How many (refusal, caller's host) pairs get a warning of their own; refusals beyond that
#: are logged at debug level only, so a flood from many addresses cannot flood the log.
WARNED_LIMIT = 64


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls with a wrong job id or secret before the request is deserialized, and
    turns requests that do not parse into INVALID_ARGUMENT."""

    def __init__(self, secret: str, job_id: str) -> None:
        self._secret = secret.encode("utf-8")
        self._job_id = job_id
        # method -> its lenient handler: built once, not on every call (thousands per second)
        self._lenient: dict[str, grpc.RpcMethodHandler] = {}
        # (status, caller's host) of the refusals already logged as a warning
        self._warned: set[tuple[grpc.StatusCode, str]] = set()

    def _reject_reason(
        self, metadata: Sequence[tuple[str, str | bytes]] | None
    ) -> tuple[grpc.StatusCode, str] | None:
        token: str | bytes | None = None
        job: str | bytes | None = None
        for key, value in metadata or ():
            if key == TOKEN_METADATA_KEY:
                token = value
            elif key == JOB_METADATA_KEY:
                job = value
        if isinstance(job, bytes):
            job = job.decode("utf-8", "replace")
        # A wrong job id is checked first: it is the more useful diagnosis (a worker of an old
        # job reaching a new server on the same port) and reveals nothing secret.
        if job is not None and job != self._job_id:
            if other_round(job, self._job_id):  # (its rank called hvd.init() again: soon)
                return (
                    grpc.StatusCode.UNAVAILABLE,
                    f"request for job {quote(job)} reached job {self._job_id!r}, the "
                    "hvd.init() round before, which goes once every rank has left it",
                )
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request for job {quote(job)} reached job {self._job_id!r}",
            )
        if isinstance(token, str):
            token = token.encode("utf-8")
        if token is None or not hmac.compare_digest(token, self._secret):
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                f"missing or invalid job token (metadata {TOKEN_METADATA_KEY!r})",
            )
        if job is None:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request carries no job id (metadata {JOB_METADATA_KEY!r}); "
                f"this is job {self._job_id!r}",
            )
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        reason = self._reject_reason(handler_call_details.invocation_metadata)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: gRPC answers UNIMPLEMENTED
        if reason is not None:
            code, message = reason
            method = handler_call_details.method
            return _denying_handler(
                handler, code, message, lambda peer: self._log_refusal(method, peer, code, message)
            )
        lenient = self._lenient.get(handler_call_details.method)
        if lenient is None:
            lenient = self._lenient[handler_call_details.method] = _lenient_handler(handler)
        return lenient

    def _log_refusal(self, method: str, peer: str, code: grpc.StatusCode, message: str) -> None:
        """Logs a refused call (never its token): a warning the first time this kind of
        refusal comes from the caller's host, debug after that. A caller of another round
        is expected (it tries again): never worth a warning."""
        host = peer_host(peer)
        first = (
            code != grpc.StatusCode.UNAVAILABLE
            and (code, host) not in self._warned
            and len(self._warned) < WARNED_LIMIT
        )
        caller = unquote(peer) or "an unknown peer"
        if not first:
            logger.debug("rejected %s from %s: %s", method, caller, message)
            return
        self._warned.add((code, host))
        logger.warning(
            "rejected %s from %s: %s (further such calls from %s are logged at debug level only)",
            method,
            caller,
            message,
            host or "there",
        )


def peer_host(peer: str) -> str:
    """The caller's host in a gRPC peer string (``ipv4:10.0.0.2:5123`` -> ``10.0.0.2``,
    ``ipv6:%5B::1%5D:5123`` or ``ipv6:[::1]:5123`` -> ``::1``); a Unix socket's peer is
    kept whole."""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:].partition("]")[0]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer


@dataclass(frozen=True)
class _Malformed:
    """Stands in for a request that did not parse, so the handler can answer cleanly."""

    error: str


def _lenient(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as error:  # DecodeError, bad UTF-8, ...
            return _Malformed(str(error))

    return deserialize


def _malformed_message(request: _Malformed) -> str:
    return f"malformed request: {request.error}"


def _lenient_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, but a request that does not parse gets INVALID_ARGUMENT.

    (gRPC's own answer would be UNKNOWN plus an ERROR-level traceback in the server's log.)
    """
    deserializer = _lenient(handler.request_deserializer)
    if handler.unary_unary is not None:
        # The stubs describe synchronous handlers; on an aio server they are coroutines.
        unary = cast(Callable[..., Awaitable[Any]], handler.unary_unary)

        async def unary_behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_behavior,
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        stream = cast(Callable[..., AsyncIterator[Any]], handler.unary_stream)

        async def stream_behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _malformed_message(request))
            async for item in stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(
            stream_behavior,
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler  # this service has no client-streaming methods


def _denying_handler(
    handler: grpc.RpcMethodHandler,
    code: grpc.StatusCode,
    message: str,
    log: Callable[[str], None],
) -> grpc.RpcMethodHandler:
    """A handler that only aborts, of the same response kind. It takes the request as a
    stream it never reads, so a rejected request is neither parsed nor even received whole
    (a unary handler would have gRPC buffer all of it first)."""
    if handler.response_streaming:

        async def deny_stream(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> Any:
            log(context.peer())
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator

        return grpc.stream_stream_rpc_method_handler(deny_stream)

    async def deny(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> NoReturn:
        log(context.peer())
        await context.abort(code, message)
        raise AssertionError("unreachable")  # pragma: no cover

    return grpc.stream_unary_rpc_method_handler(deny)
