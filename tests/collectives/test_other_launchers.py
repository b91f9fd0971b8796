"""``hvd.init()`` joins jobs that other launchers started: srun, sbatch, mpirun, torchrun, and
processes with a Kubernetes-style RANK/WORLD_SIZE/MASTER_ADDR environment.

The Slurm jobs run on a real Slurm cluster (tests/slurm.py) whose two hosts are network
namespaces with names that resolve nowhere; mpirun reaches the same hosts over their sshd.
Every job checks identities on the right hosts, collective values and a DistributedOptimizer
step (workers/joined_worker.py); a killed rank must end the job with an error, not a hang.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import psutil
import pytest

from tests.collectives.conftest import REPO, WORKERS, clean_env
from tests.forwarding import Forwarder
from tests.slurm import SlurmCluster, mpi_unavailable_reason, mpirun_argv, slurm_for_tests

WORKER = str(WORKERS / "joined_worker.py")
ID_LINE = re.compile(r"ID rank=(\d+) size=(\d+) local=(\d+)/(\d+) cross=(\d+)/(\d+) host=(\S+)")


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    yield from slurm_for_tests(hosts=2)


def identities(output: str) -> dict[int, tuple[int, int, int, int, int, str]]:
    """rank -> (size, local rank, local size, cross rank, cross size, host)."""
    found = {}
    for match in ID_LINE.finditer(output):
        rank, *rest = match.groups()
        size, local, local_size, cross, cross_size = map(int, rest[:5])
        found[int(rank)] = (size, local, local_size, cross, cross_size, rest[5])
    return found


def assert_two_by_two(output: str, host_a: str, host_b: str) -> None:
    """Four ranks, two per host, placed block-wise: the identities hvdrun would give."""
    assert identities(output) == {
        0: (4, 0, 2, 0, 2, host_a),
        1: (4, 1, 2, 0, 2, host_a),
        2: (4, 0, 2, 1, 2, host_b),
        3: (4, 1, 2, 1, 2, host_b),
    }, output
    for rank in range(4):
        assert f"ALL OK rank {rank}:" in output, output
    assert "FAIL" not in output, output


def python_left_on(slurm: SlurmCluster, within: float = 10.0) -> list[str]:
    """Worker processes still running on the cluster's hosts after ``within`` seconds."""
    deadline = time.monotonic() + within
    left: list[str] = []
    while time.monotonic() < deadline:
        left = []
        for host in slurm.nodes:
            for proc in slurm.hosts.processes_on(host):
                try:
                    if proc.status() != psutil.STATUS_ZOMBIE and WORKER in " ".join(proc.cmdline()):
                        left.append(f"{host.alias}: {proc.pid}")
                except psutil.Error:
                    continue
        if not left:
            return []
        time.sleep(0.2)
    return left


# ---- Slurm ---------------------------------------------------------------------------------


def test_srun_two_nodes_two_tasks_each(slurm: SlurmCluster) -> None:
    result = slurm.run("srun", "-N2", "--ntasks-per-node=2", sys.executable, WORKER)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert_two_by_two(output, "hvdh1", "hvdh2")
    assert "hvd.init(): this job's rendezvous is not authenticated (no HVDRUN_SECRET)" in output
    assert "to every rank (srun passes it on)" in output
    assert output.count("not authenticated") == 1  # said once, by rank 0


