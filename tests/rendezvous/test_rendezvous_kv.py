"""Key-value store, barrier and registration semantics, through the real client and server."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from rendezvous import rendezvous_pb2, rendezvous_pb2_grpc
from rendezvous.client import (
    RankInfo,
    RendezvousClient,
    RendezvousError,
    RendezvousTimeout,
    RendezvousUnavailable,
)
from rendezvous.server import RendezvousServer, serving
from rendezvous.server.loop import LoopThread
from rendezvous.slots import assign_slots

Metadata = tuple[tuple[str, str], ...]
ClientFactory = Callable[..., RendezvousClient]


def test_set_get_bytes(client: RendezvousClient) -> None:
    values = {
        "kv/ascii": b"hello",
        "kv/binary": bytes(range(256)),  # not UTF-8
        "kv/empty": b"",
        "kv/unicode-key-\u00e9": "caf\u00e9".encode(),
        "kv/at-limit": b"x" * 4096,
    }
    for key, value in values.items():
        client.set(key, value)
    for key, value in values.items():
        assert client.get(key, timeout=1) == value
    client.set("kv/ascii", b"overwritten")
    assert client.get("kv/ascii", timeout=0) == b"overwritten"


def test_a_proxy_in_the_environment_is_not_used(
    server: RendezvousServer, make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Clusters set these for pip; the job's own ports are never behind them.
    for name in ("http_proxy", "https_proxy", "grpc_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    client = make_client(server, rpc_timeout=5.0)
    client.set("kv/proxy", b"direct")
    assert client.get("kv/proxy", timeout=5.0) == b"direct"


def test_get_blocks_until_another_thread_sets(client: RendezvousClient) -> None:
    def later() -> None:
        time.sleep(0.3)
        client.set("kv/late", b"\xff\xfe")

    thread = threading.Thread(target=later)
    start = time.monotonic()
    thread.start()
    assert client.get("kv/late", timeout=10) == b"\xff\xfe"
    elapsed = time.monotonic() - start
    thread.join()
    assert 0.25 < elapsed < 5


def test_get_timeout_names_key(client: RendezvousClient) -> None:
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout) as info:
        client.get("kv/never-set", timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3
    message = str(info.value)
    assert "'kv/never-set'" in message
    assert "0.3 s" in message
    assert "debug_error_string" not in message
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED

    # timeout 0 answers at once
    start = time.monotonic()
    with pytest.raises(RendezvousTimeout, match="kv/never-set"):
        client.get("kv/never-set", timeout=0)
    assert time.monotonic() - start < 1


def test_wait_released_and_timeout(client: RendezvousClient) -> None:
    client.set("kv/w1", b"1")
    client.wait(["kv/w1"], timeout=1)  # already there

    def later() -> None:
        time.sleep(0.2)
        client.set("kv/w2", b"2")
        time.sleep(0.1)
        client.set("kv/w3", b"3")

    thread = threading.Thread(target=later)
    thread.start()
    client.wait(["kv/w1", "kv/w2", "kv/w3"], timeout=10)
    thread.join()

    with pytest.raises(RendezvousTimeout) as info:
        client.wait(["kv/w1", "kv/missing-a", "kv/missing-b"], timeout=0.2)
    message = str(info.value)
    assert "'kv/missing-a'" in message and "'kv/missing-b'" in message
    assert "'kv/w1'" not in message.split("failed:")[1]  # only the missing keys are named


def test_add_counter_text_format(client: RendezvousClient) -> None:
    assert client.add("kv/counter", 5) == 5
    assert client.get("kv/counter", timeout=0) == b"5"
    assert client.add("kv/counter", -7) == -2
    assert client.get("kv/counter", timeout=0) == b"-2"
    assert client.add("kv/counter", 0) == -2
    client.set("kv/counter-text", b"40")
    assert client.add("kv/counter-text", 2) == 42
    client.set("kv/not-a-number", b"abc")
    with pytest.raises(RendezvousError) as info:
        client.add("kv/not-a-number", 1)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "decimal integer" in str(info.value)
    assert client.get("kv/not-a-number", timeout=0) == b"abc"


def test_add_releases_blocked_get(client: RendezvousClient) -> None:
    result: list[bytes] = []
    thread = threading.Thread(target=lambda: result.append(client.get("kv/added", timeout=10)))
    thread.start()
    time.sleep(0.1)
    client.add("kv/added", 3)
    thread.join(timeout=10)
    assert result == [b"3"]


def test_compare_set_all_branches(client: RendezvousClient) -> None:
    # missing key, expected empty: set to desired, returns desired
    assert client.compare_set("kv/cas1", b"", b"first") == b"first"
    assert client.get("kv/cas1", timeout=0) == b"first"
    # missing key, expected non-empty: nothing set, returns expected
    assert client.compare_set("kv/cas2", b"old", b"new") == b"old"
    assert not client.check(["kv/cas2"])
    # present, equal: set to desired, returns desired
    assert client.compare_set("kv/cas1", b"first", b"second") == b"second"
    assert client.get("kv/cas1", timeout=0) == b"second"
    # present, different: unchanged, returns current
    assert client.compare_set("kv/cas1", b"wrong", b"third") == b"second"
    assert client.get("kv/cas1", timeout=0) == b"second"


def test_check_delete_num_keys(server: RendezvousServer, make_client: ClientFactory) -> None:
    client = make_client(server)
    before = client.num_keys()
    client.set("kv/c1", b"1")
    client.set("kv/c2", b"2")
    assert client.num_keys() == before + 2
    assert client.check(["kv/c1", "kv/c2"])
    assert not client.check(["kv/c1", "kv/c-missing"])
    assert client.check([])
    assert client.delete("kv/c1") is True
    assert client.delete("kv/c1") is False
    assert not client.check(["kv/c1"])
    assert client.num_keys() == before + 1


def test_barrier_release_timeout_mismatch(
    client: RendezvousClient, make_client: ClientFactory, server: RendezvousServer
) -> None:
    others = [make_client(server) for _ in range(2)]
    errors: list[BaseException] = []

    def arrive(c: RendezvousClient) -> None:
        try:
            c.barrier("b/three", 3, timeout=10)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    def arrive_lonely(c: RendezvousClient) -> None:
        try:
            c.barrier("b/lonely", 3, timeout=10)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=arrive, args=(c,)) for c in others]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    assert all(thread.is_alive() for thread in threads)  # two of three: still waiting
    client.barrier("b/three", 3, timeout=10)
    for thread in threads:
        thread.join(timeout=10)
    assert not errors

    # the finished barrier is forgotten: the name works again, even with another count
    client.barrier("b/three", 1, timeout=1)

    start = time.monotonic()
    with pytest.raises(RendezvousTimeout) as info:
        client.barrier("b/lonely", 3, timeout=0.3)
    assert time.monotonic() - start < 3
    assert "1 of 3" in str(info.value) and "'b/lonely'" in str(info.value)

    # the caller that timed out no longer counts: after two new arrivals it still waits
    late = [threading.Thread(target=arrive_lonely, args=(c,)) for c in others]
    for thread in late:
        thread.start()
    time.sleep(0.3)
    assert all(thread.is_alive() for thread in late)
    with pytest.raises(RendezvousError) as mismatch:
        client.barrier("b/lonely", 2, timeout=1)
    assert mismatch.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "3 participants" in str(mismatch.value) and "says 2" in str(mismatch.value)
    assert all(thread.is_alive() for thread in late)  # the rejected caller did not count
    client.barrier("b/lonely", 3, timeout=10)
    for thread in late:
        thread.join(timeout=10)
    assert not errors

    with pytest.raises(RendezvousError) as bad:
        client.barrier("b/zero", 0, timeout=1)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_registration_table_heterogeneous(
    make_client: ClientFactory, secret: str, job_id: str
) -> None:
    slots = assign_slots([("a", 1), ("b", 2), ("c", 2)], 5)
    with RendezvousServer(slots, secret, job_id, bind_host="127.0.0.1") as srv:
        client = make_client(srv)
        assert srv.registered_count() == 0
        expected = {
            ("a", 0): RankInfo(0, 5, 0, 1, 0, 3, 0),
            ("b", 0): RankInfo(1, 5, 0, 2, 1, 3, 0),
            ("b", 1): RankInfo(2, 5, 1, 2, 0, 2, 0),
            ("c", 0): RankInfo(3, 5, 0, 2, 2, 3, 0),
            ("c", 1): RankInfo(4, 5, 1, 2, 1, 2, 0),
        }
        for (host, local_rank), info in expected.items():
            assert client.register(host, local_rank) == info
        assert srv.registered_count() == 5
        # registering again (init, shutdown, init) is allowed and changes nothing
        assert client.register("b", 1) == expected[("b", 1)]
        assert srv.registered_count() == 5

        with pytest.raises(RendezvousError) as info:
            client.register("a", 1)
        assert info.value.code == grpc.StatusCode.NOT_FOUND
        assert "'a'" in str(info.value) and "local_rank 1" in str(info.value)
        with pytest.raises(RendezvousError, match="'nohost'"):
            client.register("nohost", 0)
        assert srv.registered_count() == 5
        client.set("after", b"ok")
        assert client.get("after", timeout=0) == b"ok"


def test_thousands_of_blocked_gets_are_cheap(
    server: RendezvousServer, make_client: ClientFactory, metadata: Metadata
) -> None:
    """2000 concurrent blocking Gets: 1000 spread over 200 keys, 1000 on one key."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = rendezvous_pb2_grpc.RendezvousStub(channel)
    keys = [f"many/{i % 200}" for i in range(1000)] + ["many/shared"] * 1000
    try:
        futures = [
            stub.Get.future(
                rendezvous_pb2.GetRequest(key=key, timeout_ms=60_000),
                metadata=metadata,
                timeout=90,
            )
            for key in keys
        ]
        time.sleep(0.3)
        assert not any(future.done() for future in futures)
        setter = make_client(server)
        start = time.monotonic()
        setter.set("many/shared", b"S")
        for i in range(200):
            setter.set(f"many/{i}", str(i).encode())
        results = [future.result(timeout=60).value for future in futures]
        elapsed = time.monotonic() - start
    finally:
        channel.close()
    assert results == [key.removeprefix("many/").replace("shared", "S").encode() for key in keys]
    assert elapsed < 20


