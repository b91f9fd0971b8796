"""The rendezvous at scale: N simulated workers doing what ``hvd.init()`` does, against
hvdrun's rendezvous server and against torch's ``TCPStore`` (libuv) on the same pattern.

The server runs in a process of its own, so its CPU seconds (``getrusage`` of that process)
are what the table reports next to the wall time. The simulated workers are asyncio tasks
(gRPC) or threads (TCPStore, whose client is blocking C++) in several load processes; each
simulated rank has its own connection, as real workers do. Patterns:

* ``nccl``: what a worker's ``hvd.init()`` sends for an NCCL job: Register, open the
  heartbeat Watch stream, rank 0 sets the unique id and every other rank reads it, then a
  barrier. (TCPStore: set/get of the id, and torch's store barrier: add + wait.)
* ``gloo``: Gloo's full-mesh bootstrap on top: every rank sets its address and reads all
  N-1 others (``per-key``: one Get per peer, what torch's Gloo does on a store without the
  extended API; ``batched``: one MultiGet of all peers).
* ``gloo-torch``: torch's own Gloo bootstrap, not a simulation of it: every rank constructs a
  real ``ProcessGroupGloo`` (threads in the load processes, each with its own connection)
  on hvdrun's ``RendezvousStore`` or on a ``TCPStore`` client, so the store sees exactly the
  calls torch 2.13 makes (``wait([p/i])`` then ``get(p/i)`` for every i) and Gloo connects
  its real full mesh of TCP pairs (the same work for both stores).
* ``relay``: what the server sees from hosts whose agents relay their workers
  (:mod:`rendezvous.relay`, multi-host jobs): one connection and one WatchHost stream per
  host, one RegisterHost and one Get of the unique id per host, each worker's own barrier.
* ``host``: the fully per-host protocol: one RegisterHost, one WatchHost and one barrier
  arrival per host (what a relay that also batched registrations and barriers would send).

After the init, the Watch streams stay open for ``--window`` seconds: the server's CPU in
that window is the steady heartbeat cost.

    python bench/rendezvous_scale.py                         # the default table
    python bench/rendezvous_scale.py --ranks 256 --pattern gloo --stores rendezvous,tcpstore
    python bench/rendezvous_scale.py --pattern gloo-torch --gloo-ranks 64,128,256  # real Gloo
    python bench/rendezvous_scale.py --tls --pattern nccl --stores rendezvous   # TLS's cost
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

JOB_ID = "bench-job"
LOCAL_SIZE = 8  # ranks per simulated host
UID_BYTES = 128  # an NCCL unique id
ADDR_BYTES = 64  # one Gloo address


# ---- the server process ----------------------------------------------------------------


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def serve(store: str, ranks: int, tls: bool) -> None:
    """Runs one server; answers "cpu" with its CPU seconds, exits on "stop" or EOF."""
    secret = sys.stdin.readline().strip()
    if store == "tcpstore":
        import datetime

        import torch.distributed as dist

        server: Any = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=300),
            wait_for_workers=False,
            use_libuv=True,
        )
        port = server.port
        print(f"port {port}", flush=True)
    else:
        from rendezvous.server import RendezvousServer
        from rendezvous.slots import assign_slots

        hosts = [(f"h{h}", LOCAL_SIZE) for h in range(ranks // LOCAL_SIZE)]
        slots = assign_slots(hosts, ranks)
        kwargs: dict[str, Any] = {}
        if tls:
            from rendezvous.tls import make_job_certificate

            cert = make_job_certificate(JOB_ID)
            kwargs["tls"] = cert
            print(f"cert {cert.cert_pem.decode().encode('unicode_escape').decode()}", flush=True)
        server = RendezvousServer(slots, secret, JOB_ID, bind_host="127.0.0.1", **kwargs)
        print(f"port {server.start()}", flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            print(f"cpu {_cpu_seconds():.4f}", flush=True)
        elif line.strip() == "stop":
            break
    if store != "tcpstore":
        server.stop(grace=0.1)


class ServerProcess:
    def __init__(self, store: str, ranks: int, secret: str, tls: bool = False) -> None:
        argv = [sys.executable, __file__, "--serve", store, "--ranks", str(ranks)]
        if tls:
            argv.append("--tls")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(secret + "\n")
        self.proc.stdin.flush()
        self.cert = ""
        line = self.proc.stdout.readline()
        if line.startswith("cert "):
            self.cert = line[5:].rstrip("\n").encode().decode("unicode_escape")
            line = self.proc.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"server did not start: {line!r}")
        self.port = int(line.split()[1])

    def cpu(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline().split()[1])

    def stop(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- the load processes ----------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    store: str  # rendezvous | tcpstore
    pattern: str  # nccl | gloo | gloo-batched | host
    ranks: int
    port: int
    secret: str
    cert: str = ""


def _host_of(rank: int) -> str:
    return f"h{rank // LOCAL_SIZE}"


async def _grpc_ranks(plan: Plan, mine: list[int], start: Any, report: Any, release: Any) -> None:
    import grpc
    import grpc.aio

    from rendezvous import JOB_METADATA_KEY, TOKEN_METADATA_KEY, rendezvous_pb2, rendezvous_pb2_grpc

    pb = rendezvous_pb2
    metadata = ((TOKEN_METADATA_KEY, plan.secret), (JOB_METADATA_KEY, JOB_ID))
    addr = f"127.0.0.1:{plan.port}"
    options = [("grpc.use_local_subchannel_pool", 1)]
    timeout_ms = 300_000
    rpcs = 0
    watches: list[Any] = []
    heartbeats = 0

    def channel() -> grpc.aio.Channel:
        if plan.cert:
            from rendezvous.tls import TARGET_NAME

            credentials = grpc.ssl_channel_credentials(root_certificates=plan.cert.encode())
            return grpc.aio.secure_channel(
                addr,
                credentials,
                options=[*options, ("grpc.ssl_target_name_override", TARGET_NAME)],
            )
        return grpc.aio.insecure_channel(addr, options=options)

    async def drain(call: Any) -> None:
        nonlocal heartbeats
        try:
            async for _event in call:
                heartbeats += 1
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass

    # Connected before the clock starts, like the TCPStore clients: the table measures the
    # rendezvous calls, not TCP and TLS handshakes.
    per_host = plan.pattern in ("host", "relay")
    owners = sorted({rank // LOCAL_SIZE for rank in mine}) if per_host else mine
    channels = {owner: channel() for owner in owners}
    await asyncio.gather(*(ch.channel_ready() for ch in channels.values()))

    async def one_rank(rank: int) -> None:
        nonlocal rpcs
        stub = rendezvous_pb2_grpc.RendezvousStub(channels[rank])
        n = plan.ranks
        info = await stub.Register(
            pb.RegisterRequest(host=_host_of(rank), local_rank=rank % LOCAL_SIZE),
            metadata=metadata,
        )
        assert info.rank == rank, (info.rank, rank)
        watch = stub.Watch(pb.WatchRequest(rank=rank), metadata=metadata)
        watches.append(asyncio.ensure_future(drain(watch)))
        rpcs += 2
        if rank == 0:
            await stub.Set(pb.SetRequest(key="uid", value=b"u" * UID_BYTES), metadata=metadata)
        else:
            await stub.Get(pb.GetRequest(key="uid", timeout_ms=timeout_ms), metadata=metadata)
        rpcs += 1
        if plan.pattern in ("gloo", "gloo-batched"):
            await stub.Set(
                pb.SetRequest(key=f"addr/{rank}", value=b"a" * ADDR_BYTES), metadata=metadata
            )
            peers = [f"addr/{p}" for p in range(n) if p != rank]
            if plan.pattern == "gloo":
                for key in peers:
                    await stub.Get(pb.GetRequest(key=key, timeout_ms=timeout_ms), metadata=metadata)
                rpcs += 1 + len(peers)
            else:
                response = await stub.MultiGet(
                    pb.MultiGetRequest(keys=peers, timeout_ms=timeout_ms), metadata=metadata
                )
                assert len(response.values) == len(peers)
                rpcs += 2
        await stub.Barrier(
            pb.BarrierRequest(name="init", participants=n, timeout_ms=timeout_ms), metadata=metadata
        )
        rpcs += 1

    async def one_host(host: int, ranks: list[int]) -> None:
        # One agent for the host: its ranks register in one call, one Watch stream carries
        # their heartbeats, job-wide keys are read once and handed to the local workers.
        nonlocal rpcs
        stub = rendezvous_pb2_grpc.RendezvousStub(channels[host])
        n = plan.ranks
        if plan.pattern == "relay":
            await relayed_host(stub, host, ranks)
            return
        infos = await stub.RegisterHost(
            pb.RegisterHostRequest(host=f"h{host}", local_ranks=[r % LOCAL_SIZE for r in ranks]),
            metadata=metadata,
        )
        assert [info.rank for info in infos.ranks] == ranks
        watch = stub.WatchHost(pb.WatchHostRequest(ranks=ranks), metadata=metadata)
        watches.append(asyncio.ensure_future(drain(watch)))
        rpcs += 2
        if 0 in ranks:
            await stub.Set(pb.SetRequest(key="uid", value=b"u" * UID_BYTES), metadata=metadata)
        else:
            await stub.Get(pb.GetRequest(key="uid", timeout_ms=timeout_ms), metadata=metadata)
        rpcs += 1
        await stub.Barrier(
            pb.BarrierRequest(name="init", participants=n // LOCAL_SIZE, timeout_ms=timeout_ms),
            metadata=metadata,
        )
        rpcs += 1

    report.put(("ready",))

    async def relayed_host(stub: Any, host: int, ranks: list[int]) -> None:
        # What rendezvous.relay sends for a host: its workers' Registers as one RegisterHost,
        # one WatchHost stream, their identical reads of the unique id as one Get, and each
        # worker's own barrier arrival.
        nonlocal rpcs
        n = plan.ranks
        infos = await stub.RegisterHost(  # the host's workers' Registers, arriving together
            pb.RegisterHostRequest(host=f"h{host}", local_ranks=[r % LOCAL_SIZE for r in ranks]),
            metadata=metadata,
        )
        assert [info.rank for info in infos.ranks] == ranks
        watch = stub.WatchHost(pb.WatchHostRequest(ranks=ranks), metadata=metadata)
        watches.append(asyncio.ensure_future(drain(watch)))
        if 0 in ranks:
            await stub.Set(pb.SetRequest(key="uid", value=b"u" * UID_BYTES), metadata=metadata)
        else:
            await stub.Get(pb.GetRequest(key="uid", timeout_ms=timeout_ms), metadata=metadata)
        await asyncio.gather(
            *(
                stub.Barrier(
                    pb.BarrierRequest(name="init", participants=n, timeout_ms=timeout_ms),
                    metadata=metadata,
                )
                for _ in ranks
            )
        )
        rpcs += len(ranks) + 3

    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    if per_host:
        hosts = sorted({rank // LOCAL_SIZE for rank in mine})
        await asyncio.gather(
            *(one_host(h, [r for r in mine if r // LOCAL_SIZE == h]) for h in hosts)
        )
    else:
        await asyncio.gather(*(one_rank(rank) for rank in mine))
    report.put((time.time(), rpcs, len(mine)))
    await asyncio.get_running_loop().run_in_executor(None, release.wait)
    report.put(("heartbeats", heartbeats))
    for task in watches:
        task.cancel()


def _tcpstore_ranks(plan: Plan, mine: list[int], start: Any, report: Any, release: Any) -> None:
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    lock = threading.Lock()
    counts = {"rpcs": 0}
    errors: list[str] = []
    n = plan.ranks

    # Connected before the clock starts: torch's client connect stalls 5 s now and then on
    # this machine (about 1 connect in 30, raw sockets do not), which is not the server's cost.
    stores: dict[int, Any] = {}

    def connect(rank: int) -> None:
        stores[rank] = dist.TCPStore(
            "127.0.0.1", plan.port, None, False, timeout=timeout, use_libuv=True
        )

    def one_rank(rank: int) -> None:
        try:
            store = stores[rank]
            rpcs = 0
            if rank == 0:
                store.set("uid", b"u" * UID_BYTES)
            else:
                store.get("uid")
            rpcs += 1
            if plan.pattern == "gloo":
                store.set(f"addr/{rank}", b"a" * ADDR_BYTES)
                for peer in range(n):
                    if peer != rank:
                        store.get(f"addr/{peer}")
                rpcs += n
            # torch's store-based barrier: count arrivals, the last one opens the gate.
            if store.add("arrived", 1) == n:
                store.set("gate", b"1")
            store.wait(["gate"])
            rpcs += 2
            with lock:
                counts["rpcs"] += rpcs
        except Exception as error:  # reported, so a failed run is not taken for a fast one
            with lock:
                errors.append(repr(error))

    connectors = [threading.Thread(target=connect, args=(rank,)) for rank in mine]
    for thread in connectors:
        thread.start()
    for thread in connectors:
        thread.join()
    if errors:
        raise RuntimeError(errors[0])
    report.put(("ready",))
    start.wait()
    threads = [threading.Thread(target=one_rank, args=(rank,)) for rank in mine]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(errors[0])
    report.put((time.time(), counts["rpcs"], len(mine)))
    release.wait()
    report.put(("heartbeats", 0))


def _torch_gloo_ranks(plan: Plan, mine: list[int], start: Any, report: Any, release: Any) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=300)
    errors: list[str] = []
    stores: dict[int, Any] = {}
    groups: list[Any] = []
    calls = {"n": 0}
    lock = threading.Lock()

    def connect(rank: int) -> None:
        try:
            connect_one(rank)
        except Exception as error:
            with lock:
                errors.append(f"rank {rank} could not connect: {error!r}")

    def connect_one(rank: int) -> None:
        if plan.store == "tcpstore":
            stores[rank] = dist.TCPStore(
                "127.0.0.1", plan.port, None, False, timeout=timeout, use_libuv=True
            )
            return
        from rendezvous.client import RendezvousClient
        from rendezvous.store import RendezvousStore

        client = RendezvousClient(f"127.0.0.1:{plan.port}", plan.secret, JOB_ID)
        client.num_keys()  # the channel is up before the clock starts
        for name in ("get", "get_ahead", "wait", "set"):  # count the RPCs the store sends
            method = getattr(client, name)

            def counted(*args: Any, _method: Any = method) -> Any:
                with lock:
                    calls["n"] += 1
                return _method(*args)

            setattr(client, name, counted)
        stores[rank] = RendezvousStore(client, prefix="bench/", timeout=timeout)

    def one_rank(rank: int) -> None:
        try:
            store = stores[rank]
            if plan.store == "tcpstore":  # the prefix our store adds itself
                store = dist.PrefixStore("bench/", store)
                with lock:  # TCPStore: torch's calls, 1 set and a wait + get per rank
                    calls["n"] += 1 + 2 * plan.ranks
            group = dist.ProcessGroupGloo(store, rank, plan.ranks, timeout)
            with lock:
                groups.append(group)
        except Exception as error:
            with lock:
                errors.append(repr(error))

    connectors = [threading.Thread(target=connect, args=(rank,)) for rank in mine]
    for thread in connectors:
        thread.start()
    for thread in connectors:
        thread.join()
    if errors:
        raise RuntimeError(errors[0])
    report.put(("ready",))
    start.wait()
    threads = [threading.Thread(target=one_rank, args=(rank,)) for rank in mine]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(errors[0])
    report.put((time.time(), calls["n"], len(mine)))
    release.wait()  # the groups live until every load process is done
    report.put(("heartbeats", 0))


def load(plan: Plan, mine: list[int], start: Any, report: Any, release: Any) -> None:
    try:
        if plan.pattern == "gloo-torch":
            _torch_gloo_ranks(plan, mine, start, report, release)
        elif plan.store == "tcpstore":
            _tcpstore_ranks(plan, mine, start, report, release)
        else:
            asyncio.run(_grpc_ranks(plan, mine, start, report, release))
    except BaseException as error:
        report.put(("error", repr(error)))
        raise


# ---- one measurement -------------------------------------------------------------------


@dataclass
class Result:
    store: str
    pattern: str
    ranks: int
    wall: float
    server_cpu: float
    rpcs_per_rank: float
    heartbeat_core: float  # fraction of one core the server spends while only heartbeats run


def measure(
    store: str, pattern: str, ranks: int, procs: int, window: float, tls: bool = False
) -> Result:
    secret = secrets.token_hex(16)
    server = ServerProcess(store, ranks, secret, tls)
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    release = ctx.Event()
    report = ctx.Queue()
    plan = Plan(store, pattern, ranks, server.port, secret, server.cert)
    # Whole hosts per load process, so a host's ranks share one process (as on a real host).
    hosts = list(range(ranks // LOCAL_SIZE))
    chunks = [hosts[i::procs] for i in range(procs)]
    loaders = []
    try:
        for chunk in chunks:
            if not chunk:
                continue
            mine = [h * LOCAL_SIZE + lr for h in chunk for lr in range(LOCAL_SIZE)]
            proc = ctx.Process(target=load, args=(plan, mine, start, report, release), daemon=True)
            proc.start()
            loaders.append(proc)
        for _ in loaders:  # every load process connects its clients first
            item = report.get(timeout=900)
            if item[0] == "error":
                raise RuntimeError(f"load process failed: {item[1]}")
        time.sleep(1.0 + 0.2 * len(loaders))  # imports done before the clock starts
        cpu0 = server.cpu()
        t0 = time.time()
        start.set()
        finished, rpcs, done_ranks = 0.0, 0, 0
        for _ in loaders:
            item = report.get(timeout=900)
            if item[0] == "error":
                raise RuntimeError(f"load process failed: {item[1]}")
            finished = max(finished, item[0])
            rpcs += item[1]
            done_ranks += item[2]
        wall = finished - t0
        cpu1 = server.cpu()
        heartbeat_core = float("nan")
        if store == "rendezvous" and window > 0 and pattern != "gloo-torch":
            time.sleep(1.0)  # let stragglers settle
            h0, s0 = server.cpu(), time.monotonic()
            time.sleep(window)
            heartbeat_core = (server.cpu() - h0) / (time.monotonic() - s0)
        release.set()
        for _ in loaders:
            item = report.get(timeout=60)
            if item[0] == "error":
                raise RuntimeError(f"load process failed: {item[1]}")
        return Result(
            store, pattern, ranks, wall, cpu1 - cpu0, rpcs / max(done_ranks, 1), heartbeat_core
        )
    finally:
        release.set()
        for proc in loaders:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        server.stop()


def _row(result: Result) -> str:
    beat = (
        "-"
        if result.heartbeat_core != result.heartbeat_core
        else f"{100 * result.heartbeat_core:.1f}%"
    )
    return (
        f"{result.store:<11} {result.pattern:<13} {result.ranks:>6} {result.wall:>8.2f} "
        f"{result.server_cpu:>8.2f} {1e3 * result.server_cpu / result.ranks:>9.3f} "
        f"{result.rpcs_per_rank:>8.1f} {beat:>9}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--serve", choices=["rendezvous", "tcpstore"], help=argparse.SUPPRESS)
    parser.add_argument("--tls", action="store_true", help="the rendezvous server uses TLS")
    parser.add_argument("--ranks", default="256,1024,4096")
    parser.add_argument("--gloo-ranks", default="256")
    parser.add_argument("--pattern", default="nccl,relay,host,gloo,gloo-batched")
    parser.add_argument("--stores", default="rendezvous,tcpstore")
    parser.add_argument("--procs", type=int, default=8, help="load processes")
    parser.add_argument("--window", type=float, default=3.0, help="heartbeat window, s")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, int(args.ranks), args.tls)
        return
    patterns = ("nccl", "relay", "host", "gloo", "gloo-batched", "gloo-torch")
    for flag, given, known in (
        ("--pattern", args.pattern, patterns),
        ("--stores", args.stores, ("rendezvous", "tcpstore")),
    ):
        unknown = [name for name in given.split(",") if name not in known]
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    print(
        f"{'store':<11} {'pattern':<13} {'ranks':>6} {'wall s':>8} {'srv cpu':>8} "
        f"{'ms/rank':>9} {'rpc/rank':>8} {'beat cpu':>9}"
    )
    for pattern in args.pattern.split(","):
        sizes = args.gloo_ranks if pattern.startswith("gloo") else args.ranks
        for ranks in (int(n) for n in sizes.split(",")):
            for store in args.stores.split(","):
                if store == "tcpstore" and pattern in ("host", "relay", "gloo-batched"):
                    continue
                result = measure(store, pattern, ranks, args.procs, args.window, args.tls)
                print(_row(result), flush=True)


if __name__ == "__main__":
    main()
