"""Where a Ray job's workers go and how they meet: pure decisions, no Ray calls.

Kept apart from the executor so that each decision is a small function a unit test can
check without a Ray cluster:

* :func:`plan_bundles` -- the placement group Horovod's executor asks for: one bundle per
  worker packed together (``num_workers``), or one bundle per host spread over distinct
  nodes (``num_hosts`` x ``num_workers_per_host``);
* :func:`host_names` and :func:`slot_table` -- the job's slot table from the Ray node each
  worker landed on: ranks follow the workers' order, as in Horovod, and the workers of one
  node number their local ranks 0, 1, ... in rank order;
* :func:`plan_server` -- where the rendezvous listens: on loopback, in clear text, when
  every worker shares the driver's node; otherwise on every interface with the job's TLS
  certificate, as ``hvdrun`` serves a multi-host job;
* :func:`visible_devices` -- each node's GPUs in local-rank order, so that local rank ``k``
  finds its own GPU at CUDA index ``k`` (the runtime selects that device); a GPU that
  several workers share (fractional ``gpus_per_worker``) is listed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rendezvous.addresses import is_ipv6
from rendezvous.slots import SlotInfo, derive_slots
from rendezvous.slots import visible_devices as host_devices

__all__ = [
    "BundlePlan",
    "ServerPlan",
    "WorkerNode",
    "host_names",
    "plan_bundles",
    "plan_server",
    "slot_table",
    "visible_devices",
]


@dataclass(frozen=True)
class BundlePlan:
    """The placement group to create, and which bundle each worker (by rank) runs in."""

    bundles: list[dict[str, float]]
    strategy: str
    bundle_of_worker: list[int]

    def describe(self) -> str:
        """The request in words, for errors: ``2 bundles of {'CPU': 1.0} (PACK)``."""
        shapes = {str(bundle) for bundle in self.bundles}
        shape = shapes.pop() if len(shapes) == 1 else ", ".join(map(str, self.bundles))
        return f"{len(self.bundles)} bundle(s) of {shape} (strategy {self.strategy})"


@dataclass(frozen=True)
class WorkerNode:
    """What a started worker reports about the Ray node it runs on."""

    node_id: str
    ip: str
    pid: int
    actor_id: str
    gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServerPlan:
    """Where the executor's rendezvous listens and the host its workers dial."""

    bind_host: str
    dial_host: str


def _resources(cpus: float, gpus: float) -> dict[str, float]:
    resources = {"CPU": float(cpus)}
    if gpus:
        resources["GPU"] = float(gpus)
    return resources


def plan_bundles(
    num_workers: int | None,
    num_hosts: int | None,
    num_workers_per_host: int,
    cpus_per_worker: float,
    gpus_per_worker: float,
) -> BundlePlan:
    """The placement group of a job, as Horovod's ``RayExecutor`` asks for it.

    ``num_workers``: one bundle per worker, ``PACK`` (Ray fills nodes one after another).
    ``num_hosts`` x ``num_workers_per_host``: one bundle per host holding all its workers,
    ``STRICT_SPREAD`` (every bundle on its own node), so every host runs the same number.
    ``gpus_per_worker`` is 0 for a CPU job."""
    if num_workers is not None:
        bundle = _resources(cpus_per_worker, gpus_per_worker)
        return BundlePlan(
            [dict(bundle) for _ in range(num_workers)], "PACK", list(range(num_workers))
        )
    assert num_hosts is not None
    per_host = num_workers_per_host
    bundle = _resources(cpus_per_worker * per_host, gpus_per_worker * per_host)
    return BundlePlan(
        [dict(bundle) for _ in range(num_hosts)],
        "STRICT_SPREAD",
        [index // per_host for index in range(num_hosts * per_host)],
    )


def host_names(nodes: Sequence[WorkerNode]) -> list[str]:
    """Each worker's host name in the job: its node's IP, made unique with the node id where
    several Ray nodes share an IP (a test cluster on one machine)."""
    ids_of_ip: dict[str, set[str]] = {}
    for node in nodes:
        ids_of_ip.setdefault(node.ip, set()).add(node.node_id)
    return [
        node.ip if len(ids_of_ip[node.ip]) == 1 else f"{node.ip}-{node.node_id[:12]}"
        for node in nodes
    ]


def slot_table(nodes: Sequence[WorkerNode]) -> list[SlotInfo]:
    """The job's slots: rank ``i`` is worker ``i``; local ranks count each node's workers."""
    hosts = host_names(nodes)
    return derive_slots(hosts, [None] * len(hosts))


def plan_server(driver_ip: str, worker_ips: Sequence[str]) -> ServerPlan:
    """Loopback when every worker runs on the driver's node; otherwise every interface, and
    the driver's node IP to dial (the server then speaks TLS:
    :func:`rendezvous.tls.certificate_for`)."""
    if all(ip == driver_ip for ip in worker_ips):
        loopback = "::1" if is_ipv6(driver_ip) else "127.0.0.1"
        return ServerPlan(loopback, loopback)
    return ServerPlan("::" if is_ipv6(driver_ip) else "0.0.0.0", driver_ip)


def visible_devices(slots: Sequence[SlotInfo], nodes: Sequence[WorkerNode]) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` for each worker: the GPUs Ray gave its node's workers, in
    local-rank order (one GPU per worker: local rank ``k`` uses CUDA device ``k``)."""
    return host_devices(slots, [node.gpu_ids for node in nodes])
