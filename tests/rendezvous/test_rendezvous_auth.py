"""Authentication, job-id checks and malformed requests: errors, no state change, still serving."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import grpc
import pytest

from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY, rendezvous_pb2, rendezvous_pb2_grpc
from rendezvous.client import RendezvousAuthError, RendezvousClient, RendezvousError
from rendezvous.server import RendezvousServer

ClientFactory = Callable[..., RendezvousClient]
Metadata = tuple[tuple[str, str], ...]


@pytest.fixture
def stub(server: RendezvousServer) -> Iterator[rendezvous_pb2_grpc.RendezvousStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield rendezvous_pb2_grpc.RendezvousStub(channel)
    channel.close()


def _assert_serving(good: RendezvousClient) -> None:
    good.set("auth/alive", b"yes")
    assert good.get("auth/alive", timeout=0) == b"yes"


def test_wrong_secret_is_rejected_without_state_change(
    server: RendezvousServer,
    make_client: ClientFactory,
    secret: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    good = make_client(server)
    bad = make_client(server, secret="not-the-secret")
    good.set("auth/existing", b"original")
    keys_before = good.num_keys()
    registered_before = server.registered_count()

    calls: list[tuple[str, Callable[[], object]]] = [
        ("set", lambda: bad.set("auth/new", b"x")),
        ("overwrite", lambda: bad.set("auth/existing", b"evil")),
        ("add", lambda: bad.add("auth/counter", 1)),
        ("compare_set", lambda: bad.compare_set("auth/existing", b"original", b"evil")),
        ("delete", lambda: bad.delete("auth/existing")),
        ("register", lambda: bad.register("host-a", 0)),
        ("get", lambda: bad.get("auth/existing", timeout=0)),
        ("wait", lambda: bad.wait(["auth/existing"], timeout=1)),
        ("check", lambda: bad.check(["auth/existing"])),
        ("num_keys", lambda: bad.num_keys()),
        ("barrier", lambda: bad.barrier("auth/barrier", 1, timeout=1)),
    ]
    for name, call in calls:
        with pytest.raises(RendezvousAuthError) as info:
            call()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED, name
        assert "token" in str(info.value), name

    assert good.get("auth/existing", timeout=0) == b"original"
    assert not good.check(["auth/new"]) and not good.check(["auth/counter"])
    assert good.num_keys() == keys_before
    assert server.registered_count() == registered_before
    # a barrier of one released at once: the rejected caller never arrived
    good.barrier("auth/barrier", 1, timeout=1)

    # the secret appears in no error message and no log line
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert secret not in text and "not-the-secret" not in text
    assert secret not in repr(good)


def test_missing_metadata_is_unauthenticated(
    server: RendezvousServer,
    stub: rendezvous_pb2_grpc.RendezvousStub,
    client: RendezvousClient,
    job_id: str,
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Set(rendezvous_pb2.SetRequest(key="auth/raw", value=b"x"), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # right job, no token
    with pytest.raises(grpc.RpcError) as info:
        stub.Add(
            rendezvous_pb2.AddRequest(key="auth/raw", amount=1),
            metadata=((JOB_METADATA_KEY, job_id),),
            timeout=5,
        )
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # the streaming call too
    with pytest.raises(grpc.RpcError) as info:
        next(iter(stub.Watch(rendezvous_pb2.WatchRequest(rank=0), timeout=5)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not client.check(["auth/raw"])
    _assert_serving(client)


def test_token_without_job_id_is_rejected(
    stub: rendezvous_pb2_grpc.RendezvousStub, client: RendezvousClient, secret: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub.Set(
            rendezvous_pb2.SetRequest(key="auth/nojob", value=b"x"),
            metadata=((TOKEN_METADATA_KEY, secret),),
            timeout=5,
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not client.check(["auth/nojob"])


def test_wrong_job_is_failed_precondition(
    server: RendezvousServer, make_client: ClientFactory, client: RendezvousClient, job_id: str
) -> None:
    other = make_client(server, job_id="job-other")
    with pytest.raises(RendezvousAuthError) as info:
        other.set("auth/other-job", b"x")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"request for job 'job-other' reached job '{job_id}'" in str(info.value)
    # with a wrong secret as well, the job mismatch is what gets reported
    stranger = make_client(server, secret="old-secret", job_id="job-old")
    with pytest.raises(RendezvousAuthError, match="job-old"):
        stranger.register("host-a", 0)
    assert not client.check(["auth/other-job"])
    _assert_serving(client)


def test_watch_with_bad_credentials_reports_lost(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    bad = make_client(server, secret="nope")
    lost = threading.Event()
    reasons: list[str] = []

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    bad.watch(0, on_lost, lost_after=10)
    assert lost.wait(5)
    assert "token" in reasons[0]
    assert 0 not in server.watching_ranks()


def test_malformed_requests_get_error_status(
    server: RendezvousServer,
    stub: rendezvous_pb2_grpc.RendezvousStub,
    client: RendezvousClient,
    metadata: Metadata,
) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        # bytes that do not parse as the request message
        raw_set = channel.unary_unary("/hvdrun.rendezvous.Rendezvous/Set")
        with pytest.raises(grpc.RpcError) as info:
            raw_set(b"\x0a\xff\xff\xff\xff\x0f", metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in (info.value.details() or "")
        # invalid UTF-8 in a string field
        with pytest.raises(grpc.RpcError) as info:
            raw_set(b"\x0a\x02\xff\xfe", metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the streaming call too
        raw_watch = channel.unary_stream("/hvdrun.rendezvous.Rendezvous/Watch")
        with pytest.raises(grpc.RpcError) as info:
            next(iter(raw_watch(b"\x08", metadata=metadata, timeout=5)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # a method that does not exist
        raw_missing = channel.unary_unary("/hvdrun.rendezvous.Rendezvous/Nope")
        with pytest.raises(grpc.RpcError) as info:
            raw_missing(b"", metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
    _assert_serving(client)

    # negative timeouts
    with pytest.raises(grpc.RpcError) as info:
        stub.Get(rendezvous_pb2.GetRequest(key="k", timeout_ms=-1), metadata=metadata, timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as info:
        stub.Barrier(
            rendezvous_pb2.BarrierRequest(name="b", participants=2, timeout_ms=-5),
            metadata=metadata,
            timeout=5,
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # an add that overflows 64 bits
    client.set("auth/big", str(2**63 - 1).encode())
    with pytest.raises(RendezvousError) as err:
        client.add("auth/big", 1)
    assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
    _assert_serving(client)


def test_oversized_value_is_invalid_argument(client: RendezvousClient) -> None:
    # the fixture server allows 4096-byte values
    client.set("auth/limit", b"x" * 4096)
    for call in (
        lambda: client.set("auth/too-big", b"x" * 4097),
        lambda: client.set("auth/too-big", b"x" * 9000),
        lambda: client.compare_set("auth/too-big", b"", b"x" * 5000),
    ):
        with pytest.raises(RendezvousError) as info:
            call()
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "limit of 4096 bytes" in str(info.value)
        assert "'auth/too-big'" in str(info.value)
    assert not client.check(["auth/too-big"])
    # far beyond the message limit: rejected by gRPC itself, the server keeps going
    with pytest.raises(RendezvousError):
        client.set("auth/too-big", b"x" * (1 << 20))
    _assert_serving(client)


def test_watch_with_bad_rank(
    server: RendezvousServer,
    stub: rendezvous_pb2_grpc.RendezvousStub,
    client: RendezvousClient,
    metadata: Metadata,
) -> None:
    for rank in (-1, 4, 1000):
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stub.Watch(rendezvous_pb2.WatchRequest(rank=rank), metadata=metadata)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"rank {rank}" in (info.value.details() or "")

    lost = threading.Event()
    reasons: list[str] = []
    client.watch(7, lambda reason: (reasons.append(reason), lost.set()), lost_after=10)
    assert lost.wait(5)
    assert "rank 7" in reasons[0] and "[0, 4)" in reasons[0]
    assert server.watching_ranks() == set()
    _assert_serving(client)


def test_grpc_trace_gets_the_header_tracers_off_once_and_a_late_guard_says_so() -> None:
    # gRPC reads GRPC_TRACE at its import: the guard amends it before (without loading gRPC
    # itself), once however often a process and its children import it; where gRPC was
    # loaded first it cannot act, and says so.
    env = {**os.environ, "GRPC_TRACE": "http"}
    show = (
        "import os, sys, rendezvous; print(os.environ['GRPC_TRACE'], 'grpc' in sys.modules); "
        "os.execv(sys.executable, [sys.executable, '-c', "
        "'import os, rendezvous; print(os.environ[\"GRPC_TRACE\"])'])"
    )

    def python(code: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", code]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    guarded = python(show)
    amended = "http,-api,-chttp2_hpack_parser,-secure_endpoint"
    assert guarded.stdout == f"{amended} False\n{amended}\n", guarded.stderr
    late = python("import grpc, rendezvous")
    assert (
        "GRPC_TRACE is set and gRPC was imported before hvdrun's rendezvous: its api, "
        "chttp2_hpack_parser and secure_endpoint tracers, where on, print the job's token"
        in late.stderr
    ), late.stderr
