"""RayExecutor: Horovod's ``horovod.ray.RayExecutor`` on hvdrun's own rendezvous.

How a job comes up (:meth:`RayExecutor.start`):

1. A placement group reserves the workers' resources (:func:`.placement.plan_bundles`);
   one that Ray cannot schedule within ``placement_group_timeout_s`` is removed again and
   the error names what was asked for and what the cluster has free.
2. One actor per worker starts in its bundle and reports its node.
3. The executor, in the driver's process, serves the job's
   :class:`~rendezvous.server.RendezvousServer` with the slot table of those nodes, a fresh
   secret and job id and, when a worker runs on another node, the job's TLS certificate,
   as ``hvdrun`` does for a job it launches.
4. Each actor takes on the environment an ``hvdrun`` worker gets (:mod:`.worker`), so
   ``hvd.init()`` inside :meth:`~RayExecutor.run` joins through the rendezvous unchanged.

A job ends with its executor: :meth:`RayExecutor.shutdown` kills the actors, removes the
placement group and stops the server. The same happens when a worker dies while the
executor waits on it: the call fails with :class:`WorkerDiedError`, naming the rank and the
actor, and leaves nothing behind. An exception raised by the user's function reaches the
caller as Ray raises it (the executor keeps running, as Horovod's does).
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from collectives.ray.placement import (
    BundlePlan,
    WorkerNode,
    plan_bundles,
    plan_server,
    slot_table,
    visible_devices,
)
from collectives.ray.worker import RayWorker
from rendezvous import worker_env
from rendezvous.addresses import join_addr
from rendezvous.server import RendezvousServer
from rendezvous.tls import certificate_for

__all__ = [
    "PlacementGroupTimeoutError",
    "RayExecutor",
    "RayExecutorSettings",
    "WorkerDiedError",
]

logger = logging.getLogger(__name__)

#: How long a worker's failure waits for the others' results, to blame a peer that died
#: (a collective fails on the survivors as soon as a peer's process is gone).
PEER_DEATH_GRACE_SECONDS = 2.0
#: How long :meth:`RayExecutor.shutdown` waits for Ray to confirm each actor's end.
SHUTDOWN_WAIT_SECONDS = 10.0

#: The variables the executor sets on every worker; ``extra_env_vars`` may not set them.
RESERVED_VARIABLES = worker_env.LAUNCHER_SET


class WorkerDiedError(RuntimeError):
    """A worker's actor died while the executor waited on it; the executor has shut down."""

    def __init__(self, message: str, rank: int, actor_id: str, node: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.actor_id = actor_id
        self.node = node


class PlacementGroupTimeoutError(TimeoutError):
    """Ray could not reserve the job's resources within ``placement_group_timeout_s``."""


@dataclass
class RayExecutorSettings:
    """The settings :meth:`RayExecutor.create_settings` makes (Horovod's ``MiniSettings``).

    ``timeout_s`` bounds each start-up step of :meth:`RayExecutor.start` (the workers'
    actors reporting in, taking on their environment); ``placement_group_timeout_s`` bounds
    the wait for the placement group; ``nics`` become ``GLOO_SOCKET_IFNAME``. SSH settings
    are accepted for Horovod's signature and not used: Ray already reaches every node."""

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    nics: set[str] | None = None
    ssh_identity_file: str | None = None
    verbose: int = 1
    elastic: bool = False


def _positive(name: str, value: float | None) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
    ):
        raise ValueError(f"RayExecutor: {name} must be a positive number, got {value!r}")


