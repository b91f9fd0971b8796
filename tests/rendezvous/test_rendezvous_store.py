"""RendezvousStore as torch.distributed sees it: through torch's C++ Store trampoline, and
driving real Gloo process groups in 4 processes."""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.distributed as dist

from rendezvous.client import RendezvousClient
from rendezvous.server import RendezvousServer
from rendezvous.slots import assign_slots
from rendezvous.store import RendezvousStore

ClientFactory = Callable[..., RendezvousClient]
WORKER_SCRIPT = Path(__file__).with_name("rdzv_gloo_worker.py")
StoreError = getattr(dist, "DistStoreError", RuntimeError)


@pytest.fixture
def store(server: RendezvousServer, make_client: ClientFactory) -> RendezvousStore:
    return RendezvousStore(make_client(server), prefix="t/", timeout=datetime.timedelta(seconds=5))


def test_store_through_torch_cpp_trampoline(store: RendezvousStore) -> None:
    """Calls go Python -> PrefixStore (C++) -> our Python methods, as inside c10d."""
    wrapped = dist.PrefixStore("pre", store)
    wrapped.set("s", "text")  # str from Python, as _store_based_barrier does
    wrapped.set("b", b"\xff\x00\xfe")
    assert wrapped.get("s") == b"text"
    assert wrapped.get("b") == b"\xff\x00\xfe"
    assert wrapped.add("n", 5) == 5
    assert wrapped.get("n") == b"5"
    assert wrapped.compare_set("s", "text", "new") == b"new"
    assert wrapped.compare_set("s", "wrong", "x") == b"new"
    assert wrapped.compare_set("absent", "exp", "x") == b"exp"
    assert wrapped.compare_set("fresh", "", "v") == b"v"
    assert wrapped.check(["s", "b"]) and not wrapped.check(["s", "absent"])
    wrapped.wait(["s", "b"])
    wrapped.wait(["s"], datetime.timedelta(seconds=1))
    keys = wrapped.num_keys()  # C++ getNumKeys
    assert keys >= 4
    assert wrapped.delete_key("fresh") is True  # C++ deleteKey
    assert wrapped.delete_key("fresh") is False
    assert wrapped.num_keys() == keys - 1
    wrapped.append("log", "a")
    wrapped.append("log", b"a")  # appending the value the key already holds
    wrapped.append("log", "bc")
    assert wrapped.get("log") == b"aabc"
    wrapped.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert wrapped.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    assert wrapped.has_extended_api() is False
    # every key really lives under the store's prefix on the server
    assert store.get("pre/s") == b"new"  # PrefixStore joins "pre" + "/" + key
    assert store._client.get("t/pre/s", timeout=0) == b"new"

    clone = store.clone()
    assert isinstance(clone, RendezvousStore)
    assert clone.prefix == "t/" and clone.get("pre/n") == b"5"
    assert clone.timeout == store.timeout
    assert isinstance(wrapped.clone(), dist.Store)


def test_a_clone_outlives_the_python_reference_torch_drops(store: RendezvousStore) -> None:
    """torch clones a group's store to split the group (``ProcessGroup.split_group``) and
    keeps only the clone's C++ half: the clone must still answer afterwards."""
    clone = dist.PrefixStore("cl", store).clone()
    gc.collect()
    clone.set("k", b"v")
    assert clone.get("k") == b"v" and store.get("cl/k") == b"v"


