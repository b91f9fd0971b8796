"""horovodrun's flags that hvdrun accepts for compatibility, and what becomes of each.

A command line copied from Horovod's documentation must work unchanged. Three kinds of flags:

* **Real here**: ``--gloo`` (what hvdrun always does), ``--gloo-timeout-seconds`` (how long a
  collective waits for a peer), ``--disable-cache`` (horovodrun caches its host checks for an
  hour unless given; hvdrun never caches them, so the flag asks for what already happens).
* **Passed on, no effect yet**: ``--hierarchical-allreduce``, ``--hierarchical-allgather``,
  ``--torus-allreduce``, ``--num-nccl-streams``, ``--thread-affinity`` (and its older
  spellings ``--ccl-bgt-affinity``, ``--mlsl-bgt-affinity``, hidden),
  ``--mpi-threads-disable`` reach every worker under Horovod's ``HOROVOD_*`` names, and
  hvdrun says once that the runtime ignores them.
* **Real here**, too: ``--tcp``, which (as horovodrun does for Gloo jobs as well) sets
  ``NCCL_IB_DISABLE=1`` in every worker, keeping NCCL off InfiniBand, unless the user set
  that variable (``-x`` or hvdrun's environment).
* **Refused**: ``--mpi``, ``--jsrun``, ``--mpi-args``, ``--binding-args`` ask
  horovodrun to drive MPI or jsrun. hvdrun starts its workers itself, so it says what to do
  instead, in one line, and exits with 2 before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from hvdrun.values import seconds
from rendezvous import worker_env
from rendezvous.addresses import missing_interfaces
from rendezvous.slots import slots_used

F = TypeVar("F", bound=Callable[..., Any])

_JOIN = "hvd.init() joins jobs that mpirun, jsrun or srun started, without hvdrun"

#: Flags refused, and what to do instead (the line hvdrun prints).
REFUSED: dict[str, str] = {
    "--mpi": (
        "hvdrun does not drive MPI: it starts the workers itself (Gloo on CPU, NCCL on "
        f"GPU); drop --mpi, or run mpirun -np N python train.py yourself ({_JOIN})"
    ),
    "--jsrun": (
        "hvdrun does not drive jsrun: drop --jsrun to let hvdrun start the workers, or run "
        f"jsrun python train.py yourself ({_JOIN})"
    ),
    "--mpi-args": (
        "hvdrun does not run mpirun, so --mpi-args has nothing to go to: drop it, or run "
        f"mpirun with those arguments yourself ({_JOIN})"
    ),
    "--binding-args": (
        "hvdrun does not drive MPI, so --binding-args has nothing to go to: bind workers "
        "with a wrapper in the command (numactl, taskset), or run mpirun/jsrun yourself"
    ),
}


def _refuse(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value:
        flag = max(param.opts, key=len)
        raise click.UsageError(REFUSED[flag])
    return value


def named_interfaces(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> tuple[str, ...]:
    """Checks ``--network-interface`` and ``--network-interfaces``: a value that names no
    interface (``""``, ``,``) is a usage error, not a flag that silently sets nothing."""
    for value in values:
        if not any(name.strip() for name in value.split(",")):
            raise click.BadParameter(
                f"{value!r} names no interface (give IFNAME[,IFNAME], e.g. eth0)", ctx, param
            )
    return values


_REFUSED_HELP = "Refused: hvdrun does not drive MPI or jsrun; it says what to do instead."


def _refused_flag(name: str) -> Callable[[F], F]:
    return click.option(
        name, is_flag=True, expose_value=False, callback=_refuse, help=_REFUSED_HELP
    )


def _refused_value(name: str) -> Callable[[F], F]:
    return click.option(
        name, metavar="ARGS", expose_value=False, callback=_refuse, help=_REFUSED_HELP
    )


#: Flags passed on under Horovod's names that the runtime does not act on (yet).
NO_EFFECT_VARIABLES: dict[str, str] = {
    "hierarchical_allreduce": "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "hierarchical_allgather": "HOROVOD_HIERARCHICAL_ALLGATHER",
    "torus_allreduce": "HOROVOD_TORUS_ALLREDUCE",
    "num_nccl_streams": "HOROVOD_NUM_NCCL_STREAMS",
    "thread_affinity": "HOROVOD_THREAD_AFFINITY",
    # horovodrun's older spellings of --thread-affinity (hidden); given, they win over it.
    "ccl_bgt_affinity": "HOROVOD_THREAD_AFFINITY",
    "mlsl_bgt_affinity": "HOROVOD_THREAD_AFFINITY",
    "mpi_threads_disable": "HOROVOD_MPI_THREADS_DISABLE",
}

#: Horovod's variables that change nothing in hvdrun's workers and have no flag: GPU copy
#: batching, XLA ops, fusion of grouped ops kept apart (each group here is one fused op).
NO_EFFECT_ONLY_VARIABLES = (
    "HOROVOD_DISABLE_GROUP_FUSION",
    "HOROVOD_BATCH_D2D_MEMCOPIES",
    "HOROVOD_ENABLE_XLA_OPS",
)

_OPTIONS = [
    click.option(
        "--gloo",
        is_flag=True,
        help="Accepted for horovodrun's command lines: hvdrun always runs Gloo (NCCL for "
        "CUDA tensors).",
    ),
    _refused_flag("--mpi"),
    _refused_flag("--jsrun"),
    _refused_value("--mpi-args"),
    click.option(
        "--tcp",
        is_flag=True,
        help="Keep NCCL off InfiniBand: the workers get NCCL_IB_DISABLE=1 unless it is set "
        "(Gloo always uses TCP).",
    ),
    _refused_value("--binding-args"),
    click.option(
        "--gloo-timeout-seconds",
        type=seconds(),
        metavar="SECONDS",
        help="How long a collective waits for a peer before failing "
        "(HVDRUN_GLOO_TIMEOUT_SECONDS; default 30, elastic jobs 5).",
    ),
    click.option(
        "--disable-cache",
        is_flag=True,
        help="Accepted: horovodrun caches its host checks unless given this; hvdrun never "
        "caches them.",
    ),
    click.option(
        "--hierarchical-allreduce/--no-hierarchical-allreduce",
        default=None,
        help="Passed on as HOROVOD_HIERARCHICAL_ALLREDUCE; no effect yet.",
    ),
    click.option(
        "--hierarchical-allgather/--no-hierarchical-allgather",
        default=None,
        help="Passed on as HOROVOD_HIERARCHICAL_ALLGATHER; no effect yet.",
    ),
    click.option(
        "--torus-allreduce/--no-torus-allreduce",
        default=None,
        help="Passed on as HOROVOD_TORUS_ALLREDUCE; no effect yet.",
    ),
    click.option(
        "--num-nccl-streams",
        type=click.IntRange(min=0),
        metavar="N",
        help="Passed on as HOROVOD_NUM_NCCL_STREAMS; no effect yet.",
    ),
    click.option(
        "--thread-affinity",
        type=click.IntRange(min=0),
        metavar="CORE",
        help="Passed on as HOROVOD_THREAD_AFFINITY; no effect yet.",
    ),
    *(
        click.option(name, type=click.IntRange(min=0), metavar="CORE", hidden=True)
        for name in ("--ccl-bgt-affinity", "--mlsl-bgt-affinity")
    ),
    click.option(
        "--mpi-threads-disable/--no-mpi-threads-disable",
        default=None,
        help="Passed on as HOROVOD_MPI_THREADS_DISABLE; no effect yet (no MPI here).",
    ),
    click.option(
        "--network-interfaces",
        multiple=True,
        callback=named_interfaces,
        metavar="IFNAME,IFNAME",
        help="Same as --network-interface (horovodrun's spelling); the two are merged.",
    ),
    # The hidden opposites horovodrun accepts for flags of hvdrun.tuning.
    click.option("--stall-check", is_flag=True, hidden=True),
    click.option("--no-timeline-mark-cycles", is_flag=True, hidden=True),
    click.option("--no-autotune", is_flag=True, hidden=True),
]

NAMES = (
    "gloo",
    "tcp",
    "gloo_timeout_seconds",
    "disable_cache",
    *NO_EFFECT_VARIABLES,
    "network_interfaces",
    "stall_check",
    "no_timeline_mark_cycles",
    "no_autotune",
)


def horovod_options(fn: F) -> F:
    """Adds horovodrun's compatibility flags to a click command."""
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


