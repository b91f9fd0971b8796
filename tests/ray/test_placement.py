"""RayExecutor's decisions without a Ray cluster: bundles, the slot table of the nodes the
workers landed on, where the rendezvous listens, GPUs, and the arguments it refuses."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'hvdrun[ray]')")

from collectives.ray import RayExecutor
from collectives.ray.placement import (
    WorkerNode,
    host_names,
    plan_bundles,
    plan_server,
    slot_table,
    visible_devices,
)


def node(node_id: str, ip: str, gpus: tuple[str, ...] = ()) -> WorkerNode:
    return WorkerNode(node_id, ip, pid=1, actor_id="a" + node_id, gpu_ids=gpus)


def test_num_workers_packs_one_bundle_per_worker() -> None:
    plan = plan_bundles(3, None, 1, cpus_per_worker=2, gpus_per_worker=0)
    assert plan.bundles == [{"CPU": 2.0}] * 3
    assert plan.strategy == "PACK" and plan.bundle_of_worker == [0, 1, 2]


def test_num_hosts_spreads_one_bundle_per_host() -> None:
    plan = plan_bundles(None, 2, 3, cpus_per_worker=1, gpus_per_worker=1)
    assert plan.bundles == [{"CPU": 3.0, "GPU": 3.0}] * 2
    assert plan.strategy == "STRICT_SPREAD"
    assert plan.bundle_of_worker == [0, 0, 0, 1, 1, 1]
    assert plan.describe() == "2 bundle(s) of {'CPU': 3.0, 'GPU': 3.0} (strategy STRICT_SPREAD)"


def test_ranks_follow_the_workers_and_local_ranks_count_each_node() -> None:
    nodes = [node("n1", "10.0.0.1"), node("n2", "10.0.0.2"), node("n1", "10.0.0.1")]
    slots = slot_table(nodes)
    assert [(s.rank, s.hostname, s.local_rank, s.local_size) for s in slots] == [
        (0, "10.0.0.1", 0, 2),
        (1, "10.0.0.2", 0, 1),
        (2, "10.0.0.1", 1, 2),
    ]
    assert [(s.cross_rank, s.cross_size) for s in slots] == [(0, 2), (1, 2), (0, 1)]


def test_nodes_that_share_an_ip_stay_distinct_hosts() -> None:
    names = host_names([node("aaaa", "10.0.0.1"), node("bbbb", "10.0.0.1")])
    assert names == ["10.0.0.1-aaaa", "10.0.0.1-bbbb"]
    assert [s.local_rank for s in slot_table([node("aaaa", "ip"), node("bbbb", "ip")])] == [0, 0]


def test_the_rendezvous_stays_on_loopback_only_when_every_worker_is_local() -> None:
    local = plan_server("10.0.0.1", ["10.0.0.1", "10.0.0.1"])
    assert (local.bind_host, local.dial_host) == ("127.0.0.1", "127.0.0.1")
    remote = plan_server("10.0.0.1", ["10.0.0.1", "10.0.0.2"])
    assert (remote.bind_host, remote.dial_host) == ("0.0.0.0", "10.0.0.1")
    assert plan_server("fd00::1", ["fd00::2"]).bind_host == "::"


def test_each_node_sees_its_gpus_in_local_rank_order() -> None:
    nodes = [node("n1", "a", ("3",)), node("n2", "b", ("0",)), node("n1", "a", ("1",))]
    assert visible_devices(slot_table(nodes), nodes) == ["3,1", "0", "3,1"]


def test_workers_that_share_a_gpu_see_it_once() -> None:
    # gpus_per_worker=0.5: Ray gives two workers each GPU; CUDA takes "0,0,1,1" as no GPU.
    nodes = [node("n1", "a", (gpu,)) for gpu in ("0", "0", "1", "1")]
    assert visible_devices(slot_table(nodes), nodes) == ["0,1"] * 4


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_workers": 2, "num_hosts": 1}, ValueError, "give num_workers, or num_hosts"),
        ({}, ValueError, "give num_workers, or num_hosts"),
        ({"num_workers": 0}, ValueError, "num_workers must be a positive integer, got 0"),
        ({"num_workers": 2, "cpus_per_worker": 0}, ValueError, "cpus_per_worker must be a posi"),
        # (a string was compared with 0 and raised a TypeError of Python's own)
        ({"num_workers": 2, "cpus_per_worker": "1"}, ValueError, "positive number, got '1'"),
        ({"min_workers": 1, "max_workers": 4}, NotImplementedError, "ElasticRayExecutor"),
        ({"num_workers": 2, "gpus_per_worker": 1}, ValueError, "gpus_per_worker=1 needs use_gpu"),
        (
            {"num_workers": 2, "use_gpu": True, "gpus_per_worker": 0},
            ValueError,
            "gpus_per_worker must be a positive number, got 0",
        ),
    ],
)
def test_bad_arguments_are_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        RayExecutor(RayExecutor.create_settings(), **kwargs)


def test_extra_env_vars_cannot_override_the_job_placement() -> None:
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    with pytest.raises(ValueError, match="may not set HVDRUN_SECRET, RANK"):
        executor.start(extra_env_vars={"RANK": 3, "HVDRUN_SECRET": "x", "OK": 1})
    with pytest.raises(RuntimeError, match=r"execute\(\): the executor is not started"):
        executor.execute(lambda worker: None)
    with pytest.raises(RuntimeError, match=r"RayExecutor\.run\(\): the executor is not started"):
        executor.run(print)


def test_ray_client_is_refused_also_when_start_connects_through_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # RAY_ADDRESS=ray://... and no ray.init(): start()'s own ray.init() connects via Ray Client.
    import ray

    connected: list[str] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(connected))
    monkeypatch.setattr(ray, "init", lambda *a, **k: connected.append("ray://"))
    monkeypatch.setattr(ray, "shutdown", lambda *a, **k: connected.clear())
    monkeypatch.setattr(ray.util.client.ray, "is_connected", lambda: bool(connected))

    def not_refused(*args: object) -> None:
        raise AssertionError("start() went on through Ray Client")

    monkeypatch.setattr(RayExecutor, "_start", not_refused)
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    with pytest.raises(RuntimeError, match=r"Ray Client \(ray://\) is not supported"):
        executor.start()
    assert connected == []  # start() disconnects what it connected