def test_split_group_of_a_group_on_the_store(
    server: RendezvousServer, secret: str, job_id: str
) -> None:
    script = f"""
import datetime, torch, torch.distributed as dist
from rendezvous.client import RendezvousClient
from rendezvous.store import RendezvousStore
client = RendezvousClient("127.0.0.1:{server.port}", {secret!r}, {job_id!r})
store = RendezvousStore(client, prefix="split/", timeout=datetime.timedelta(seconds=10))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
group = dist.group.WORLD.split_group([0], timeout=datetime.timedelta(seconds=10))
t = torch.ones(2)
group.allreduce([t]).wait()
print("split", t.tolist())
dist.destroy_process_group()
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "split [1.0, 1.0]" in done.stdout


def test_many_values_past_the_message_limit_in_one_multi_call(store: RendezvousStore) -> None:
    """Each value within the server's value limit (4096 bytes here), together past its
    message limit (about 1 MiB): multi_set and multi_get still work, as on a TCPStore."""
    keys = [f"many/{i}" for i in range(300)]
    values = [bytes([i % 256]) * 4000 for i in range(300)]
    store.multi_set(keys, values)
    assert store.multi_get(keys) == values
    with pytest.raises(StoreError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])


def test_read_ahead_keeps_to_the_stores_own_keys(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    """Prefixes that end in digits: the server reads ahead from "run/10" to "run/11", ...
    "run/19", "run/20", and "run/20" is key "0" of the store "run/2", not key "10" of the
    store "run/1"."""
    client = make_client(server)
    first = RendezvousStore(client, prefix="run/1", timeout=datetime.timedelta(seconds=2))
    second = RendezvousStore(client, prefix="run/2", timeout=datetime.timedelta(seconds=2))
    for key in range(12):
        first.set(str(key), f"A{key}")
    second.set("0", "B0")
    swept = []
    for key in range(12):
        first.wait([str(key)])
        swept.append(first.get(str(key)))
    assert swept == [f"A{key}".encode() for key in range(12)]


def test_store_prefixes_isolate_generations(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    client = make_client(server)
    gen0 = RendezvousStore(client, prefix="gen0/")
    gen1 = RendezvousStore(client, prefix="gen1/")
    gen0.set("0//cpu//0/0", b"old address")
    assert not gen1.check(["0//cpu//0/0"])
    gen1.set("0//cpu//0/0", b"new address")
    assert gen0.get("0//cpu//0/0") == b"old address"
    assert gen1.get("0//cpu//0/0") == b"new address"


def test_store_get_blocks_and_honours_timeout(store: RendezvousStore) -> None:
    wrapped = dist.PrefixStore("blk", store)

    def later() -> None:
        time.sleep(0.3)
        store.set("blk/late", b"here")

    thread = threading.Thread(target=later)
    thread.start()
    assert wrapped.get("late") == b"here"  # get alone blocks, as NCCL's unique-ID read does
    thread.join()

    store.set_timeout(datetime.timedelta(milliseconds=300))
    assert store.timeout == datetime.timedelta(milliseconds=300)
    for call in (
        lambda: wrapped.get("never"),
        lambda: store.get("never"),
        lambda: wrapped.wait(["never"]),
        lambda: store.wait(["s", "never"], datetime.timedelta(milliseconds=200)),
    ):
        start = time.monotonic()
        with pytest.raises(StoreError) as info:
            call()
        assert time.monotonic() - start < 3
        assert isinstance(info.value, RuntimeError)
        assert "never'" in str(info.value)  # names the key
    start = time.monotonic()
    with pytest.raises(StoreError, match="never"):
        store.get("never")
    assert 0.25 < time.monotonic() - start < 3


def test_store_reports_dead_server(make_client: ClientFactory, secret: str, job_id: str) -> None:
    srv = RendezvousServer(assign_slots([("h", 1)], 1), secret, job_id, bind_host="127.0.0.1")
    srv.start()
    store = RendezvousStore(make_client(srv))
    store.set("k", b"v")
    srv.stop()
    with pytest.raises(RuntimeError, match="unavailable"):
        store.get("k")


def _in_a_thread_python_did_not_start(call: Callable[[], object]) -> object:
    """Runs ``call`` on a thread made by pthread_create, as NCCL's watchdog and monitor are:
    Python sees it as a foreign (dummy) thread. Returns the result or the exception."""
    libc = ctypes.CDLL(None)
    outcome: list[object] = []

    def body(_: object) -> None:
        try:
            outcome.append(call())
        except BaseException as error:  # what would have reached the C++ caller
            outcome.append(error)

    start = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(body)
    thread = ctypes.c_ulong()
    assert libc.pthread_create(ctypes.byref(thread), None, start, None) == 0
    assert libc.pthread_join(thread, None) == 0
    return outcome[0]


def test_torch_threads_never_get_an_exception_from_the_store(
    make_client: ClientFactory, secret: str, job_id: str
) -> None:
    """NCCL's C++ threads poll the store (its "dump" flag) through torch's C++ Store; once
    the rendezvous is gone or the client closed, they get neutral answers instead of an
    exception, while Python callers still see the failure."""
    srv = RendezvousServer(assign_slots([("h", 1)], 1), secret, job_id, bind_host="127.0.0.1")
    srv.start()
    client = make_client(srv, rpc_timeout=2.0)
    store = RendezvousStore(client, prefix="p/", timeout=datetime.timedelta(seconds=1))
    through_cpp = dist.PrefixStore("pg", store)  # as a process group holds it
    through_cpp.set("flag", b"1")
    assert _in_a_thread_python_did_not_start(lambda: through_cpp.check(["flag"])) is True

    srv.stop()
    assert _in_a_thread_python_did_not_start(lambda: through_cpp.check(["flag"])) is False
    assert _in_a_thread_python_did_not_start(lambda: through_cpp.get("flag")) == b""
    assert _in_a_thread_python_did_not_start(lambda: through_cpp.set("x", b"1")) is None
    assert _in_a_thread_python_did_not_start(lambda: through_cpp.add("n", 1)) == 0
    with pytest.raises(RuntimeError, match="rendezvous store"):
        through_cpp.check(["flag"])  # a Python thread is told

    client.close()  # at shutdown, after the process groups are gone
    assert _in_a_thread_python_did_not_start(lambda: through_cpp.check(["flag"])) is False
    with pytest.raises(RuntimeError, match="closed"):
        through_cpp.check(["flag"])


def test_gloo_process_groups_in_four_processes(secret: str, job_id: str, tmp_path: Path) -> None:
    slots = assign_slots([("host-a", 2), ("host-b", 2)], 4)
    outputs: list[tuple[int, str, str]] = []
    with RendezvousServer(slots, secret, job_id, bind_host="127.0.0.1") as server:
        addr = f"127.0.0.1:{server.port}"
        processes: list[subprocess.Popen[str]] = []
        try:
            for slot in slots:
                command = [sys.executable, str(WORKER_SCRIPT), addr, job_id]
                command += [slot.hostname, str(slot.local_rank)]
                stderr_file = open(tmp_path / f"stderr-{slot.rank}", "w")  # noqa: SIM115
                with stderr_file:
                    processes.append(
                        subprocess.Popen(
                            command,
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=stderr_file,
                            text=True,
                        )
                    )
            for process in processes:
                assert process.stdin is not None
                process.stdin.write(secret + "\n")  # the secret never goes into argv
                process.stdin.close()
            for rank, process in enumerate(processes):
                returncode = process.wait(timeout=120)
                assert process.stdout is not None
                stdout = process.stdout.read()
                stderr = (tmp_path / f"stderr-{rank}").read_text()
                outputs.append((returncode, stdout, stderr))
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                if process.stdout is not None:
                    process.stdout.close()
        assert server.registered_count() == 4

    for returncode, _, stderr in outputs:
        assert returncode == 0, f"worker failed:\n{stderr[-3000:]}"
    reports = sorted(
        (json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in outputs),
        key=lambda report: report["rank"],
    )
    assert [report["rank"] for report in reports] == [0, 1, 2, 3]
    for report in reports:
        rank = report["rank"]
        assert report["size"] == 4
        for generation, result in enumerate(report["generations"]):
            assert result["sum"] == 10.0 * (generation + 1)
            assert result["broadcast"] == {"generation": generation, "from": 0}
            assert result["subgroup_size"] == 2
            assert result["subgroup_sum"] == (2.0 if rank % 2 == 0 else 4.0)


# ---- Gloo's full-mesh sweep: wait([p/i]) then get(p/i) for every i, in few calls ----------


def _count_calls(client: RendezvousClient, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the client's get/get_ahead/wait calls (the RPCs the store sends)."""
    counts = {"get": 0, "get_ahead": 0, "wait": 0}
    for name in counts:
        method = getattr(client, name)

        def counted(*args: object, _name: str = name, _method: Callable = method) -> object:
            counts[_name] += 1
            return _method(*args)

        monkeypatch.setattr(client, name, counted)
    return counts


