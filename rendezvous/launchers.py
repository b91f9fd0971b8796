"""Who started this process: what srun, mpirun, jsrun and torchrun tell the processes they start.

Most clusters start training jobs with their own launcher, not hvdrun. Each launcher hands
every process its place in the job through variables of its own; :func:`detect` reads them
into one :class:`Placement`, in this order:

============ ===================================================== =========================
hvdrun       ``HVDRUN_RENDEZVOUS_ADDR`` (and ``HVDRUN_*`` placement) the launcher serves it
torchrun     ``TORCHELASTIC_RUN_ID`` with ``RANK``/``WORLD_SIZE``    ``MASTER_ADDR:MASTER_PORT``
Open MPI     ``OMPI_COMM_WORLD_RANK``/``SIZE``/``LOCAL_RANK``/...  ``MASTER_ADDR`` or mpi4py
MPICH, Intel ``PMI_RANK``/``PMI_SIZE``, ``MPI_LOCALRANKID``/...,     ``MASTER_ADDR`` or mpi4py
MPI, Cray    ``ALPS_APP_PE``
LSF jsrun    ``JSM_NAMESPACE_RANK``/``SIZE``/``LOCAL_RANK``/...     ``MASTER_ADDR``
Slurm step   ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``,            the step's first node
             ``SLURM_LOCALID``, ``SLURM_NODEID``,
             ``SLURM_STEP_NODELIST``/``TASKS_PER_NODE``
Kubernetes   ``RANK``/``WORLD_SIZE`` with ``MASTER_ADDR``           ``MASTER_ADDR:MASTER_PORT``
============ ===================================================== =========================

``RANK``/``WORLD_SIZE`` never make a silent job of size 1: ``WORLD_SIZE`` > 1 without an
address to meet at is a placement the runtime refuses at once on every rank (naming
``MASTER_ADDR``), and so are ``RANK`` > 0 without ``WORLD_SIZE`` and ``WORLD_SIZE`` > 1
without ``RANK`` (:class:`DetectionError`). ``RANK=0``, ``WORLD_SIZE=1`` and both together
describe a process on its own.

The more specific launcher wins where several have left their variables: ``srun torchrun``
and ``mpirun`` inside a Slurm allocation start their processes from Slurm tasks (one per
node), so those processes also carry the task's ``SLURM_PROCID`` and a step size that counts
nodes, not processes. hvdrun's own workers never see another launcher's variables (the
launcher removes them: :data:`FOREIGN_VARIABLES`).

``HVDRUN_LAUNCHER`` (``auto`` by default) names the launcher instead: ``hvdrun``, ``slurm``,
``mpi``, ``jsrun``, ``torchrun`` (also Kubernetes), or ``none`` for a deliberate job of size
1. A process inside a Slurm allocation but outside any job step (a batch script or an
``salloc`` shell that forgot ``srun``) is reported as such, so the runtime can say so instead
of training alone.

Slurm's compressed lists are parsed here too: node lists (``node[01-04,07],gpu-a[1-2]``) and
task counts (``2(x3),1``). This module imports neither torch nor gRPC.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import re
import shutil
import socket
import subprocess
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "CHOICES",
    "FOREIGN_VARIABLES",
    "DetectionError",
    "Placement",
    "SlurmAllocation",
    "derived_port",
    "describe",
    "detect",
    "expand_nodelist",
    "expand_tasks_per_node",
    "in_slurm_step",
    "is_foreign",
    "local_peers",
    "node_address",
    "slurm_allocation",
    "torchrun_agent",
]

#: The values ``HVDRUN_LAUNCHER`` accepts.
CHOICES = ("auto", "hvdrun", "slurm", "mpi", "jsrun", "torchrun", "none")
LAUNCHER_VARIABLE = "HVDRUN_LAUNCHER"

#: Shell patterns of what launchers set for each process they start (rank, size, local rank,
#: step, rendezvous address) and of the shell functions a login shell exports: hvdrun keeps
#: them away from its workers, whose place in the job is hvdrun's to say (:func:`is_foreign`).
#: Job-level variables a script may log stay: ``SLURM_JOB_ID``, ``SLURM_JOB_NAME``,
#: ``SLURM_JOB_NODELIST``, ``SLURM_JOB_NUM_NODES``, ``SLURM_TASKS_PER_NODE``, ``PBS_JOBID``,
#: ``LSB_JOBID``, ... ``SLURM_NTASKS`` goes although it describes the job: Lightning takes it
#: as "srun started this process" and then reads ``SLURM_PROCID`` as the rank, and submitit
#: takes it as the world size. ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
#: ``LOCAL_WORLD_SIZE`` are not listed: hvdrun sets them for every worker.
FOREIGN_VARIABLES: tuple[str, ...] = (
    # Slurm: a task of a job step (srun), or the batch script's own task
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_GTIDS",
    "SLURM_TASK_PID",
    "SLURM_STEPID",
    "SLURM_STEP_*",
    "SLURM_SRUN_COMM_*",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_CPU_BIND*",
    "SLURM_DISTRIBUTION",
    # PBS/Torque (pbsdsh, tm_spawn)
    "PBS_TASKNUM",
    "PBS_NODENUM",
    "PBS_VNODENUM",
    # Open MPI, MVAPICH, MPICH/Intel MPI/Cray (PMI), PMIx
    "OMPI_COMM_WORLD_*",
    "OMPI_UNIVERSE_SIZE",
    "OMPI_FIRST_RANKS",
    "OMPI_APP_CTX_NUM_PROCS",
    "OMPI_NUM_APP_CTX",
    "OMPI_MCA_ess_*",
    "OMPI_MCA_orte_*",
    "MV2_COMM_WORLD_*",
    "PMI_*",
    "PMIX_*",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "ALPS_APP_PE",
    "PALS_*",
    # LSF jsrun
    "JSM_NAMESPACE_*",
    # torchrun
    "TORCHELASTIC_*",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    # functions a login shell exported (``export -f``): bash definitions, not settings
    "BASH_FUNC_*",
)


def is_foreign(name: str) -> bool:
    """True for a variable another launcher set for one process (:data:`FOREIGN_VARIABLES`)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in FOREIGN_VARIABLES)


