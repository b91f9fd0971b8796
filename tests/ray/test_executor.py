"""RayExecutor on a real local Ray cluster (``ray.init(num_cpus=2)``, started once for the
module): 2 workers join through the executor's rendezvous and run real collectives; a
worker that dies fails the call naming it, and nothing is left behind."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'hvdrun[ray]')")

from collectives.ray import (  # noqa: E402
    PlacementGroupTimeoutError,
    RayExecutor,
    WorkerDiedError,
)
from rendezvous.addresses import split_addr  # noqa: E402
from tests.ray.conftest import head_log_tail  # noqa: E402

NUM_CPUS = 2
#: What every Ray worker inherits here, as from a driver started inside an srun task, an
#: mpirun process or an hvdrun worker: the executor's workers must not keep any of it (the
#: relay address alone makes hvd.init() fail).
INHERITED = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "OMPI_COMM_WORLD_RANK": "1",
    "PMI_RANK": "1",
    "TORCHELASTIC_RUN_ID": "r",
    "MASTER_ADDR": "10.255.255.1",
    "MASTER_PORT": "29555",
    "HVDRUN_RENDEZVOUS_RELAY_ADDR": "unix:/nonexistent/relay.sock",
    "HVDRUN_GENERATION": "7",
    "HVDRUN_WORKER": "5",
    "HVDRUN_ELASTIC": "1",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # The workers unpickle this module's functions by reference: they import it from here.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for attempt in (1, 2):  # (Ray's start-up on a loaded 2-core host: see conftest.py)
        try:
            ray.init(
                num_cpus=NUM_CPUS,
                num_gpus=1,  # Ray's bookkeeping only: no CUDA is used
                include_dashboard=False,
                runtime_env={"env_vars": {"PYTHONPATH": repo, **INHERITED}},
            )
            break
        except Exception as error:  # (Ray raises a bare Exception for a late raylet)
            why = f"{error}\n{head_log_tail()}"
            ray.shutdown()
            if attempt == 2:
                pytest.fail(f"the local Ray cluster did not start, twice: {why}")
    try:
        yield
    finally:
        ray.shutdown()


# ---- what the workers run --------------------------------------------------------------


def allreduce_ranks(scale: float) -> dict[str, Any]:
    import torch

    import collectives.torch as hvd

    hvd.init()
    summed = hvd.allreduce(torch.tensor([(hvd.rank() + 1) * scale]), op=hvd.Sum)
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "sum": summed.item(),
        "pid": os.getpid(),
        "env": {name: os.environ.get(name) for name in ("HOROVOD_RANK", "EXTRA")},
        "has_secret": bool(os.environ.get("HVDRUN_SECRET")),
        "rendezvous": os.environ["HVDRUN_RENDEZVOUS_ADDR"],
    }


class Accumulator:
    """A stateful executable: adds the job's sum of ``step * (rank + 1)`` on each call."""

    def __init__(self, start: float, *, step: float) -> None:
        self.total = start
        self.step = step

    def advance(self) -> float:
        import torch

        import collectives.torch as hvd

        hvd.init()
        mine = torch.tensor([self.step * (hvd.rank() + 1)])
        self.total += hvd.allreduce(mine, op=hvd.Sum).item()
        return self.total


def pid_and_rank() -> tuple[int, int]:
    return os.getpid(), int(os.environ["HVDRUN_RANK"])