def test_unreachable_server_fails_fast(make_client: ClientFactory) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nobody listens here once closed
    client = make_client(f"127.0.0.1:{port}", rpc_timeout=30)
    start = time.monotonic()
    with pytest.raises(RendezvousUnavailable) as info:
        client.get("x", timeout=30)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "get('x')" in message and f"127.0.0.1:{port}" in message
    assert "debug_error_string" not in message


def test_server_lifecycle(make_client: ClientFactory, secret: str, job_id: str) -> None:
    srv = RendezvousServer(assign_slots([("h", 1)], 1), secret, job_id, bind_host="127.0.0.1")
    with pytest.raises(RuntimeError):
        _ = srv.port
    start = time.monotonic()
    port = srv.start()
    assert time.monotonic() - start < 0.5
    assert srv.port == port > 0
    assert srv.start() == port  # idempotent
    assert "s3cret" not in repr(srv)

    # a second server on the same fixed port fails clearly instead of sharing it
    clash = RendezvousServer(
        assign_slots([("h", 1)], 1), secret, job_id, bind_host="127.0.0.1", port=port
    )
    with pytest.raises(OSError, match=str(port)):
        clash.start()
    clash.stop()

    client = make_client(srv)
    client.set("k", b"v")

    # stop() releases a blocked get at once, with a clear error
    failures: list[BaseException] = []

    def blocked(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:
            failures.append(error)

    threads = [
        threading.Thread(target=blocked, args=(lambda: client.get("never", timeout=30),)),
        threading.Thread(target=blocked, args=(lambda: client.wait(["never"], timeout=30),)),
        threading.Thread(target=blocked, args=(lambda: client.barrier("b", 2, timeout=30),)),
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    srv.stop()
    for thread in threads:
        thread.join(timeout=10)
    assert time.monotonic() - start < 3
    assert len(failures) == 3
    assert all(isinstance(failure, RendezvousUnavailable) for failure in failures), failures
    assert all("shutting down" in str(failure) for failure in failures), failures
    srv.stop()  # idempotent
    with pytest.raises(RendezvousUnavailable):
        client.get("k", timeout=0)
    with pytest.raises(RuntimeError):
        srv.start()


def test_server_and_client_do_not_import_torch() -> None:
    """The CLI imports the server and must start fast: no torch behind its back."""
    code = (
        "import sys, time\n"
        "from rendezvous.server import RendezvousServer\n"
        "from rendezvous.client import RendezvousClient\n"
        "from rendezvous.slots import assign_slots\n"
        "t = time.monotonic()\n"
        "server = RendezvousServer(assign_slots([('h', 1)], 1), 's', 'j', bind_host='127.0.0.1')\n"
        "server.start()\n"
        "elapsed = time.monotonic() - t\n"
        "client = RendezvousClient(f'127.0.0.1:{server.port}', 's', 'j')\n"
        "client.set('k', b'v')\n"
        "assert client.get('k', timeout=float('inf')) == b'v'\n"
        "client.close(); server.stop()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(elapsed)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 0.5  # start() binds and returns at once (~10 ms)


def test_a_question_to_a_starved_server_loop_times_out(
    server: RendezvousServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisors ask the server's loop about the job every step; a loop that cannot
    answer (a machine too loaded to run it) gives them a TimeoutError to ride out, not a
    wait without end or another exception type."""
    monkeypatch.setattr(serving, "ASK_SECONDS", 0.2)
    release = threading.Event()

    async def block() -> None:
        release.wait(5)  # (holds the loop, as a starved one is held)

    loop = LoopThread.get()
    future = asyncio.run_coroutine_threadsafe(block(), loop.loop)
    try:
        with pytest.raises(TimeoutError, match=r"did not answer within 0\.2 s"):
            server.registered_count()
    finally:
        release.set()
        future.result(5)
    assert server.registered_count() == 0