#: Slurm's step ids that are not job steps a process can be a task of: the batch script
#: (``batch``, 0xfffffffb), the ``extern`` step and ``salloc``'s interactive step, by name
#: or as the numbers some Slurm versions put in ``SLURM_STEP_ID``.
_SPECIAL_STEPS = frozenset(
    {"batch", "extern", "interactive", *(str(0xFFFFFFF0 + n) for n in range(10, 16))}
)


#: ``salloc``'s interactive step (``LaunchParameters=use_interactive_step``), 0xfffffffa.
_INTERACTIVE_STEP = frozenset({"interactive", str(0xFFFFFFFA)})


def in_slurm_step(env: Mapping[str, str]) -> bool:
    """True inside a task of a Slurm job step (srun), False in a batch script or an
    ``salloc`` shell (also one in Slurm's interactive step) and outside Slurm."""
    step = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip()
    return bool(step) and step.lower() not in _SPECIAL_STEPS


class DetectionError(ValueError):
    """A launcher's variables that cannot describe a job (the message names them)."""


@dataclass(frozen=True)
class Placement:
    """This process's place in a job, as the launcher that started it describes it."""

    #: "hvdrun", "slurm", "mpi", "jsrun" or "torchrun" (the ``HVDRUN_LAUNCHER`` names).
    launcher: str
    #: The launcher in words, for messages: "Slurm (srun)", "Open MPI (mpirun)", ...
    name: str
    rank: int
    size: int
    #: None where the launcher does not say; the rendezvous derives them from the hosts.
    local_rank: int | None = None
    local_size: int | None = None
    #: What the ranks of one host have in common (a Slurm node name); None: the hostname.
    host: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    #: Slurm: the first node of the step, where task 0 runs.
    first_host: str | None = None
    #: Identifies this run of this job (a port and a token are derived from it).
    job_key: str = ""
    #: torchrun's agent serves a TCPStore on MASTER_ADDR:MASTER_PORT.
    agent_store: bool = False
    #: torchrun: the agent that started this process (:func:`torchrun_agent`; see
    #: :func:`local_peers`).
    agent: str | None = None


def torchrun_agent(env: Mapping[str, str]) -> str | None:
    """The torchrun agent that started this process (``GROUP_RANK``), if one did."""
    return env.get("GROUP_RANK", "").strip() or None


def local_peers(host: str, agent: str | None) -> str:
    """What a rank's local peers have in common: its host, and under torchrun its agent,
    whose ``LOCAL_RANK``\\ s number only that agent's processes (one host may run several
    agents: Spark's TorchDistributor with two tasks on an executor)."""
    return f"{host}#agent{agent}" if agent else host