def test_srun_cyclic_with_a_secret(slurm: SlurmCluster) -> None:
    env = slurm.env(HVDRUN_SECRET="s3cret-from-the-user")
    result = slurm.run(
        "srun", "-N2", "--ntasks-per-node=2", "-m", "cyclic", sys.executable, WORKER, env=env
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert identities(output) == {
        0: (4, 0, 2, 0, 2, "hvdh1"),
        1: (4, 0, 2, 1, 2, "hvdh2"),
        2: (4, 1, 2, 0, 2, "hvdh1"),
        3: (4, 1, 2, 1, 2, "hvdh2"),
    }, output
    assert "not authenticated" not in output


def test_info_shows_what_init_would_do(slurm: SlurmCluster) -> None:
    result = slurm.run(
        "srun", "-N2", "--ntasks-per-node=1", "-l", sys.executable, "-m", "collectives.torch.info"
    )
    output = result.stdout
    assert result.returncode == 0, output + result.stderr
    assert "1: launcher: Slurm (srun): rank 1 of 2, local rank 0 of 1 on hvdh2" in output, output
    address = slurm.nodes[0].address
    assert f"the step's first node hvdh1 ({address}) and port" in output, output
    assert "authentication: none beyond a token derived from the job id" in output, output


def test_sbatch_example(slurm: SlurmCluster) -> None:
    """examples/slurm_digits.sbatch as a user submits it: from the repository, with this
    installation's python first on PATH."""
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    code, output = slurm.sbatch(
        "examples/slurm_digits.sbatch", "--epochs", "2", env=slurm.env(PATH=path), cwd=REPO
    )
    assert code == 0, output
    assert "trained on 4 process(es)" in output, output  # 2 nodes x 2 tasks, one job
    accuracy = re.search(r"final test accuracy: ([0-9.]+)", output)
    assert accuracy is not None and float(accuracy.group(1)) > 0.8, output
    assert "not authenticated" not in output  # the script exports HVDRUN_SECRET


def test_srun_killed_rank_ends_the_job(slurm: SlurmCluster) -> None:
    env = slurm.env(HVDRUN_GLOO_TIMEOUT_SECONDS="5")
    started = time.monotonic()
    result = slurm.run(
        "srun", "-N2", "--ntasks-per-node=2", sys.executable, WORKER, "die", env=env, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "PEER LOST" in output, output
    assert time.monotonic() - started < 60, output
    assert python_left_on(slurm) == []


def test_srun_without_a_way_to_the_first_node(slurm: SlurmCluster) -> None:
    # The node names resolve nowhere, and without scontrol on PATH Slurm cannot be asked.
    result = slurm.run(
        "srun",
        "-N2",
        "--ntasks-per-node=1",
        "/usr/bin/env",
        "PATH=/nonexistent",
        sys.executable,
        WORKER,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "started by Slurm (srun) as rank" in output, output
    assert "hvdh1, the step's first node" in output, output
    assert "export MASTER_ADDR=" in output, output
    assert "ALL OK" not in output


def test_batch_script_without_srun_says_so(slurm: SlurmCluster) -> None:
    script = slurm.root / "nosrun.sbatch"
    script.write_text(f"#!/bin/sh\n{sys.executable} {WORKER}\n")
    code, output = slurm.sbatch(str(script), options=["-N2", "--ntasks-per-node=2"])
    assert code != 0, output
    assert "Slurm batch script" in output and "srun" in output, output
    assert "HVDRUN_LAUNCHER=none" in output, output


# ---- Open MPI ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mpi(slurm: SlurmCluster) -> SlurmCluster:
    reason = mpi_unavailable_reason()
    if reason is not None:
        pytest.skip(f"MPI tests skipped: {reason}")
    return slurm


def mpirun(
    mpi: SlurmCluster, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    hosts = [(host, 2) for host in mpi.nodes]
    argv = mpirun_argv(mpi.hosts, hosts, *args)
    return subprocess.run(
        mpi.argv(*argv),
        capture_output=True,
        text=True,
        timeout=180,
        env=env or mpi.hosts.env(),
        stdin=subprocess.DEVNULL,
        cwd=REPO,
    )


def test_mpirun_with_master_addr(mpi: SlurmCluster) -> None:
    first = mpi.nodes[0]
    result = mpirun(
        mpi, "-x", f"MASTER_ADDR={first.address}", "-x", "MASTER_PORT=29517",
        sys.executable, WORKER,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert_two_by_two(output, first.uts_hostname, mpi.nodes[1].uts_hostname)


def test_mpirun_without_master_addr_uses_mpi4py(mpi: SlurmCluster) -> None:
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    result = mpirun(mpi, sys.executable, WORKER)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert_two_by_two(output, mpi.nodes[0].uts_hostname, mpi.nodes[1].uts_hostname)
    assert "not authenticated" not in output  # rank 0 sent a fresh secret over MPI


def test_mpirun_without_master_addr_or_mpi4py(mpi: SlurmCluster, tmp_path: Path) -> None:
    blocker = tmp_path / "mpi4py"
    blocker.mkdir()
    (blocker / "__init__.py").write_text(
        "raise ImportError('mpi4py is unavailable in this test')\n"
    )
    env = mpi.hosts.env(PYTHONPATH=str(tmp_path))
    result = mpirun(mpi, "-x", "PYTHONPATH", sys.executable, WORKER, env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "started by Open MPI (mpirun) as rank" in output, output
    assert "mpirun -x MASTER_ADDR=" in output, output


def test_mpirun_rank_that_never_calls_init_ends_the_job(mpi: SlurmCluster) -> None:
    """Over mpi4py the ranks meet in MPI_Init, which waits for every rank without a timeout
    of its own: they give up after HVDRUN_START_TIMEOUT, as under the other launchers."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed")
    env = mpi.hosts.env(HVDRUN_START_TIMEOUT="3")
    started = time.monotonic()
    result = mpirun(mpi, "-x", "HVDRUN_START_TIMEOUT", sys.executable, WORKER, "late", "3", env=env)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    said = "waited 3 s (HVDRUN_START_TIMEOUT) in MPI's start-up for the other ranks"
    assert said in output, output
    # an exit of its own (status 1), which mpirun does not report as a kill (the OOM
    # killer's signal 9, as it did)
    assert "signal 9" not in output and "Killed" not in output, output
    assert time.monotonic() - started < 50, output
    assert python_left_on(mpi) == []


def test_mpirun_killed_rank_ends_the_job(mpi: SlurmCluster) -> None:
    env = mpi.hosts.env(HVDRUN_GLOO_TIMEOUT_SECONDS="5")
    started = time.monotonic()
    result = mpirun(
        mpi, "-x", "HVDRUN_GLOO_TIMEOUT_SECONDS", sys.executable, WORKER, "die", env=env
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert time.monotonic() - started < 90, output
    assert python_left_on(mpi) == []


# ---- torchrun and Kubernetes-style environments (this machine) ------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_torchrun() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), WORKER,
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=clean_env(), cwd=REPO
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    host = socket.gethostname()
    assert identities(output) == {0: (2, 0, 2, 0, 1, host), 1: (2, 1, 2, 0, 1, host)}, output
    for rank in range(2):
        assert f"ALL OK rank {rank}:" in output, output


def test_torchrun_rank_0_that_never_calls_init_is_named() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), WORKER, "late", "0",
    ]  # fmt: skip
    env = {**clean_env(), "HVDRUN_START_TIMEOUT": "3"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=50, env=env, cwd=REPO)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert (
        "JoinError: hvd.init(): rank 1 of 2 (torchrun) did not hear from rank 0 within 3 s "
        "(HVDRUN_START_TIMEOUT)" in output
    ), output


def test_torchrun_address_left_by_an_earlier_worker_group() -> None:
    """torchrun's agent store outlives its worker groups, and a scale-up starts new workers
    with the same restart count: the key rank 0 publishes its address under may still hold
    the address of the group before, whose rank 0 is gone. A rank that reads it first
    must take the new address once rank 0 publishes it, not try the old one until
    HVDRUN_START_TIMEOUT. Here the agent store is a real TCPStore the test serves, as
    torchrun's agent does, and it holds such an address."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    store.set("hvdrun/torchrun/scale-up/0/rendezvous/1", f"127.0.0.1:{free_port()}")

    def agent_worker(rank: int) -> subprocess.Popen[str]:
        env = clean_env()
        env.update(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
            GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
            TORCHELASTIC_RUN_ID="scale-up", TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_USE_AGENT_STORE="True", HVDRUN_START_TIMEOUT="40",
        )  # fmt: skip
        pipe, joined = subprocess.PIPE, subprocess.STDOUT
        return subprocess.Popen(
            [sys.executable, WORKER], env=env, cwd=REPO, stdout=pipe, stderr=joined, text=True
        )

    late_rank_0 = [agent_worker(1)]
    time.sleep(4)  # rank 1 has read the old address and found nobody there
    late_rank_0.insert(0, agent_worker(0))
    codes, output = finish(late_rank_0, timeout=100)
    assert codes == [0, 0], output
    for rank in range(2):
        assert f"ALL OK rank {rank}:" in output, output


def test_two_torchrun_agents_on_one_host() -> None:
    """Two torchrun nodes on one machine (Spark's TorchDistributor with two tasks on one
    executor): each agent's process has LOCAL_RANK 0, and each agent is a node of its own,
    as torchrun sees it."""
    port = str(free_port())
    agents = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
                *("--nproc-per-node", "1", "--node-rank", str(node)),
                *("--master-addr", "127.0.0.1", "--master-port", port, WORKER),
            ],
            env=clean_env(),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    codes, output = finish(agents, timeout=180)
    assert codes == [0, 0], output
    host = socket.gethostname()
    assert identities(output) == {0: (2, 0, 1, 0, 2, host), 1: (2, 0, 1, 1, 2, host)}, output
    for rank in range(2):
        assert f"ALL OK rank {rank}:" in output, output


def start_pods(size: int, *args: str, port: int, **extra: str) -> list[subprocess.Popen[str]]:
    """One process per rank with what a Kubernetes PyTorchJob gives its pods."""
    return [start_pod(rank, size, *args, port=port, **extra) for rank in range(size)]


def start_pod(rank: int, size: int, *args: str, port: int, **extra: str) -> subprocess.Popen[str]:
    env = clean_env()
    env.update(RANK=str(rank), WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(port), **extra)
    return subprocess.Popen(
        [sys.executable, WORKER, *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen[str]], timeout: float = 120) -> tuple[list[int], str]:
    outputs, codes = [], []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for each in procs:  # (no rank outlives the test)
                each.kill()
            raise
        outputs.append(out)
        codes.append(proc.returncode)
    return codes, "\n".join(outputs)


def test_kubernetes_style_environment() -> None:
    codes, output = finish(start_pods(2, port=free_port()))
    assert codes == [0, 0], output
    host = socket.gethostname()
    assert identities(output) == {0: (2, 0, 2, 0, 1, host), 1: (2, 1, 2, 0, 1, host)}, output


@pytest.mark.parametrize("launcher", ["torchrun", "kubernetes"])
def test_init_again_after_shutdown(launcher: str) -> None:
    # Each round meets anew: a rank that calls init() again at once does not join the round
    # before, whose rendezvous rank 0 serves until the others have left it.
    if launcher == "torchrun":
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), WORKER, "reinit",
        ]  # fmt: skip
        env = {**clean_env(), "HVDRUN_START_TIMEOUT": "30"}
        pipe, joined = subprocess.PIPE, subprocess.STDOUT
        procs = [
            subprocess.Popen(command, env=env, cwd=REPO, stdout=pipe, stderr=joined, text=True)
        ]
    else:
        procs = start_pods(2, "reinit", port=free_port(), HVDRUN_START_TIMEOUT="30")
    codes, output = finish(procs, timeout=120)
    assert set(codes) == {0}, output
    for round_ in range(3):
        for rank in range(2):
            assert f"ROUND {round_} rank {rank} sum {1 + 2 * round_}" in output, output
    assert "rejected" not in output, output


def test_kubernetes_style_killed_rank_ends_the_job() -> None:
    started = time.monotonic()
    codes, output = finish(start_pods(3, "die", port=free_port(), HVDRUN_GLOO_TIMEOUT_SECONDS="5"))
    assert codes[1] == -9, output
    assert codes[0] == 3 and codes[2] == 3, output
    assert "PEER LOST" in output
    assert time.monotonic() - started < 60, output


def test_peers_that_never_arrive() -> None:
    # Rank 0 of a job of 2 whose rank 1 never starts.
    procs = start_pods(1, port=free_port(), WORLD_SIZE="2", HVDRUN_START_TIMEOUT="3")
    codes, output = finish(procs)
    assert codes == [1], output
    assert "the RANK/WORLD_SIZE/MASTER_ADDR environment started 2 processes" in output, output
    said = r"1 of 2 ranks did not register within [0-9.]+ s: rank 1 \(started late, or exited "
    assert re.search(said + r"before hvd\.init\(\): the launcher's output says which\)", output)


@pytest.mark.parametrize("speaks", [True, False, "grpc"])
def test_a_port_held_by_another_program_is_named_on_every_rank(speaks: bool | str) -> None:
    # Rank 0 cannot serve the rendezvous on a port another program holds, and says so at
    # once; the other ranks reach that program instead and used to wait out
    # HVDRUN_START_TIMEOUT (120 s) for a rank 0 that would never serve. One that speaks
    # (an sshd, a web server, another gRPC server) is named at once, a silent one
    # (another job's TCPStore) after 10 s.
    if speaks == "grpc":
        _grpc_server_holds_the_port()
        return
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            if speaks:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")

    threading.Thread(target=serve, daemon=True).start()
    started = time.monotonic()
    try:
        codes, output = finish(start_pods(2, port=port), timeout=90)
    finally:
        listener.close()
        for conn in held:
            conn.close()
    assert codes == [1, 1], output
    assert f"rank 0 cannot serve the rendezvous on port {port}" in output, output
    what = "answers in another protocol" if speaks else "accepts connections but answers nothing"
    _assert_named(output, port, what)
    assert time.monotonic() - started < 60, output


def _grpc_server_holds_the_port() -> None:
    """Another gRPC server (no rendezvous calls: it answers UNIMPLEMENTED) holds the port;
    rank 1's error used to be gRPC's own 'UNIMPLEMENTED: Method not found!'."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        codes, output = finish(start_pods(2, port=port), timeout=90)
    finally:
        server.stop(None)
    assert codes == [1, 1], output
    _assert_named(output, port, "answers as a gRPC (HTTP/2) server without the rendezvous' calls")


def _assert_named(output: str, port: int, what: str) -> None:
    assert (
        f"rank 1 of 2 (the RANK/WORLD_SIZE/MASTER_ADDR environment) reached 127.0.0.1:{port} "
        f"(MASTER_ADDR=127.0.0.1 and port {port} (MASTER_PORT)), but the program there is not "
        f"hvdrun's rendezvous: it {what}"
    ) in output, output
    assert "Another program holds that port" in output, output


def relayed_pods(real_port: int, relay: Forwarder, **extra: str) -> list[subprocess.Popen[str]]:
    """A job of two pods: rank 0 serves on ``real_port``, rank 1 dials ``relay``'s port."""
    master_port = free_port()  # (the job's key: the same on both ranks)
    return [
        start_pod(rank, 2, port=master_port, **extra,
                  HVDRUN_RENDEZVOUS_PORT=str(real_port if rank == 0 else relay.port))
        for rank in range(2)
    ]  # fmt: skip


def test_a_register_that_is_never_answered_is_made_again() -> None:
    # A Register can reach a gRPC server that takes the call and never answers it (the
    # round before's, as it stops after hvd.shutdown(): the flaky failure of
    # test_init_again_after_shutdown). Rank 1's first connection goes to such a server: it
    # registers again on a fresh connection after 10 s (launched.REGISTER_ATTEMPT_SECONDS)
    # and the job forms, instead of both ranks failing at HVDRUN_START_TIMEOUT.
    import grpc  # (the test's own server; the workers import it themselves)

    release = threading.Event()

    class Hang(grpc.GenericRpcHandler):
        def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: release.wait(60) and b"")

    executor = ThreadPoolExecutor(4)
    stuck = grpc.server(executor, handlers=[Hang()])
    stuck_port = stuck.add_insecure_port("127.0.0.1:0")
    stuck.start()
    real_port = free_port()
    forwarder = Forwarder([stuck_port, real_port])
    try:
        codes, output = finish(relayed_pods(real_port, forwarder, HVDRUN_START_TIMEOUT="30"), 90)
    finally:
        release.set()
        stuck.stop(0)
        executor.shutdown(wait=False)
        forwarder.close()
    assert codes == [0, 0], output
    assert sorted(identities(output)) == [0, 1], output
    # (the first call did go to the silent one; had no Register been made again, both ranks
    # would have failed at HVDRUN_START_TIMEOUT rather than formed the job)
    assert forwarder.connections >= 2, output


def test_pods_with_a_secret_meet_over_tls(slurm: SlurmCluster) -> None:
    """Rank 0 reached at a network address (this machine's on the test cluster's bridge) by
    ranks that share HVDRUN_SECRET: its rendezvous speaks TLS, every rank deriving the same
    certificate authority from the secret, so rank 1's connections (through a recording
    relay) open with a TLS handshake and the secret never crosses in clear text."""
    gateway = slurm.hosts.gateway
    real_port = free_port()
    relay = Forwarder([real_port], host=gateway)
    secret = "the-pods-share-this-secret-0123456789"
    try:
        procs = relayed_pods(real_port, relay, MASTER_ADDR=gateway, HVDRUN_SECRET=secret)
        codes, output = finish(procs, timeout=90)
    finally:
        relay.close()
    assert codes == [0, 0], output
    assert sorted(identities(output)) == [0, 1], output
    assert relay.openings, output
    assert all(opening.startswith(b"\x16\x03") for opening in relay.openings), relay.openings
    assert secret.encode() not in relay.captured


@pytest.mark.parametrize("where", ["network", "loopback"])
def test_a_rank_with_another_secret_says_so_at_once(slurm: SlurmCluster, where: str) -> None:
    """Rank 1 was given another HVDRUN_SECRET than rank 0 (a pod's spec): it fails at once,
    saying so, whether its handshake failed (TLS, off loopback) or rank 0 refused its
    secret (loopback), instead of waiting for HVDRUN_START_TIMEOUT."""
    master = slurm.hosts.gateway if where == "network" else "127.0.0.1"
    port = free_port()
    procs = [
        start_pod(rank, 2, port=port, MASTER_ADDR=master, HVDRUN_START_TIMEOUT=timeout,
                  HVDRUN_SECRET=f"secret-of-rank-{rank}")
        for rank, timeout in ((0, "12"), (1, "40"))
    ]  # fmt: skip
    started = time.monotonic()
    try:
        out, _ = procs[1].communicate(timeout=30)
        assert time.monotonic() - started < 10, out
        first, _ = procs[0].communicate(timeout=30)
    finally:
        for proc in procs:
            proc.kill()
    assert procs[1].returncode == 1, out
    # Rank 0 names the missing rank, and over TLS (where it never sees the handshake fail)
    # where to look for why; on loopback it logged the refused secret itself.
    assert procs[0].returncode == 1 and "did not register within" in first, first
    assert "s: rank 1 (started late, or exited before hvd.init()" in first, first
    unseen = "a rank whose HVDRUN_SECRET differs from rank 0's cannot connect to it at all"
    seen = "missing or invalid job token"
    assert (unseen in first, seen in first) == (where == "network", where == "loopback"), first
    refusal = {
        "network": "but its TLS certificate is not one this rank trusts (this rank speaks TLS",
        "loopback": "but it refused this rank's secret (this rank sent HVDRUN_SECRET)",
    }[where]
    assert refusal in out, out
    assert "rank 0 has another HVDRUN_SECRET, or none. Give every rank the same" in out, out


def test_two_processes_with_one_rank_are_told_so() -> None:
    """Two processes started as rank 1 of the same job (two jobs started with one
    MASTER_ADDR:MASTER_PORT, a copied pod spec): one joins and the job trains, the other
    fails at once naming both processes, instead of both taking rank 1 and hanging the job
    in its process group."""
    port = free_port()
    procs = [start_pod(0, 2, port=port), start_pod(1, 2, port=port), start_pod(1, 2, port=port)]
    codes, output = finish(procs, timeout=60)
    assert codes[0] == 0 and sorted(codes[1:]) == [0, 1], output
    assert "rank 1 is held by another process (pid " in output, output
    assert "was started with the same rank: two jobs meet at one rendezvous address" in output
    assert sorted(identities(output)) == [0, 1], output


def test_ranks_given_different_job_sizes_are_told_so() -> None:
    # Rank 0 was told the job has 2 processes, rank 1 that it has 3 (a wrong WORLD_SIZE in
    # one pod's spec): both fail at once, naming the sizes, instead of making a job of 2 or
    # waiting for a rank 2 that never comes.
    port = free_port()
    started = time.monotonic()
    procs = [start_pod(0, 2, port=port), start_pod(1, 3, port=port)]
    codes, output = finish(procs)
    assert codes == [1, 1], output
    why = "rank 1 (host '" + socket.gethostname() + "') was started as one of 3 processes, "
    assert output.count(why + "but rank 0 as one of 2") == 2, output
    assert time.monotonic() - started < 60, output


def test_a_rank_that_fails_to_connect_is_named_at_once() -> None:
    """A rank whose process group set-up fails after it joined (a CUDA or NCCL error)
    leaves; with no launcher to stop the others (a Kubernetes job, srun without -K), their
    hvd.init() fails within seconds, naming it, instead of waiting out the collectives' 300 s
    (also when the rank fails before its rendezvous stream has opened, as it may here)."""
    procs = start_pods(2, "fail-connect", port=free_port())
    codes, output = finish(procs)
    assert codes == [5, 5], output
    assert "NCCL error: unhandled cuda error (simulated)" in output, output
    found = re.search(
        r"INIT FAILED after ([0-9.]+) s: .*rank 1 of 2 \(the RANK/WORLD_SIZE/MASTER_ADDR "
        r"environment\) left the job after joining it",
        output,
    )
    assert found is not None and float(found[1]) < 30, output


def test_no_address_to_meet_at_fails_at_once() -> None:
    env = clean_env()
    env.update(JSM_NAMESPACE_RANK="1", JSM_NAMESPACE_SIZE="2")
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, WORKER], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    assert result.returncode == 1, result.stderr
    assert "started by LSF (jsrun) as rank 1 of 2" in result.stderr, result.stderr
    assert "export MASTER_ADDR=" in result.stderr, result.stderr
    assert time.monotonic() - started < 20


def test_launcher_none_runs_alone() -> None:
    env = clean_env()
    env.update(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4", HVDRUN_LAUNCHER="none")
    result = subprocess.run(
        [sys.executable, WORKER], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ID rank=0 size=1 " in result.stdout


def test_an_elastic_script_runs_as_plain_training_under_another_launcher() -> None:
    # (as Horovod's does under mpirun: one script for both modes)
    env = clean_env()
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    code = (
        "import collectives.torch as hvd\n"
        "hvd.init()\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    state.epoch += 1\n"
        "    state.commit()\n"
        "    return state.epoch\n"
        "print('TRAINED', train(hvd.elastic.ObjectState(epoch=0)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    assert "TRAINED 1" in result.stdout, result.stdout + result.stderr
