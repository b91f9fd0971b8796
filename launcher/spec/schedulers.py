"""The hosts of the batch allocation hvdrun runs in: the default host list.

Inside a batch job, the scheduler has already chosen the hosts and how many processes each
may run; asking the user to repeat them with ``-H`` invites mistakes. :func:`read_allocation`
reads them from what the scheduler left in the environment, in this order:

========= ======================================================= ==========================
Slurm     ``SLURM_JOB_NODELIST`` (``node[01-04,07],gpu-a[1-2]``)    ``SLURM_TASKS_PER_NODE``
          with ``SLURM_JOB_ID``, outside any job step               (``2(x3),1``); 1 per node
                                                                    where it is not set
PBS       ``$PBS_NODEFILE``: one line per slot                      lines per host
LSF       ``$LSB_DJOB_HOSTFILE``: one line per slot,                lines per host,
          else ``LSB_MCPU_HOSTS`` (``host1 4 host2 4``)             the numbers
Cobalt    ``$COBALT_NODEFILE``: one line per node                   1 per node
SGE       ``$PE_HOSTFILE``: ``host slots queue processors`` lines   the slots column
========= ======================================================= ==========================

Hosts keep the order the scheduler gives them; a host listed more than once is one host with
the slots of all its lines. Inside a Slurm job step (a task that srun started, where
``SLURM_STEP_ID`` is a number) the allocation is not used: that process is one task of a step,
not the owner of the allocation. Variables that are set but cannot be read (a missing host
file, a malformed node list) are :class:`AllocationError`, whose one-line message names them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from launcher.errors import LauncherError
from launcher.spec.hosts import HostSpec
from rendezvous.launchers import DetectionError, slurm_allocation

__all__ = [
    "ALLOCATION_VARIABLES",
    "Allocation",
    "AllocationError",
    "read_allocation",
]

#: The variables that make a process "inside an allocation" for :func:`read_allocation`.
ALLOCATION_VARIABLES: tuple[str, ...] = (
    "SLURM_JOB_ID",
    "SLURM_JOBID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "PBS_NODEFILE",
    "LSB_DJOB_HOSTFILE",
    "LSB_MCPU_HOSTS",
    "COBALT_NODEFILE",
    "PE_HOSTFILE",
)


class AllocationError(LauncherError, ValueError):
    """A scheduler's variables that cannot be read as hosts; the message is for the user."""


@dataclass(frozen=True)
class Allocation:
    """The hosts and slots a batch scheduler gave the job hvdrun runs in."""

    #: "slurm", "pbs", "lsf", "cobalt" or "sge".
    scheduler: str
    hosts: list[HostSpec]
    #: The allocation in words, for messages: "the Slurm allocation (job 42)".
    source: str
    job_id: str | None = None

    @property
    def slots(self) -> int:
        return sum(host.slots for host in self.hosts)

    def first_slots(self, num_proc: int) -> list[HostSpec]:
        """The hosts that ``num_proc`` processes fill in order, each host's slots first;
        hosts left without a process are dropped."""
        chosen: list[HostSpec] = []
        left = num_proc
        for host in self.hosts:
            if left <= 0:
                break
            chosen.append(HostSpec(host.hostname, min(host.slots, left)))
            left -= host.slots
        return chosen


_NAMES = {"slurm": "Slurm", "pbs": "PBS", "lsf": "LSF", "cobalt": "Cobalt", "sge": "SGE"}


def _allocation(scheduler: str, hosts: list[HostSpec], job_id: str | None) -> Allocation:
    what = f"the {_NAMES[scheduler]} allocation"
    return Allocation(scheduler, hosts, f"{what} (job {job_id})" if job_id else what, job_id)


def _checked_host(name: str, where: str) -> str:
    if name.startswith("-"):  # would read as an option to ssh and srun
        raise AllocationError(f"{where}: host name '{name}' starts with '-'")
    return name


def _merge(entries: Iterable[tuple[str, int]]) -> list[HostSpec]:
    """Hosts in first-seen order, the slots of repeated hosts summed."""
    slots: dict[str, int] = {}
    for host, count in entries:
        slots[host] = slots.get(host, 0) + count
    return [HostSpec(host, count) for host, count in slots.items()]