@dataclass(frozen=True)
class HorovodFlags:
    """The compatibility flags as given (None: not given)."""

    gloo: bool = False
    tcp: bool = False
    gloo_timeout_seconds: float | None = None
    disable_cache: bool = False
    hierarchical_allreduce: bool | None = None
    hierarchical_allgather: bool | None = None
    torus_allreduce: bool | None = None
    num_nccl_streams: int | None = None
    thread_affinity: int | None = None
    ccl_bgt_affinity: int | None = None
    mlsl_bgt_affinity: int | None = None
    mpi_threads_disable: bool | None = None
    network_interfaces: tuple[str, ...] = ()
    stall_check: bool = False
    no_timeline_mark_cycles: bool = False
    no_autotune: bool = False

    @classmethod
    def take(cls, kwargs: dict[str, Any]) -> HorovodFlags:
        """Removes this module's flags from the command's keyword arguments."""
        return cls(**{name: kwargs.pop(name) for name in NAMES if name in kwargs})

    def adjust_tuning(self, tuning: dict[str, Any]) -> None:
        """The hidden opposites switch off what the config file may have switched on (and
        :meth:`settings` writes the ``0`` that wins over hvdrun's environment)."""
        if self.stall_check and "no_stall_check" in tuning:
            tuning["no_stall_check"] = None
        if self.no_timeline_mark_cycles and "timeline_mark_cycles" in tuning:
            tuning["timeline_mark_cycles"] = None
        if self.no_autotune and "autotune" in tuning:
            tuning["autotune"] = None

    def settings(self) -> dict[str, dict[str, str]]:
        """The worker variables these flags set, by the parameter that sets each (the
        command line decides what wins over -x by where that parameter's value came from)."""
        we = worker_env
        settings: dict[str, dict[str, str]] = {}
        if self.gloo_timeout_seconds is not None:
            seconds = f"{self.gloo_timeout_seconds:g}"
            settings["gloo_timeout_seconds"] = {we.variable(we.GLOO_TIMEOUT_SECONDS): seconds}
        # horovodrun writes 0 for these, so that they win over an inherited HOROVOD_*=1.
        if self.stall_check:
            settings["stall_check"] = {we.variable(we.STALL_CHECK_DISABLE): "0"}
        if self.no_timeline_mark_cycles:
            settings["no_timeline_mark_cycles"] = {we.variable(we.TIMELINE_MARK_CYCLES): "0"}
        for name, variable in NO_EFFECT_VARIABLES.items():
            value = getattr(self, name)
            if value is None:
                continue
            text = str(int(value)) if isinstance(value, bool) else str(value)
            settings[name] = {variable: text}
        return settings

    def set_tcp(self, env: dict[str, str]) -> None:
        """``--tcp``: NCCL_IB_DISABLE=1 in ``env``, the workers' environment, unless it
        already holds the variable (from -x or hvdrun's environment)."""
        if self.tcp:
            env.setdefault("NCCL_IB_DISABLE", "1")

    def no_effect(self) -> list[str]:
        """The flags given that reach the workers but change nothing there yet."""
        given = []
        for name in NO_EFFECT_VARIABLES:
            value = getattr(self, name)
            if value is not None and value is not False:
                given.append("--" + name.replace("_", "-"))
        return given


