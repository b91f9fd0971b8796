"""Calls the guard refuses: never read, and logged once per caller, not once per call."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import pytest

from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY
from rendezvous.server import RendezvousServer
from rendezvous.server.guard import peer_host
from rendezvous.slots import assign_slots
from tests.rendezvous.conftest import JOB_ID, SECRET

SERVICE = "/hvdrun.rendezvous.Rendezvous/"
WRONG = ((TOKEN_METADATA_KEY, "not-the-secret"), (JOB_METADATA_KEY, JOB_ID))


@pytest.fixture
def fresh_server() -> Iterator[RendezvousServer]:
    """A server of its own (the guard remembers whom it warned about): a message limit of
    about 1 MiB (2 x 4096 bytes + 1 MiB)."""
    slots = assign_slots([("host-a", 1)], 1)
    with RendezvousServer(
        slots, SECRET, JOB_ID, bind_host="127.0.0.1", max_value_bytes=4096
    ) as srv:
        yield srv


def _channel(server: RendezvousServer) -> grpc.Channel:
    return grpc.insecure_channel(
        f"127.0.0.1:{server.port}", options=[("grpc.max_send_message_length", 8 << 20)]
    )


def _unary(channel: grpc.Channel, method: str) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(SERVICE + method, None, None)  # raw bytes both ways


def test_a_refused_request_is_never_read(fresh_server: RendezvousServer) -> None:
    # Over the server's message limit: had the server read it, the answer would be
    # RESOURCE_EXHAUSTED; a refusal that reads nothing says what is wrong instead.
    big = b"\x00" * (2 << 20)
    with _channel(fresh_server) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _unary(channel, "Set")(big, metadata=WRONG, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            next(
                iter(
                    channel.unary_stream(SERVICE + "Watch", None, None)(
                        big, metadata=WRONG, timeout=10
                    )
                )
            )
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The job's own calls are read as before: the same request is too large.
        good = ((TOKEN_METADATA_KEY, SECRET), (JOB_METADATA_KEY, JOB_ID))
        with pytest.raises(grpc.RpcError) as info:
            _unary(channel, "Set")(big, metadata=good, timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_refusals_are_logged_once_per_caller(
    fresh_server: RendezvousServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="rendezvous.server")
    with _channel(fresh_server) as channel:
        call = _unary(channel, "NumKeys")
        for _ in range(20):
            with pytest.raises(grpc.RpcError):
                call(b"", metadata=WRONG, timeout=10)
        other_job = ((TOKEN_METADATA_KEY, SECRET), (JOB_METADATA_KEY, "another-job"))
        for _ in range(5):
            with pytest.raises(grpc.RpcError):
                call(b"", metadata=other_job, timeout=10)
    refusals = [r for r in caplog.records if r.getMessage().startswith("rejected ")]
    warnings = [r.getMessage() for r in refusals if r.levelno == logging.WARNING]
    assert len(refusals) == 25
    assert len(warnings) == 2, warnings  # one per kind of refusal from this caller
    assert "from ipv4:127.0.0.1:" in warnings[0]
    assert "missing or invalid job token" in warnings[0]
    assert "further such calls from 127.0.0.1 are logged at debug level only" in warnings[0]
    assert "request for job 'another-job'" in warnings[1]
    assert not [r for r in caplog.records if "not-the-secret" in r.getMessage()]


def test_peer_host() -> None:
    assert peer_host("ipv4:10.0.0.2:5123") == "10.0.0.2"
    assert peer_host("ipv6:[::1]:5123") == "::1"
    assert peer_host("ipv6:%5B::1%5D:5123") == "::1"  # (as gRPC spells it)
    assert peer_host("unix:/tmp/x.sock") == "unix:/tmp/x.sock"
    assert peer_host("") == ""