def _read_file(variable: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise AllocationError(f"cannot read {variable}={path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise AllocationError(f"{variable}={path} is not UTF-8 text") from None


def _positive(text: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise AllocationError(f"{where}: slot count '{text}' is not a number") from None
    if value < 1:
        raise AllocationError(f"{where}: slot count must be at least 1, got {value}")
    return value


def parse_node_lines(text: str, variable: str) -> list[HostSpec]:
    """One host name per line, one line per slot (PBS, LSF and Cobalt node files)."""
    entries: list[tuple[str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{variable} line {number}"
        fields = line.split()
        if len(fields) != 1:
            raise AllocationError(f"{where}: expected one host name, got '{line}'")
        entries.append((_checked_host(fields[0], where), 1))
    if not entries:
        raise AllocationError(f"{variable} lists no hosts")
    return _merge(entries)


def parse_pe_hostfile(text: str, variable: str = "PE_HOSTFILE") -> list[HostSpec]:
    """SGE's ``host slots queue processors`` lines."""
    entries: list[tuple[str, int]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{variable} line {number}"
        fields = line.split()
        if len(fields) < 2:
            raise AllocationError(f"{where}: expected 'host slots queue processors', got '{line}'")
        entries.append((_checked_host(fields[0], where), _positive(fields[1], where)))
    if not entries:
        raise AllocationError(f"{variable} lists no hosts")
    return _merge(entries)


def parse_mcpu_hosts(text: str, variable: str = "LSB_MCPU_HOSTS") -> list[HostSpec]:
    """LSF's ``host1 4 host2 4``: host names and slot counts, alternating."""
    fields = text.split()
    if not fields or len(fields) % 2:
        raise AllocationError(f"{variable}={text!r} is not 'host slots host slots ...'")
    entries = [
        (_checked_host(host, variable), _positive(count, variable))
        for host, count in zip(fields[::2], fields[1::2], strict=True)
    ]
    return _merge(entries)


def _slurm(env: Mapping[str, str]) -> Allocation | None:
    try:
        found = slurm_allocation(env)
    except DetectionError as exc:
        raise AllocationError(str(exc)) from None
    if found is None:
        return None
    entries = []
    for node, count in zip(found.nodes, found.tasks_per_node, strict=True):
        where = "SLURM_TASKS_PER_NODE"
        entries.append((_checked_host(node, "SLURM_JOB_NODELIST"), _positive(str(count), where)))
    if not entries:
        raise AllocationError("SLURM_JOB_NODELIST lists no nodes")
    return _allocation("slurm", _merge(entries), found.job_id)


def _pbs(env: Mapping[str, str]) -> Allocation | None:
    path = env.get("PBS_NODEFILE")
    if not path:
        return None
    hosts = parse_node_lines(_read_file("PBS_NODEFILE", path), "PBS_NODEFILE")
    return _allocation("pbs", hosts, env.get("PBS_JOBID"))


def _lsf(env: Mapping[str, str]) -> Allocation | None:
    path, mcpu = env.get("LSB_DJOB_HOSTFILE"), env.get("LSB_MCPU_HOSTS")
    if path:
        hosts = parse_node_lines(_read_file("LSB_DJOB_HOSTFILE", path), "LSB_DJOB_HOSTFILE")
    elif mcpu:
        hosts = parse_mcpu_hosts(mcpu)
    else:
        return None
    return _allocation("lsf", hosts, env.get("LSB_JOBID"))


def _cobalt(env: Mapping[str, str]) -> Allocation | None:
    path = env.get("COBALT_NODEFILE")
    if not path:
        return None
    text = _read_file("COBALT_NODEFILE", path)
    # One line per node, not per slot: a node runs one process unless -H says more.
    hosts = [HostSpec(h.hostname, 1) for h in parse_node_lines(text, "COBALT_NODEFILE")]
    return _allocation("cobalt", hosts, env.get("COBALT_JOBID"))


def _sge(env: Mapping[str, str]) -> Allocation | None:
    path = env.get("PE_HOSTFILE")
    if not path:
        return None
    hosts = parse_pe_hostfile(_read_file("PE_HOSTFILE", path))
    return _allocation("sge", hosts, env.get("JOB_ID"))


_READERS: tuple[Callable[[Mapping[str, str]], Allocation | None], ...] = (
    _slurm,
    _pbs,
    _lsf,
    _cobalt,
    _sge,
)


def read_allocation(environ: Mapping[str, str] | None = None) -> Allocation | None:
    """The allocation this process runs in (the first scheduler whose variables are set),
    or None outside any; raises :class:`AllocationError` for variables that cannot be read."""
    source = os.environ if environ is None else environ
    for read in _READERS:
        found = read(source)
        if found is not None:
            return found
    return None