def no_effect_notice(flags: list[str]) -> str | None:
    """The one line hvdrun prints about accepted flags that do nothing yet."""
    if not flags:
        return None
    names = (NO_EFFECT_VARIABLES[flag[2:].replace("-", "_")] for flag in flags)
    variables = ", ".join(dict.fromkeys(names))
    return (
        f"note: {', '.join(flags)} accepted for Horovod compatibility but no effect yet "
        f"(the workers get {variables})"
    )


def interfaces(*values: Sequence[str]) -> str | None:
    """``--network-interface`` and ``--network-interfaces``, each repeatable and each
    comma-separated, as one list without repeats (None: neither given)."""
    names = [
        name.strip()
        for given in values
        for value in given
        for name in value.split(",")
        if name.strip()
    ]
    return ",".join(dict.fromkeys(names)) or None


def check_local_interfaces(names: str | None, hint: str = "'--network-interface'") -> None:
    """``--network-interface`` for a job that runs only on this machine: an interface it
    lacks is a usage error naming those it has (Gloo would fail in every worker's
    ``hvd.init()``); ``hint`` names where the names came from."""
    missing, have = missing_interfaces(names or "")
    if missing:
        raise click.BadParameter(
            f"this machine has no network interface {', '.join(missing)}; it has {', '.join(have)}",
            param_hint=hint,
        )


