"""Hostile input: the server keeps serving the real job and answers each with a clear status.

Malformed protobufs on every method, oversized values and messages, a wrong secret (plain
and over TLS), a client replaying a superseded generation, and a flood of connections.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest

from rendezvous import rendezvous_pb2, rendezvous_pb2_grpc
from rendezvous.client import RendezvousAuthError, RendezvousClient, RendezvousError
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots
from rendezvous.tls import make_job_certificate
from tests.rendezvous.conftest import JOB_ID, SECRET, ClientFactory

Metadata = tuple[tuple[str, str], ...]
SERVICE = "/hvdrun.rendezvous.Rendezvous/"
# Bytes that parse as no request message (a length-delimited field running past the end).
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"


def _assert_serving(client: RendezvousClient) -> None:
    client.set("hostile/alive", b"yes")
    assert client.get("hostile/alive", timeout=5) == b"yes"


def test_malformed_protobufs_on_every_method(
    server: RendezvousServer, client: RendezvousClient, metadata: Metadata
) -> None:
    service = rendezvous_pb2.DESCRIPTOR.services_by_name["Rendezvous"]
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        for method in service.methods:
            if method.output_type.name == "Empty" and method.input_type.name == "Empty":
                continue  # NumKeys: an empty request has nothing to be malformed
            path = SERVICE + method.name
            if method.server_streaming:
                call = channel.unary_stream(path)
                with pytest.raises(grpc.RpcError) as info:
                    next(iter(call(GARBAGE, metadata=metadata, timeout=5)))
            else:
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(path)(GARBAGE, metadata=metadata, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method.name
            assert "malformed request" in (info.value.details() or ""), method.name
    finally:
        channel.close()
    _assert_serving(client)


def test_bad_per_host_and_batched_requests(
    server: RendezvousServer, client: RendezvousClient, metadata: Metadata
) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterHost(
                rendezvous_pb2.RegisterHostRequest(host="host-a", local_ranks=[0, 0]),
                metadata=metadata,
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "listed twice" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterHost(
                rendezvous_pb2.RegisterHostRequest(host="nowhere", local_ranks=[0]),
                metadata=metadata,
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        for ranks in ([], [0, 99], [-1]):
            with pytest.raises(grpc.RpcError) as info:
                next(
                    iter(
                        stub.WatchHost(
                            rendezvous_pb2.WatchHostRequest(ranks=ranks),
                            metadata=metadata,
                            timeout=5,
                        )
                    )
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ranks
        with pytest.raises(grpc.RpcError) as info:
            stub.MultiSet(
                rendezvous_pb2.MultiSetRequest(keys=["a", "b"], values=[b"1"]),
                metadata=metadata,
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            stub.MultiGet(
                rendezvous_pb2.MultiGetRequest(keys=["hostile/never"], timeout_ms=-1),
                metadata=metadata,
                timeout=5,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
    _assert_serving(client)


def test_oversized_values_and_messages(
    server: RendezvousServer, client: RendezvousClient, make_client: ClientFactory
) -> None:
    # The module's server allows 4096-byte values.
    with pytest.raises(RendezvousError) as err:
        client.multi_set(["hostile/ok", "hostile/big"], [b"x", b"y" * 5000])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than the limit of 4096 bytes" in str(err.value)
    assert not client.check(["hostile/ok"])  # nothing of a refused batch was set
    with pytest.raises(RendezvousError) as err:
        client.compare_set("hostile/cas", b"", b"z" * 5000)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # Far past the transport's message limit (2 x value limit + 1 MiB): gRPC itself refuses.
    with pytest.raises(RendezvousError) as err:
        client.set("hostile/huge", b"h" * (3 * 1024 * 1024))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A huge list of keys is answered too (nothing to wait for: timeout 0 semantics of check).
    assert client.check([f"hostile/k{i}" for i in range(20_000)]) is False
    _assert_serving(make_client(server))


def test_wrong_secret_on_the_new_calls_changes_nothing(
    server: RendezvousServer, client: RendezvousClient, make_client: ClientFactory
) -> None:
    bad = make_client(server, secret="guessed")
    with pytest.raises(RendezvousAuthError) as err:
        bad.multi_set(["hostile/forged"], [b"evil"])
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "guessed" not in str(err.value)
    with pytest.raises(RendezvousAuthError):
        bad.register_host("host-a", [0, 1])
    with pytest.raises(RendezvousAuthError):
        bad.multi_get(["hostile/alive"], timeout=1)
    assert not client.check(["hostile/forged"])
    _assert_serving(client)


@pytest.fixture
def tls_server() -> Iterator[RendezvousServer]:
    slots = assign_slots([("host-a", 2)], 2)
    with RendezvousServer(
        slots, SECRET, JOB_ID, bind_host="127.0.0.1", tls=make_job_certificate(JOB_ID)
    ) as srv:
        yield srv


def test_wrong_secret_over_tls(tls_server: RendezvousServer) -> None:
    tls = tls_server._tls  # the certificate it serves
    assert tls is not None
    addr = f"127.0.0.1:{tls_server.port}"
    with RendezvousClient(addr, "guessed", JOB_ID, cert_pem=tls.cert_pem) as bad:
        with pytest.raises(RendezvousAuthError) as err:
            bad.register("host-a", 0)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    with RendezvousClient(addr, SECRET, JOB_ID, cert_pem=tls.cert_pem) as good:
        assert good.register("host-a", 0).rank == 0


def test_replayed_old_generation_is_aborted(make_client: ClientFactory) -> None:
    with RendezvousServer(
        [], SECRET, JOB_ID, bind_host="127.0.0.1", heartbeat_interval=0.2, elastic=True
    ) as elastic:
        elastic.publish(assign_slots([("a", 1), ("b", 1)], 2))
        client = make_client(elastic)
        client.set("hvdrun/g1/i1/addr", b"gen1")
        elastic.publish(assign_slots([("a", 1)], 1))  # generation 2
        # A client still in generation 1 (late, or replaying): every write and read of its
        # keys is refused at once with ABORTED, naming the generations.
        for attempt in (
            lambda: client.set("hvdrun/g1/i1/addr", b"replayed"),
            lambda: client.multi_set(["hvdrun/g1/i1/x"], [b"1"]),
            lambda: client.add("hvdrun/g1/i1/n", 1),
            lambda: client.compare_set("hvdrun/g1/i1/addr", b"gen1", b"replayed"),
            lambda: client.get("hvdrun/g1/i1/missing", timeout=30),
            lambda: client.multi_get(["hvdrun/g1/i1/missing"], timeout=30),
        ):
            with pytest.raises(RendezvousError) as err:
                attempt()
            assert err.value.code == grpc.StatusCode.ABORTED
            assert "generation 1 was superseded by generation 2" in str(err.value)
        # its keys are gone: a read of one waits for nothing (ABORTED as above)
        with pytest.raises(RendezvousError) as err:
            client.get("hvdrun/g1/i1/addr", timeout=30)
        assert err.value.code == grpc.StatusCode.ABORTED
        # Registering for an old generation answers with the newest one's place.
        info = client.register("a", 0, min_generation=1, timeout=5)
        assert (info.generation, info.size) == (2, 1)
        # The current generation works as usual.
        client.set("hvdrun/g2/i1/addr", b"gen2")
        assert client.multi_get(["hvdrun/g2/i1/addr"], timeout=1) == [b"gen2"]


def test_flood_of_connections_does_not_stop_the_job(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    sockets: list[socket.socket] = []
    try:
        for i in range(300):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sockets.append(sock)
            if i % 3 == 0:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not HTTP/2 at all
            elif i % 3 == 1:
                sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64)  # bad frames
            # else: connected and silent
        # Many real but unauthenticated clients at once, too.
        errors: list[BaseException] = []

        def intruder() -> None:
            with (
                RendezvousClient(f"127.0.0.1:{server.port}", "x", JOB_ID) as bad,
                contextlib.suppress(RendezvousAuthError),
            ):
                bad.set("hostile/flood", b"x")
                errors.append(AssertionError("an unauthenticated set went through"))

        threads = [threading.Thread(target=intruder) for _ in range(50)]
        for thread in threads:
            thread.start()
        good = make_client(server)
        _assert_serving(good)
        assert good.register("host-b", 1).rank == 3
        for thread in threads:
            thread.join(30)
        assert not errors
        assert not good.check(["hostile/flood"])
    finally:
        for sock in sockets:
            sock.close()
    _assert_serving(make_client(server))
