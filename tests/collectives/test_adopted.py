"""``hvd.init()`` where torch.distributed already has a default process group, and no
silent job of size 1 from a RANK/WORLD_SIZE environment without an address.

Frameworks (Lightning, Accelerate, Ray Train) and torchrun scripts make the default group
before the user's code runs; hvd.init() joins that job (collectives/runtime/adopted.py).
The jobs here are real processes: torchrun, and processes with a Kubernetes-style
environment; the pure parts (the environment check, the exchange of places over a store)
are tested in this process on a real store.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch.distributed as dist

import collectives.torch as hvd
from collectives.runtime.adopted import (
    AdoptionError,
    check_environment,
    exchange_places,
    topology_from,
)
from collectives.runtime.state import Topology
from tests.collectives.conftest import REPO, WORKERS, clean_env
from tests.collectives.test_other_launchers import finish, free_port, identities

WORKER = str(WORKERS / "adopted_worker.py")

# ---- the environment beside an existing group ------------------------------------------------


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"},
        {"RANK": "1", "WORLD_SIZE": "4"},  # no address: the group has met already
        {"WORLD_SIZE": "4", "LOCAL_RANK": "1"},  # Lightning's children carry no RANK
        {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"},
        {"HVDRUN_RENDEZVOUS_ADDR": "10.0.0.1:5", "HVDRUN_RANK": "1", "HVDRUN_SIZE": "4"},
    ],
)
def test_environment_that_agrees_with_the_group(env: dict[str, str]) -> None:
    check_environment(1, 4, env)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "0", "WORLD_SIZE": "4"}, r"rank 1 of 4, but RANK=0 in the environment"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, r"rank 1 of 4, but WORLD_SIZE=2 in the environment"),
        (
            {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"},
            r"rank 1 of 4, but Open MPI \(mpirun\) says rank 3 of 4",
        ),
        (
            {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8"},
            r"rank 1 of 4, but Slurm \(srun\) says rank 1 of 8",
        ),
        (
            {"HVDRUN_RENDEZVOUS_ADDR": "10.0.0.1:5", "HVDRUN_RANK": "1", "HVDRUN_SIZE": "4",
             "HVDRUN_ELASTIC": "1"},
            "elastic hvdrun job",
        ),
        # Lightning without devices= under hvdrun -np 8: a group of its own, of 4 here
        (
            {"HVDRUN_RENDEZVOUS_ADDR": "10.0.0.1:5", "HVDRUN_RANK": "1", "HVDRUN_SIZE": "8",
             "RANK": "1", "WORLD_SIZE": "8"},
            r"rank 1 of 4, but hvdrun started 8 workers: .*Trainer\(devices=<workers per host>",
        ),
    ],
)  # fmt: skip
def test_environment_that_contradicts_the_group(env: dict[str, str], message: str) -> None:
    with pytest.raises(AdoptionError, match=message):
        check_environment(1, 4, env)


# ---- places exchanged over a real store ------------------------------------------------------


def exchange_all(
    store: dist.Store, hosts: list[str], local_ranks: list[int | None], timeout: float = 30.0
) -> list[list[tuple[str, int | None]]]:
    """Every rank's exchange, each in a thread of its own, as the ranks of a job run it."""
    results: list[list[tuple[str, int | None]]] = [[] for _ in hosts]

    def run(rank: int) -> None:
        results[rank] = exchange_places(
            store, rank, len(hosts), hosts[rank], local_ranks[rank], timeout
        )

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(hosts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return results


def test_exchange_derives_local_and_cross_ranks() -> None:
    store = dist.HashStore()
    hosts = ["a", "b", "a", "b", "a"]  # placed round-robin, a with one rank more
    results = exchange_all(store, hosts, [None] * 5)
    places = [(host, None) for host in hosts]
    assert results == [places] * 5
    topologies = [topology_from(places, rank, None) for rank in range(5)]
    assert topologies == [
        Topology(0, 5, 0, 3, 0, 2),
        Topology(1, 5, 0, 2, 1, 2),
        Topology(2, 5, 1, 3, 0, 2),
        Topology(3, 5, 1, 2, 1, 2),
        Topology(4, 5, 2, 3, 0, 1),
    ]
    # A later hvd.init() (after hvd.shutdown()) meets under fresh keys, with what it says now.
    assert (
        exchange_all(store, ["a"] * 5, [4, 3, 2, 1, 0]) == [[("a", r) for r in (4, 3, 2, 1, 0)]] * 5
    )
    assert topology_from([("a", r) for r in (4, 3, 2, 1, 0)], 0, 5) == Topology(0, 5, 4, 5, 0, 1)


def test_local_ranks_that_cannot_be() -> None:
    with pytest.raises(AdoptionError, match=r"local ranks are not 0..1 \(rank 0: 0, rank 1: 0\)"):
        topology_from([("a", 0), ("a", 0)], 0, None)
    with pytest.raises(AdoptionError, match=r"LOCAL_WORLD_SIZE=4, but 2 rank\(s\) .* host \(a\)"):
        topology_from([("a#agent0", 0), ("a#agent0", 1)], 1, 4)


def test_exchange_names_the_ranks_that_never_come() -> None:
    store = dist.HashStore()
    with pytest.raises(AdoptionError, match=r"2 of the 3 ranks .* within 0.5 s .*: ranks 1, 2\."):
        exchange_places(store, 0, 3, "a", None, timeout=0.5)


# ---- in this process: a group of one (tests/collectives/test_size1.py joins it) -----------


@pytest.fixture
def own_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A default group of one made by "the framework", with no launcher in the environment."""
    for name in list(os.environ):
        if name.startswith(("HVDRUN_", "HOROVOD_")) or name in ("RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        hvd.shutdown()
        dist.destroy_process_group()


def test_contradicting_environment_is_refused(
    own_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under torchrun, a script (or a test fixture) that made a group of its own.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(AdoptionError, match=r"rank 0 of 1, but RANK=1 in the environment"):
        hvd.init()
    assert not hvd.is_initialized() and dist.is_initialized()


# ---- real jobs -------------------------------------------------------------------------------


def test_torchrun_script_that_made_the_group() -> None:
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
    assert "FAIL" not in output, output
    for rank in range(2):
        assert f"ALL OK rank {rank}:" in output, output


def start(size: int, script: str | None = None, **extra: str) -> list[subprocess.Popen[str]]:
    """One process per rank with a Kubernetes-style environment plus ``extra`` (a value may
    hold ``{rank}``); no LOCAL_RANK."""
    procs = []
    for rank in range(size):
        env = clean_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(size))
        env.update({name: value.format(rank=rank) for name, value in extra.items()})
        procs.append(
            subprocess.Popen(
                [sys.executable, script or WORKER],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def test_local_ranks_from_the_hosts_when_no_launcher_says() -> None:
    # Two "hosts" (HVDRUN_HOSTNAME names a worker's host, as hvdrun sets it): one rank each.
    procs = start(
        2, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), HVDRUN_HOSTNAME="pod-{rank}"
    )
    codes, output = finish(procs)
    assert codes == [0, 0], output
    host = socket.gethostname()
    assert identities(output) == {0: (2, 0, 1, 0, 2, host), 1: (2, 0, 1, 1, 2, host)}, output
    for rank in range(2):
        assert f"ALL OK rank {rank}:" in output, output


def test_no_address_to_meet_at_fails_on_every_rank_at_once() -> None:
    # At once: well before HVDRUN_START_TIMEOUT (120 s), or finish() times out.
    codes, output = finish(start(2, str(WORKERS / "joined_worker.py")), timeout=60)
    assert codes == [1, 1], output
    for rank in range(2):
        assert (
            f"started by the RANK/WORLD_SIZE environment as rank {rank} of 2, but there is no "
            "address to meet rank 0 at (MASTER_ADDR is not set)"
        ) in output, output
    assert "ID rank=" not in output, output