def launched_env() -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    env = {name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR")}
    inherited = [name for name, value in INHERITED.items() if os.environ.get(name) == value]
    # A plain torch.distributed script meets at MASTER_ADDR:MASTER_PORT, as under hvdrun.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    try:
        summed = torch.ones(1)
        dist.all_reduce(summed)
        ddp = (dist.get_rank(), dist.get_world_size(), summed.item())
    finally:
        dist.destroy_process_group()
    return {"inherited": sorted(set(inherited) - {"MASTER_PORT"}), "ddp": ddp, **env}


def rank_1_calls_a_helper_actor_that_dies() -> str:
    if os.environ["HVDRUN_RANK"] != "1":
        return "fine"

    @ray.remote(num_cpus=0)
    class Helper:
        def boom(self) -> None:
            os._exit(1)

    # The helper (not the worker) dies: Ray raises an error whose class is RayTaskError
    # and RayActorError at once.
    return ray.get(Helper.remote().boom.remote())  # type: ignore[no-any-return]


def rank_1_dies() -> float:
    import torch

    import collectives.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        os._exit(3)
    return hvd.allreduce(torch.ones(1)).item()


# ---- checks ----------------------------------------------------------------------------


def _eventually(check: Callable[[], bool], what: str, within: float = 30.0) -> None:
    """Waits (boundedly) for ``check()``: Ray reports ends asynchronously."""
    give_up = time.monotonic() + within
    while not check():
        assert time.monotonic() < give_up, what
        time.sleep(0.2)


def _assert_nothing_left(pids: list[int], rendezvous: str | None = None) -> None:
    _eventually(lambda: not any(psutil.pid_exists(pid) for pid in pids), f"actors {pids} live")
    groups = ray.util.placement_group_table().values()
    assert all(group["state"] == "REMOVED" for group in groups), groups
    _eventually(
        lambda: ray.available_resources().get("CPU") == NUM_CPUS, "the workers' CPUs not freed"
    )
    if rendezvous is not None:
        host, port = split_addr(rendezvous)
        with pytest.raises(ConnectionRefusedError), socket.create_connection((host, port), 5):
            pass


def test_run_execute_and_shutdown(cluster: None) -> None:
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=1)
    executor.start(
        executable_cls=Accumulator,
        executable_args=[100.0],
        executable_kwargs={"step": 2.0},
        extra_env_vars={"EXTRA": "x"},
    )
    try:
        results = executor.run(allreduce_ranks, args=[10.0])
        assert [r["rank"] for r in results] == [0, 1]
        assert [r["local_rank"] for r in results] == [0, 1]  # one node: one host
        assert all(r["size"] == 2 and r["local_size"] == 2 for r in results)
        assert [r["sum"] for r in results] == [30.0, 30.0]  # 10 * 1 + 10 * 2
        assert [r["env"]["HOROVOD_RANK"] for r in results] == ["0", "1"]
        assert all(r["env"]["EXTRA"] == "x" and r["has_secret"] for r in results)
        pids = [r["pid"] for r in results]
        assert len(set(pids)) == 2 and os.getpid() not in pids

        # The same processes serve every later call; run_remote hands back the refs.
        again = ray.get(executor.run_remote(allreduce_ranks, kwargs={"scale": 1.0}))
        assert [(r["pid"], r["sum"]) for r in again] == [(pids[0], 3.0), (pids[1], 3.0)]

        # Stateful executables: 100 + 2 * (1 + 2) = 106, then 112 on every rank.
        assert executor.execute(lambda acc: acc.advance()) == [106.0, 106.0]
        assert executor.execute(lambda acc: acc.advance()) == [112.0, 112.0]
        assert executor.execute_single(lambda acc: (os.getpid(), acc.total)) == (pids[0], 112.0)

        # An actor error the function raises is its failure, not its worker's death.
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            executor.run(rank_1_calls_a_helper_actor_that_dies)
        assert isinstance(raised.value, ray.exceptions.RayActorError), raised.value
        assert executor.run(pid_and_rank) == [(pids[0], 0), (pids[1], 1)]
    finally:
        executor.shutdown()
    _assert_nothing_left(pids, results[0]["rendezvous"])
    with pytest.raises(RuntimeError, match="not started"):
        executor.run(pid_and_rank)


def test_workers_get_the_environment_of_a_launched_worker(cluster: None) -> None:
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    executor = RayExecutor(settings, num_workers=2, use_gpu=True, gpus_per_worker=0.5)
    executor.start(extra_env_vars={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        results = executor.run(launched_env)
    finally:
        executor.shutdown()
    assert [r["inherited"] for r in results] == [[], []]
    assert [r["CUDA_VISIBLE_DEVICES"] for r in results] == ["1", "1"]  # extra_env_vars win
    assert [r["ddp"] for r in results] == [(0, 2, 2.0), (1, 2, 2.0)]
    assert [r["MASTER_ADDR"] for r in results] == ["127.0.0.1"] * 2  # rank 0's node, local


def test_a_dead_worker_fails_run_naming_it_and_leaves_nothing(cluster: None) -> None:
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    # One host with two workers: Horovod's colocated layout (one bundle, STRICT_SPREAD).
    executor = RayExecutor(settings, num_hosts=1, num_workers_per_host=2)
    executor.start()
    try:
        placed = executor.run(pid_and_rank)
        assert [rank for _, rank in placed] == [0, 1]
        with pytest.raises(
            WorkerDiedError, match=r"worker rank 1 \(Ray actor [0-9a-f]+ on"
        ) as info:
            executor.run(rank_1_dies)
        assert info.value.rank == 1 and info.value.actor_id in str(info.value)
    finally:
        executor.shutdown()
    _assert_nothing_left([pid for pid, _ in placed])


def test_an_unschedulable_placement_group_names_the_request(cluster: None) -> None:
    settings = RayExecutor.create_settings(placement_group_timeout_s=1)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=8)
    with pytest.raises(PlacementGroupTimeoutError) as info:
        executor.start()
    message = str(info.value)
    assert "2 bundle(s) of {'CPU': 8.0} (strategy PACK)" in message, message
    assert "within 1 s" in message and "free {'CPU': 2.0}" in message, message
    _assert_nothing_left([])