class RayExecutor:
    """A Horovod job on Ray actors (``horovod.ray.RayExecutor``'s interface).

    Give ``num_workers`` (packed onto as few nodes as fit) or ``num_hosts`` x
    ``num_workers_per_host`` (the same number on each of ``num_hosts`` distinct nodes).
    Each worker reserves ``cpus_per_worker`` CPUs and, with ``use_gpu``,
    ``gpus_per_worker`` GPUs (default 1). Inside an existing placement group (Ray Tune)
    the workers use it, as Horovod's do, unless ``use_current_placement_group=False``.

    Horovod's elastic arguments (``min_workers``, ``max_workers``) are refused: there is
    no ``ElasticRayExecutor`` here (``hvdrun --min-np/--max-np`` runs elastic jobs).
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: set[str] | None = None,
    ) -> RayExecutorSettings:
        """Horovod's settings factory; ``ssh_str`` (a private key) is not written anywhere."""
        _positive("timeout_s", timeout_s)
        _positive("placement_group_timeout_s", placement_group_timeout_s)
        return RayExecutorSettings(
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=set(nics) if nics else None,
            ssh_identity_file=ssh_identity_file,
        )

    def __init__(
        self,
        settings: RayExecutorSettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Sequence[int] | None = None,
        elastic_timeout: int = 600,
        override_discovery: bool = True,
    ) -> None:
        if min_workers is not None or max_workers is not None:
            raise NotImplementedError(
                "RayExecutor: elastic Ray jobs (min_workers/max_workers, Horovod's "
                "ElasticRayExecutor) are not supported; run elastic jobs with "
                "hvdrun --min-np/--max-np"
            )
        if (num_workers is None) == (num_hosts is None):
            raise ValueError(
                "RayExecutor: give num_workers, or num_hosts with num_workers_per_host "
                f"(got num_workers={num_workers!r}, num_hosts={num_hosts!r})"
            )
        for name, value in (
            ("num_workers", num_workers),
            ("num_hosts", num_hosts),
            ("num_workers_per_host", num_workers_per_host),
        ):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive integer, got {value!r}")
        _positive("cpus_per_worker", cpus_per_worker)
        if gpus_per_worker and not use_gpu:
            raise ValueError(
                f"RayExecutor: gpus_per_worker={gpus_per_worker!r} needs use_gpu=True (without "
                "it the workers reserve no GPU)"
            )
        if use_gpu:
            _positive("gpus_per_worker", gpus_per_worker)
        self.settings = settings if settings is not None else self.create_settings()
        self.num_workers = num_workers or num_workers_per_host * (num_hosts or 0)
        self.use_gpu = use_gpu
        gpus = (1 if gpus_per_worker is None else gpus_per_worker) if use_gpu else 0
        self._plan = plan_bundles(
            num_workers, num_hosts, num_workers_per_host, cpus_per_worker, gpus
        )
        self._cpus = float(cpus_per_worker)
        self._gpus = float(gpus)
        self._use_current_group = use_current_placement_group
        self._group: PlacementGroup | None = None
        self._owns_group = False
        self._workers: list[Any] = []  # actor handles, by rank
        self._nodes: list[WorkerNode] = []
        self._server: RendezvousServer | None = None

    # ---- starting ------------------------------------------------------------------------

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[Any] | None = None,
        executable_kwargs: Mapping[str, Any] | None = None,
        extra_env_vars: Mapping[str, Any] | None = None,
    ) -> None:
        """Starts the workers and their rendezvous; ``executable_cls(*executable_args,
        **executable_kwargs)`` is then created on every worker (for :meth:`execute`), and
        ``extra_env_vars`` are set in every worker's environment before that."""
        if self._workers:
            raise RuntimeError("RayExecutor.start(): already started; call shutdown() first")
        extra = {name: str(value) for name, value in (extra_env_vars or {}).items()}
        clash = sorted(RESERVED_VARIABLES & set(extra))
        if clash:
            raise ValueError(
                f"RayExecutor.start(): extra_env_vars may not set {', '.join(clash)}: the "
                "executor sets them for each worker"
            )
        initialized = not ray.is_initialized()
        if initialized:
            ray.init()  # RAY_ADDRESS=ray://... connects through Ray Client here
        if ray.util.client.ray.is_connected():
            if initialized:
                ray.shutdown()
            raise RuntimeError(
                "RayExecutor: Ray Client (ray://) is not supported; run the driver on a node "
                "of the Ray cluster (the workers dial the rendezvous it serves)"
            )
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra)
        except BaseException:
            self.shutdown()
            raise

    def _start(
        self,
        executable_cls: type | None,
        executable_args: Sequence[Any] | None,
        executable_kwargs: Mapping[str, Any] | None,
        extra: dict[str, str],
    ) -> None:
        timeout = self.settings.timeout_s
        self._workers = self._create_actors(self._place())
        self._nodes = self._gather(
            [worker.node.remote() for worker in self._workers], "start()", timeout
        )
        slots = slot_table(self._nodes)
        plan = plan_server(ray.util.get_node_ip_address(), [node.ip for node in self._nodes])
        secret = worker_env.new_secret()
        job_id = worker_env.new_job_id()
        tls = certificate_for(plan.bind_host, job_id)
        self._server = RendezvousServer(slots, secret, job_id, bind_host=plan.bind_host, tls=tls)
        addr = join_addr(plan.dial_host, self._server.start())
        cert = tls.cert_pem.decode("ascii") if tls is not None else ""
        common = {**self._master_env(addr, extra), **extra}
        if self.settings.nics and "GLOO_SOCKET_IFNAME" not in common:
            common["GLOO_SOCKET_IFNAME"] = ",".join(sorted(self.settings.nics))
        common.update(worker_env.connection_env(addr, job_id, secret, cert))
        devices = visible_devices(slots, self._nodes)
        calls = []
        for worker, slot, device in zip(self._workers, slots, devices, strict=True):
            env = {**common, **worker_env.slot_env(slot)}
            if self.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = device
            env.update(extra)  # last: the user's win, as in horovod.ray (none is reserved)
            calls.append(worker.setup.remote(env))
        self._gather(calls, "start()", timeout)
        logger.info(
            "started %d Ray workers on %d node(s); rendezvous at %s",
            len(slots),
            len({slot.hostname for slot in slots}),
            addr,
        )
        self._gather(
            [
                worker.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                for worker in self._workers
            ],
            "start()",
        )

    def _master_env(self, rendezvous_addr: str, extra: Mapping[str, str]) -> dict[str, str]:
        """``MASTER_ADDR``/``MASTER_PORT`` as ``hvdrun`` sets them, picked on rank 0's node;
        none when ``extra_env_vars`` set both (one set there wins over the picked one)."""
        names = (worker_env.TORCH_MASTER_ADDR, worker_env.TORCH_MASTER_PORT)
        if all(name in extra for name in names):
            return {}
        picked = self._workers[0].pick_master.remote(rendezvous_addr)
        address, port = self._gather([picked], "start()", self.settings.timeout_s)[0]
        return worker_env.master_env(address, port)

    def _place(self) -> PlacementGroup:
        """Reserves the job's resources: the current placement group, or a new one."""
        current = get_current_placement_group() if self._use_current_group else None
        if current is not None:
            logger.info("using the current placement group (use_current_placement_group)")
            self._group = current
            return current
        plan = self._plan
        group = self._group = placement_group(plan.bundles, strategy=plan.strategy)
        self._owns_group = True
        waited = self.settings.placement_group_timeout_s
        if not group.wait(timeout_seconds=waited):
            raise PlacementGroupTimeoutError(_unschedulable(plan, waited))
        return group

    def _create_actors(self, group: PlacementGroup) -> list[Any]:
        actor = ray.remote(RayWorker)
        created = []
        for index in range(self.num_workers):
            bundle = self._plan.bundle_of_worker[index] if self._owns_group else -1
            strategy = PlacementGroupSchedulingStrategy(
                group,
                placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=False,
            )
            options: dict[str, Any] = {"num_cpus": self._cpus, "scheduling_strategy": strategy}
            if self._gpus:
                options["num_gpus"] = self._gpus
            created.append(actor.options(**options).remote())
        return created

    # ---- running -------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order."""
        _no_callbacks(callbacks)
        self._started("run()")
        return self._gather(self.run_remote(fn, args, kwargs), "run()")

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """Starts ``fn(*args, **kwargs)`` on every worker; its ``ObjectRef``\\ s, by rank."""
        workers = self._started("run_remote()")
        return [worker.run.remote(fn, list(args or ()), dict(kwargs or {})) for worker in workers]

    def execute(
        self,
        fn: Callable[[Any], Any],
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""
        _no_callbacks(callbacks)
        workers = self._started("execute()")
        return self._gather([worker.execute.remote(fn) for worker in workers], "execute()")

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only; its result."""
        worker = self._started("execute_single()")[0]
        return self._gather([worker.execute.remote(fn)], "execute_single()")[0]

    def _started(self, what: str) -> list[Any]:
        if not self._workers:
            raise RuntimeError(f"RayExecutor.{what}: the executor is not started; call start()")
        return self._workers

    def _gather(self, refs: list[Any], what: str, timeout: float | None = None) -> list[Any]:
        """The results of ``refs`` (``refs[i]`` from rank ``i``), failing at the first
        error: a dead worker shuts the executor down (:class:`WorkerDiedError`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: list[Any] = [None] * len(refs)
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(
                    f"RayExecutor.{what}: rank(s) {sorted(pending.values())} did not answer "
                    f"within {timeout:g} s (RayExecutor.create_settings(timeout_s=...))"
                )
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayTaskError:
                # First: the user's function raised, maybe an actor error of its own (Ray's
                # class for it subclasses both), which is not this worker's death.
                self._blame_dead_peer(pending, what)
                raise
            except ray.exceptions.RayActorError as error:
                if not _worker_died(error):
                    raise
                raise self._died(rank, error, what) from error
        return results

    def _blame_dead_peer(self, pending: dict[Any, int], what: str) -> None:
        """A worker's function failed: if another worker died meanwhile (the likely cause:
        a collective fails as soon as a peer is gone), raises that death instead."""
        if not pending:
            return
        ready, _ = ray.wait(
            list(pending), num_returns=len(pending), timeout=PEER_DEATH_GRACE_SECONDS
        )
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as error:
                if _worker_died(error):
                    raise self._died(pending[ref], error, what) from error

    def _died(self, rank: int, error: BaseException, what: str) -> WorkerDiedError:
        node = self._nodes[rank] if rank < len(self._nodes) else None
        actor_id = node.actor_id if node is not None else "unknown"
        where = node.ip if node is not None else "unknown"
        text = str(error).strip()
        reason = text.splitlines()[0].rstrip(".") if text else type(error).__name__
        self.shutdown()
        return WorkerDiedError(
            f"RayExecutor.{what}: worker rank {rank} (Ray actor {actor_id} on node {where}) "
            f"died: {reason}. The executor has shut down: every worker's actor was killed and "
            "the placement group removed",
            rank,
            actor_id,
            where,
        )

    # ---- stopping ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kills every worker's actor, removes the placement group the executor created and
        stops the rendezvous; the executor can be started again."""
        workers, self._workers = self._workers, []
        self._nodes = []
        for worker in workers:
            with contextlib.suppress(Exception):
                ray.kill(worker, no_restart=True)
        _await_ends(workers)
        group, self._group = self._group, None
        if group is not None and self._owns_group:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self._owns_group = False
        server, self._server = self._server, None
        if server is not None:
            server.stop()


def _worker_died(error: BaseException) -> bool:
    """Whether ``error`` says the worker's own actor died: a RayActorError that the user's
    function did not raise (a RayTaskError is that, whatever else its class is) and that
    is not transient (ActorUnavailableError: the actor may still answer)."""
    return isinstance(error, ray.exceptions.RayActorError) and not isinstance(
        error, (ray.exceptions.RayTaskError, ray.exceptions.ActorUnavailableError)
    )


def _await_ends(workers: Sequence[Any]) -> None:
    """Waits (boundedly) until Ray reports each killed actor gone."""
    if not workers:
        return
    with contextlib.suppress(Exception):
        probes = [worker.node.remote() for worker in workers]
        ray.wait(probes, num_returns=len(probes), timeout=SHUTDOWN_WAIT_SECONDS)


def _unschedulable(plan: BundlePlan, waited: float) -> str:
    asked = sorted({name for bundle in plan.bundles for name in bundle})
    try:
        available = ray.available_resources()
        free = {name: available.get(name, 0.0) for name in asked}
    except Exception:  # the cluster's view is only a hint here
        free = {}
    return (
        f"RayExecutor.start(): Ray could not reserve {plan.describe()} within {waited:g} s "
        f"(placement_group_timeout_s); the cluster has free {free}. Ask for fewer workers "
        "or resources per worker, or add nodes (an autoscaling cluster adds them)"
    )


def _no_callbacks(callbacks: Sequence[Callable[..., Any]] | None) -> None:
    if callbacks:
        warnings.warn(
            "RayExecutor: callbacks are not called (Horovod's RayExecutor calls them only in "
            "elastic jobs, which are not supported here)",
            stacklevel=3,
        )