@dataclass(frozen=True)
class SlurmAllocation:
    """A Slurm job's allocation, seen from a process outside its job steps."""

    job_id: str
    nodes: list[str]
    tasks_per_node: list[int]
    #: "batch script" or "salloc shell": where this process runs.
    where: str

    @property
    def tasks(self) -> int:
        return sum(self.tasks_per_node)


# ---- Slurm's compressed lists ----------------------------------------------------------

_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` → ``[2, 2, 2, 1]`` (Slurm's ``SLURM_TASKS_PER_NODE`` format)."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.match(part.strip())
        if match is None:
            raise DetectionError(f"cannot read the task counts {text!r} (expected e.g. 2(x3),1)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _split_top_level(text: str) -> list[str]:
    """Splits on the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise DetectionError(f"unbalanced brackets in the node list {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    if depth != 0:
        raise DetectionError(f"unbalanced brackets in the node list {text!r}")
    parts.append(text[start:])
    return [part for part in parts if part]


def _expand_range(spec: str, whole: str) -> list[str]:
    values: list[str] = []
    for item in spec.split(","):
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise DetectionError(f"cannot read the range [{spec}] in the node list {whole!r}")
        if not dash:
            values.append(low)
            continue
        width = len(low)  # node[01-10]: zero-padded to the width of the lower bound
        if int(high) < int(low):
            raise DetectionError(f"the range [{spec}] in the node list {whole!r} is reversed")
        values += [str(n).zfill(width) for n in range(int(low), int(high) + 1)]
    return values


def _expand_name(name: str, whole: str) -> list[str]:
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    head, spec, tail = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    return [
        head + value + rest
        for value in _expand_range(spec, whole)
        for rest in _expand_name(tail, whole)
    ]


def expand_nodelist(text: str) -> list[str]:
    """``node[01-04,07],gpu-a[1-2]`` → every node name, in order (Slurm's hostlist format)."""
    names: list[str] = []
    for part in _split_top_level(text.strip()):
        names += _expand_name(part, text)
    return names


# ---- detection -------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DetectionError(f"{name} must be an integer, got {raw!r}") from None


def _first(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value
    return None


def _master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT")
    if port is not None and not 0 < port < 65536:
        # (as torch's env:// refuses it: a socket would take it modulo 65536, or any port)
        raise DetectionError(
            f"MASTER_PORT must be a port number from 1 to 65535, got {env['MASTER_PORT']!r}"
        )
    return addr, port


def _checked(placement: Placement) -> Placement:
    what = placement.name
    if placement.size < 1:
        raise DetectionError(f"{what} says the job has {placement.size} processes")
    if not 0 <= placement.rank < placement.size:
        raise DetectionError(
            f"{what} says this is rank {placement.rank} of a job of {placement.size} (ranks "
            f"are 0 to {placement.size - 1})"
        )
    local_rank, local_size = placement.local_rank, placement.local_size
    if local_rank is not None and local_size is not None and not 0 <= local_rank < local_size:
        raise DetectionError(
            f"{what} says this is local rank {local_rank} of {local_size} on its host"
        )
    return placement


def _torchrun(env: Mapping[str, str], elastic_agent: bool) -> Placement | None:
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None or size is None:
        return None
    addr, port = _master(env)
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    restarts = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    name = "torchrun" if elastic_agent else "the RANK/WORLD_SIZE/MASTER_ADDR environment"
    return Placement(
        launcher="torchrun",
        name=name,
        rank=rank,
        size=size,
        local_rank=_int(env, "LOCAL_RANK"),
        local_size=_int(env, "LOCAL_WORLD_SIZE"),
        master_addr=addr,
        master_port=port,
        job_key=f"torchrun/{run_id}/{restarts}" if elastic_agent else f"env/{addr}/{port}",
        agent_store=elastic_agent and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        agent=torchrun_agent(env) if elastic_agent else None,
    )


def _half_set(rank: int | None, size: int | None, rank_name: str, size_name: str) -> None:
    """A launcher sets its rank and size variables together: one without the other (a
    copied environment, a wrapper that dropped one) is an error, never a job of size 1;
    only ``rank 0`` or ``size 1`` alone still runs alone, as it says."""
    if rank is not None and size is None and rank != 0:
        raise DetectionError(
            f"{rank_name}={rank} is set but {size_name} is not, so the size of the job is "
            f"unknown: a launcher sets both; {LAUNCHER_VARIABLE}=none runs it alone"
        )
    if size is not None and rank is None and size != 1:
        raise DetectionError(
            f"{size_name}={size} says this process is one of {size}, but {rank_name} (which "
            f"one) is not set: a launcher sets both; {LAUNCHER_VARIABLE}=none runs it alone"
        )


def _open_mpi(env: Mapping[str, str]) -> Placement | None:
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    _half_set(rank, size, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
    if rank is None or size is None:
        return None
    addr, port = _master(env)
    job = (
        env.get("OMPI_MCA_ess_base_jobid")
        or env.get("OMPI_MCA_orte_ess_jobid")
        or env.get("PMIX_NAMESPACE")  # Open MPI 5 (prterun)
        or ""
    )
    return Placement(
        launcher="mpi",
        name="Open MPI (mpirun)",
        rank=rank,
        size=size,
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        master_addr=addr,
        master_port=port,
        job_key=f"ompi/{job}",
    )


def _pmi(env: Mapping[str, str]) -> Placement | None:
    rank = _first(env, "PMI_RANK", "ALPS_APP_PE", "PALS_RANKID")
    size = _first(env, "PMI_SIZE")
    # (Cray's ALPS_APP_PE and PALS_RANKID may come without PMI_SIZE: only PMI_RANK needs it)
    _half_set(_int(env, "PMI_RANK") if size is None else rank, size, "PMI_RANK", "PMI_SIZE")
    if rank is None or size is None:
        return None
    addr, port = _master(env)
    return Placement(
        launcher="mpi",
        name="MPI (PMI: MPICH, Intel MPI or Cray)",
        rank=rank,
        size=size,
        local_rank=_first(env, "MPI_LOCALRANKID", "PALS_LOCAL_RANKID"),
        local_size=_first(env, "MPI_LOCALNRANKS", "PALS_LOCAL_SIZE"),
        master_addr=addr,
        master_port=port,
        # (never PMI_ID: it numbers the process, not the job)
        job_key=f"pmi/{env.get('PMI_JOBID') or env.get('PMIX_NAMESPACE') or ''}",
    )


def _jsrun(env: Mapping[str, str]) -> Placement | None:
    rank, size = _int(env, "JSM_NAMESPACE_RANK"), _int(env, "JSM_NAMESPACE_SIZE")
    if rank is None or size is None:
        return None
    addr, port = _master(env)
    return Placement(
        launcher="jsrun",
        name="LSF (jsrun)",
        rank=rank,
        size=size,
        local_rank=_int(env, "JSM_NAMESPACE_LOCAL_RANK"),
        local_size=_int(env, "JSM_NAMESPACE_LOCAL_SIZE"),
        master_addr=addr,
        master_port=port,
        job_key=f"lsf/{env.get('LSB_JOBID', '')}",
    )


def _slurm_step(env: Mapping[str, str]) -> Placement | None:
    step = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    rank = _int(env, "SLURM_PROCID")
    if not in_slurm_step(env) or rank is None:
        return None
    size = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if size is None:
        if rank == 0:
            return None  # rank 0 of a job of unknown size: nothing says it has peers
        raise DetectionError("a Slurm job step without SLURM_STEP_NUM_TASKS or SLURM_NTASKS")
    nodes_text = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    nodes = expand_nodelist(nodes_text) if nodes_text else []
    node_id = _int(env, "SLURM_NODEID")
    local_size = None
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE")
    if tasks and node_id is not None:
        counts = expand_tasks_per_node(tasks)
        if node_id < len(counts):
            local_size = counts[node_id]
    host = env.get("SLURMD_NODENAME")
    if host is None and node_id is not None and node_id < len(nodes):
        host = nodes[node_id]
    addr, port = _master(env)
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or ""
    return Placement(
        launcher="slurm",
        name="Slurm (srun)",
        rank=rank,
        size=size,
        local_rank=_int(env, "SLURM_LOCALID"),
        local_size=local_size,
        host=host,
        master_addr=addr,
        master_port=port,
        first_host=nodes[0] if nodes else None,
        job_key=f"slurm/{job}/{step}",
    )


def _hvdrun(env: Mapping[str, str]) -> Placement | None:
    if not env.get("HVDRUN_RENDEZVOUS_ADDR"):
        return None
    return Placement(
        launcher="hvdrun",
        name="hvdrun",
        rank=_int(env, "HVDRUN_RANK") or 0,
        size=_int(env, "HVDRUN_SIZE") or 1,
        local_rank=_int(env, "HVDRUN_LOCAL_RANK"),
        local_size=_int(env, "HVDRUN_LOCAL_SIZE"),
        job_key=f"hvdrun/{env.get('HVDRUN_JOB_ID', '')}",
    )


def beside_hvdrun(env: Mapping[str, str] | None = None) -> str | None:
    """Where hvdrun's variables are set in a process that another launcher started too,
    one that never starts hvdrun's workers (torchrun, mpirun, jsrun): a hint that they may
    be left over from an hvdrun job (hvdrun's variables win), naming that launcher and the
    ways out. None otherwise (srun may start hvdrun's own agents, whose workers have both)."""
    source = os.environ if env is None else env
    if not source.get("HVDRUN_RENDEZVOUS_ADDR"):
        return None
    readers: tuple[tuple[Callable[[Mapping[str, str]], Placement | None], str], ...] = (
        (lambda e: _torchrun(e, True) if e.get("TORCHELASTIC_RUN_ID") else None, "torchrun"),
        (_open_mpi, "mpi"),
        (_jsrun, "jsrun"),
    )
    for read, choice in readers:
        try:
            found = read(source)
        except DetectionError:
            continue
        if found is not None:
            return (
                f"this process was started by {found.name} as well, and hvdrun's variables "
                "(HVDRUN_RENDEZVOUS_ADDR, HVDRUN_RANK, ...), which win, may be left over from "
                f"an hvdrun job: unset them, or set {LAUNCHER_VARIABLE}={choice} to join "
                f"{found.name}'s job"
            )
    return None


def _auto(env: Mapping[str, str]) -> Placement | None:
    if env.get("TORCHELASTIC_RUN_ID"):
        found = _torchrun(env, elastic_agent=True)
        if found is not None:
            return found
    for read in (_open_mpi, _pmi, _jsrun, _slurm_step):
        found = read(env)
        if found is not None:
            return _srun_over_pmi(found, env) if read is _pmi else found
    return _environment(env)


def _srun_over_pmi(found: Placement, env: Mapping[str, str]) -> Placement:
    """srun's own PMI plugin (``srun --mpi=pmi2``, or a cluster's ``MpiDefault``) sets
    ``PMI_RANK``/``PMI_SIZE`` too: where they are the Slurm step's own task numbers, srun
    started this process and is the launcher. (An MPI launcher inside a step, such as
    Hydra's proxies started by srun, runs one task per node, whose numbers are not the
    ranks'; and with one rank per node either reading gives the same place.)"""
    try:
        step = _slurm_step(env)
    except DetectionError:
        return found
    if step is not None and (step.rank, step.size) == (found.rank, found.size):
        return step
    return found


def _environment(env: Mapping[str, str]) -> Placement | None:
    """``RANK``/``WORLD_SIZE`` without another launcher's variables (a Kubernetes
    PyTorchJob, a hand-written environment). Never a silent job of size 1: variables that
    say this process has peers, but not which rank it is or how many there are, are an
    error, and a job of several processes without ``MASTER_ADDR`` is one the runtime
    refuses at once (there is no address to meet at). Scripts that set ``RANK=0`` for
    purposes of their own still run alone."""
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None and size is None:
        return None
    if size is None:
        if rank == 0:
            return None  # rank 0 of a job of unknown size: nothing says it has peers
        raise DetectionError(
            f"RANK={rank} is set but WORLD_SIZE is not, so the size of the job is unknown: "
            "set both (WORLD_SIZE=1 for a process on its own), or neither; "
            f"{LAUNCHER_VARIABLE}=none runs it alone whatever they say"
        )
    if rank is None:
        if size == 1:
            return None
        raise DetectionError(
            f"WORLD_SIZE={size} says this process is one of {size}, but RANK (which one) is "
            "not set: set RANK on every process (0 .. WORLD_SIZE-1)"
        )
    found = _torchrun(env, elastic_agent=False)
    if found is None or env.get("MASTER_ADDR"):
        return found
    found = _checked(dataclasses.replace(found, name="the RANK/WORLD_SIZE environment"))
    if found.size == 1 and not env.get("MASTER_PORT"):
        return None  # rank 0 of 1: a process on its own, as without the variables
    return found


def detect(env: Mapping[str, str] | None = None) -> Placement | None:
    """Who started this process and where it sits, or None for a process on its own.

    Raises :class:`DetectionError` for an unknown ``HVDRUN_LAUNCHER``, for variables that
    cannot describe a job, and where ``HVDRUN_LAUNCHER`` names a launcher whose variables
    are missing.
    """
    source = os.environ if env is None else env
    choice = (source.get(LAUNCHER_VARIABLE) or "auto").strip().lower()
    if choice not in CHOICES:
        raise DetectionError(
            f"{LAUNCHER_VARIABLE}={source.get(LAUNCHER_VARIABLE)!r} is not one of "
            f"{', '.join(CHOICES)}"
        )
    if choice == "none":
        return None
    hvdrun = _hvdrun(source)
    if hvdrun is not None and choice in ("auto", "hvdrun"):
        return hvdrun  # checked by the rendezvous, which hvdrun serves
    readers = {
        "hvdrun": lambda e: None,
        "slurm": _slurm_step,
        "mpi": lambda e: _open_mpi(e) or _pmi(e),
        "jsrun": _jsrun,
        "torchrun": lambda e: _torchrun(e, elastic_agent=bool(e.get("TORCHELASTIC_RUN_ID"))),
        "auto": _auto,
    }
    found = readers[choice](source)
    if found is None and choice != "auto":
        raise DetectionError(
            f"{LAUNCHER_VARIABLE}={choice}, but this process has none of that launcher's "
            "variables (was it started by it?)"
        )
    return _checked(found) if found is not None else None


def slurm_allocation(env: Mapping[str, str] | None = None) -> SlurmAllocation | None:
    """The Slurm allocation this process runs in outside any job step (a batch script or
    an ``salloc`` shell), or None: not in an allocation, or inside a job step."""
    source = os.environ if env is None else env
    job = source.get("SLURM_JOB_ID") or source.get("SLURM_JOBID")
    nodelist = source.get("SLURM_JOB_NODELIST") or source.get("SLURM_NODELIST")
    if not job or not nodelist or in_slurm_step(source):
        return None
    nodes = expand_nodelist(nodelist)
    tasks_text = source.get("SLURM_TASKS_PER_NODE")
    tasks = expand_tasks_per_node(tasks_text) if tasks_text else [1] * len(nodes)
    if len(tasks) != len(nodes):
        raise DetectionError(
            f"SLURM_TASKS_PER_NODE={tasks_text!r} does not match the {len(nodes)} node(s) of "
            f"SLURM_JOB_NODELIST={nodelist!r}"
        )
    step = (source.get("SLURM_STEP_ID") or source.get("SLURM_STEPID") or "").strip().lower()
    # (salloc's shell in Slurm's interactive step has a task id too, as a batch script has)
    batch = "SLURM_PROCID" in source and step not in _INTERACTIVE_STEP
    where = "batch script" if batch else "salloc shell"
    return SlurmAllocation(job_id=job, nodes=nodes, tasks_per_node=tasks, where=where)


def derived_port(job_key: str, low: int = 10000, span: int = 20000) -> int:
    """A port every process of one job computes alike (below Linux's ephemeral range)."""
    return low + zlib.crc32(job_key.encode()) % span


def node_address(name: str, timeout: float = 10.0) -> str | None:
    """The address of a Slurm node (or any host): DNS and /etc/hosts first, then what Slurm
    knows as its ``NodeAddr`` (clusters whose node names resolve nowhere); None if neither."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        infos = []
    if infos:
        return str(infos[0][4][0])
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        shown = subprocess.run(
            [scontrol, "show", "node", "-o", name],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bNodeAddr=(\S+)", shown.stdout)
    if shown.returncode != 0 or match is None or match.group(1) == name:
        return None
    return match.group(1)


def describe(env: Mapping[str, str] | None = None) -> str:
    """One line: who started this process and where it sits (for ``--check-build``)."""
    source = os.environ if env is None else env
    try:
        placement = detect(source)
        allocation = slurm_allocation(source) if placement is None else None
    except DetectionError as error:
        return f"cannot tell: {error}"
    if placement is None:
        if source.get(LAUNCHER_VARIABLE, "").strip().lower() == "none":
            return "none (HVDRUN_LAUNCHER=none): hvd.init() runs a job of size 1"
        if allocation is not None:
            return (
                f"none: a Slurm {allocation.where} of job {allocation.job_id} "
                f"({allocation.tasks} tasks on {len(allocation.nodes)} node(s)) outside any job "
                "step; start workers with srun or hvdrun"
            )
        return "none: hvd.init() runs a job of size 1"
    local = ""
    if placement.local_rank is not None:
        of = f" of {placement.local_size}" if placement.local_size is not None else ""
        local = f", local rank {placement.local_rank}{of}"
    host = f" on {placement.host}" if placement.host else ""
    return f"{placement.name}: rank {placement.rank} of {placement.size}{local}{host}"