def _sweep(store: dist.Store, prefix: str, size: int) -> list[bytes]:
    """What torch 2.13's Gloo does on a Python store to connect its full mesh."""
    values = []
    for i in range(size):
        store.wait([f"{prefix}/{i}"])
        values.append(store.get(f"{prefix}/{i}"))
    return values


def test_gloo_sweep_takes_one_call_when_every_peer_is_there(
    server: RendezvousServer, make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(server)
    store = RendezvousStore(client, prefix="sweep1/", timeout=datetime.timedelta(seconds=5))
    wrapped = dist.PrefixStore("0", store)  # through torch's C++ trampoline, as Gloo calls it
    for i in range(12):
        wrapped.set(f"cpu/{i}", f"addr-{i}")
    counts = _count_calls(client, monkeypatch)
    assert _sweep(wrapped, "cpu", 12) == [f"addr-{i}".encode() for i in range(12)]
    assert counts == {"get": 0, "get_ahead": 1, "wait": 0}


def test_gloo_sweep_waits_for_late_peers(
    server: RendezvousServer, make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = make_client(server)
    store = RendezvousStore(client, prefix="sweep2/", timeout=datetime.timedelta(seconds=5))
    for i in range(3):
        store.set(f"g/{i}", f"a{i}")
    late = RendezvousStore(make_client(server), prefix="sweep2/")
    timer = threading.Timer(0.3, lambda: [late.set(f"g/{i}", f"a{i}") for i in (3, 4)])
    timer.start()
    counts = _count_calls(client, monkeypatch)
    try:
        assert _sweep(store, "g", 5) == [b"a0", b"a1", b"a2", b"a3", b"a4"]
    finally:
        timer.join()
    assert counts["get"] == 0 and counts["wait"] == 0
    assert 2 <= counts["get_ahead"] <= 3  # one for 0-2, one when 3 (and maybe 4) arrive


def test_values_read_ahead_are_dropped_by_any_other_call(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    store = RendezvousStore(make_client(server), prefix="sweep3/")
    other = RendezvousStore(make_client(server), prefix="sweep3/")
    for i in range(3):
        store.set(f"k/{i}", b"old")
    store.wait(["k/0"])  # reads k/1 and k/2 ahead
    assert store.get("k/0") == b"old"
    other.set("k/1", b"new")
    other.set("k/2", b"new")
    assert store.get("k/1") == b"new"  # a get with no wait before it asks the server
    store.wait(["k/2"])  # the get above dropped what the first wait read
    assert store.get("k/2") == b"new"

    store.wait(["k/0"])
    other.set("k/1", b"newer")
    assert store.check(["k/1"])  # any other call drops the values read ahead
    store.wait(["k/1"])
    assert store.get("k/1") == b"newer"


def test_values_read_ahead_belong_to_the_thread_that_waited(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    store = RendezvousStore(make_client(server), prefix="sweep4/")
    other = RendezvousStore(make_client(server), prefix="sweep4/")
    store.set("k/0", b"old")
    store.set("k/1", b"old")
    store.wait(["k/0"])  # this thread read k/1 ahead
    other.set("k/1", b"new")
    seen: list[bytes] = []

    def read() -> None:
        store.wait(["k/1"])
        seen.append(store.get("k/1"))

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    assert seen == [b"new"]


def test_get_ahead_reads_numbered_siblings_that_are_set(
    server: RendezvousServer, make_client: ClientFactory
) -> None:
    client = make_client(server)
    for i in (0, 1, 2, 4):
        client.set(f"ra/{i}", f"v{i}".encode())
    client.set("ra/01", b"padded")
    client.set("ra/x", b"x")
    assert client.get_ahead("ra/0", 1.0, 100) == (b"v0", [b"v1", b"v2"])  # stops at a gap
    assert client.get_ahead("ra/0", 1.0, 1) == (b"v0", [b"v1"])  # at most read_ahead
    assert client.get_ahead("ra/0", 1.0, 0) == (b"v0", [])
    assert client.get_ahead("ra/4", 1.0, 100) == (b"v4", [])
    assert client.get_ahead("ra/01", 1.0, 100) == (b"padded", [])  # not a plain number
    assert client.get_ahead("ra/x", 1.0, 100) == (b"x", [])
    # the answer stays within the value limit (4096 bytes on this server)
    for i in range(4):
        client.set(f"big/{i}", bytes(1500))
    value, ahead = client.get_ahead("big/0", 1.0, 100)
    assert len(value) == 1500 and len(ahead) == 2
