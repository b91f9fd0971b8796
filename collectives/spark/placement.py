"""Where a Spark job's ranks go and how its tasks meet the driver: pure decisions, no Spark.

Kept apart from the driver so that each decision is a small function a unit test checks
without a cluster:

* :func:`executor_of` -- which executor a task runs in, from the command lines of its
  process's ancestors (the executor's JVM is started with ``--executor-id`` and
  ``--hostname``); a task of a ``local[...]`` master runs in the driver's JVM;
* :func:`slot_table` -- the job's slots: the tasks of one executor host take consecutive
  ranks, hosts in the order of their lowest partition and tasks by partition within a host,
  so that ``local_rank`` and ``cross_rank`` mean what they mean under ``hvdrun``;
* :func:`visible_devices` -- ``CUDA_VISIBLE_DEVICES`` from the GPUs Spark gave each task:
  the host's GPUs in local-rank order, so local rank ``k`` finds its own at CUDA index ``k``;
* :func:`worker_devices` -- the CUDA indices, inside a worker, of the GPUs Spark gave its
  task (what :func:`collectives.spark.task.get_available_devices` returns);
* :func:`plan_server` -- where the driver listens: on loopback, in clear text, for a
  ``local[...]`` master (every task runs in the driver's process tree); otherwise on every
  interface (or ``spark.driver.bindAddress``) with the job's TLS certificate, dialled at
  ``spark.driver.host``, the address executors already use to reach the driver;
* :func:`resolve_timeout` (:func:`resolve_start_timeout`) and :func:`elastic_host` -- a
  timeout from its argument, else Horovod's variable, else its default; and the host name
  each task attempt of an elastic job joins under (one host per attempt).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rendezvous.addresses import is_ipv6
from rendezvous.slots import SlotInfo, assign_slots
from rendezvous.slots import visible_devices as host_devices

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "START_TIMEOUT_VARIABLE",
    "ServerPlan",
    "TaskReport",
    "elastic_host",
    "executor_of",
    "plan_server",
    "resolve_start_timeout",
    "resolve_timeout",
    "slot_table",
    "visible_devices",
    "worker_devices",
]

#: Horovod's variable and default for how long the tasks may take to start.
START_TIMEOUT_VARIABLE = "HOROVOD_SPARK_START_TIMEOUT"
DEFAULT_START_TIMEOUT = 600.0
#: The executor id Spark gives the driver's JVM, which runs the tasks of a local master.
DRIVER_EXECUTOR = "driver"


@dataclass(frozen=True)
class TaskReport:
    """What a Spark task says about itself when it reaches the driver."""

    partition: int
    attempt: int
    executor: str  # the executor id ("driver" in local mode)
    host: str  # the executor's host as Spark knows it
    gpus: tuple[str, ...] = ()  # the GPU addresses Spark gave the task
    pid: int = 0  # the task's Python worker

    def where(self) -> str:
        """``executor 1 on 10.0.0.5`` (for messages)."""
        return f"executor {self.executor} on {self.host}"


@dataclass(frozen=True)
class ServerPlan:
    """Where the driver's servers listen and the host the tasks dial."""

    bind_host: str
    dial_host: str


def _flag(argv: Sequence[str], name: str) -> str | None:
    for index, arg in enumerate(argv):
        if arg == name and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def executor_of(ancestors: Sequence[Sequence[str]]) -> tuple[str, str | None]:
    """(executor id, executor host or None) from the command lines of a task's ancestors,
    nearest first: the first JVM started with ``--executor-id``; the driver's otherwise."""
    for argv in ancestors:
        executor = _flag(argv, "--executor-id")
        if executor is not None:
            return executor, _flag(argv, "--hostname")
    return DRIVER_EXECUTOR, None


def slot_table(reports: Sequence[TaskReport]) -> list[SlotInfo]:
    """Each task's slot, indexed like ``reports`` (by partition): the tasks of one host
    take consecutive ranks, hosts ordered by their lowest partition, tasks by partition."""
    order = sorted(range(len(reports)), key=lambda i: reports[i].partition)
    hosts: dict[str, list[int]] = {}
    for index in order:
        hosts.setdefault(reports[index].host, []).append(index)
    slots = assign_slots([(host, len(tasks)) for host, tasks in hosts.items()], len(reports))
    by_index: list[SlotInfo | None] = [None] * len(reports)
    ranked = (index for tasks in hosts.values() for index in tasks)
    for slot, index in zip(slots, ranked, strict=True):
        by_index[index] = slot
    return [slot for slot in by_index if slot is not None]


def visible_devices(reports: Sequence[TaskReport], slots: Sequence[SlotInfo]) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` for each task (None: leave it alone, Spark gave the task no
    GPUs): the GPUs of the task's host, in local-rank order."""
    if not all(report.gpus for report in reports):
        return [None] * len(reports)
    return list(host_devices(slots, [report.gpus for report in reports]))


def worker_devices(assigned: Sequence[str], visible: str | None) -> list[str]:
    """The CUDA indices, in a worker whose ``CUDA_VISIBLE_DEVICES`` is ``visible``, of the
    GPUs that Spark ``assigned`` its task (Spark's addresses, the host's numbering): each
    address's position in ``visible``. An address that ``visible`` does not list (or
    ``visible`` unset or empty: the worker sees the host's GPUs by their own numbers) is
    returned as it is."""
    order = [device.strip() for device in (visible or "").split(",") if device.strip()]
    return [str(order.index(address)) if address in order else address for address in assigned]


def plan_server(master: str, driver_host: str, bind_address: str | None = None) -> ServerPlan:
    """Loopback for a ``local[...]`` master; otherwise ``bind_address`` (every interface by
    default) dialled at ``driver_host``: the servers then speak TLS
    (:func:`rendezvous.tls.certificate_for`)."""
    if master == "local" or master.startswith("local["):
        loopback = "::1" if is_ipv6(driver_host) else "127.0.0.1"
        return ServerPlan(loopback, loopback)
    bind = bind_address or ("::" if is_ipv6(driver_host) else "0.0.0.0")
    return ServerPlan(bind, driver_host)


def resolve_timeout(
    name: str,
    value: float | None,
    variable: str,
    default: float,
    env: Mapping[str, str] | None = None,
) -> float:
    """Seconds: ``value``, else the variable ``variable`` (unset or empty: ``default``);
    ValueError naming ``name`` (or ``variable``) when not a positive number."""
    source = os.environ if env is None else env
    raw: object = value
    if value is None:
        raw = source.get(variable) or default
    try:
        seconds = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0:
        where = name if value is not None else variable
        raise ValueError(f"{where} must be a positive number of seconds, got {raw!r}")
    return seconds


def resolve_start_timeout(value: float | None, env: Mapping[str, str] | None = None) -> float:
    """``value``, else ``HOROVOD_SPARK_START_TIMEOUT``, else 600 s; ValueError when not
    a positive number."""
    return resolve_timeout(
        "start_timeout", value, START_TIMEOUT_VARIABLE, DEFAULT_START_TIMEOUT, env
    )


def elastic_host(report: TaskReport) -> str:
    """The host name a task attempt of an elastic job joins under: each attempt is a host
    of its own (one slot), so a retried task is a new host, as in Horovod on Spark."""
    return f"{report.host}-task{report.partition}.{report.attempt}"