def check_hosts_flag(hosts: str) -> None:
    """``-H hosts.txt``: horovodrun users reach for -H with a file; say which flag reads one."""
    if "," not in hosts and ":" not in hosts and os.path.isfile(hosts):
        raise click.UsageError(
            f"-H takes host names (host1:4,host2:4), and '{hosts}' is a file here: "
            f"read it with --hostfile {hosts}"
        )


#: Of the variables without effect, those that hold a value rather than a switch.
_VALUED = frozenset({"HOROVOD_NUM_NCCL_STREAMS", "HOROVOD_THREAD_AFFINITY"})


def _set_on(name: str, raw: str) -> bool:
    """Whether ``raw`` asks something of the variable ``name``: any value of a valued one
    (thread affinity 0 is core 0), a switch that is on (or that no switch reads)."""
    if not raw.strip():
        return False
    if name in _VALUED:
        return True
    try:
        return worker_env.switch(raw)
    except ValueError:
        return True


def notices(
    flags: HorovodFlags, env: Mapping[str, str], hosts: Sequence[Any], num_proc: int
) -> list[str]:
    """The one-time notes hvdrun prints before it starts: flags without effect, Horovod's
    variables without effect set here or with ``-x`` (0, a switch left off, says nothing),
    Horovod's choice of controller or CPU library where it names another than Gloo, and the
    OMP_NUM_THREADS default when a host runs more than one worker."""
    lines = []
    given = flags.no_effect()
    no_effect = no_effect_notice(given)
    if no_effect:
        lines.append(no_effect)
    by_flags = {NO_EFFECT_VARIABLES[flag[2:].replace("-", "_")] for flag in given}
    inert = [
        f"{name}={env[name]}"
        for name in dict.fromkeys([*NO_EFFECT_VARIABLES.values(), *NO_EFFECT_ONLY_VARIABLES])
        if name not in by_flags and _set_on(name, env.get(name, ""))
    ]
    if inert:  # (from the environment or -x: a job script's exports, a cluster's defaults)
        lines.append(
            f"note: {', '.join(inert)} accepted for Horovod compatibility but no effect in "
            "hvdrun's workers"
        )
    for name in ("HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS"):
        value = env.get(name, "")
        if value.strip() and value.strip().lower() != "gloo":
            lines.append(
                f"note: {name}={value} has no effect: hvdrun's workers run their collectives "
                "on Gloo (NCCL for CUDA tensors)"
            )
    if not env.get("OMP_NUM_THREADS"):
        used = slots_used([(host.hostname, host.slots) for host in hosts], num_proc)
        if max((workers for _, workers in used), default=0) > 1:
            lines.append(
                "note: OMP_NUM_THREADS is not set: each worker gets its host's cores divided "
                "by the host's workers (set it with -x OMP_NUM_THREADS=N)"
            )
    return lines
