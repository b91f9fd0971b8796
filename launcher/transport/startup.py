"""Starting one agent per host, all at once, within ``--start-timeout``.

Local hosts get a subprocess; every other host an SSH connection, opened in parallel (or,
with ``--launcher slurm``, every host a task of one srun step: :mod:`launcher.transport.srun`). The
job starts only when every agent has said hello with the same Python, hvdrun and torch
versions as this machine; otherwise :class:`LaunchError` names every host that failed and
why, and no worker has started anywhere.

Where the workers reach the rendezvous: with remote hosts the server listens on all
interfaces, and each remote agent is given the address of this machine on its own SSH
connection (the one address that host is known to reach), or ``--rendezvous-addr``. Local
agents then use the same address as the first remote host, so that their workers' Gloo
and NCCL sockets face the other hosts too.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from launcher.errors import LauncherError
from launcher.spec.hosts import is_local_host, local_addresses
from launcher.spec.options import LaunchOptions
from launcher.transport.connection import AgentConnection, AgentStartError
from launcher.transport.hostinfo import installed_versions
from launcher.transport.local import LocalAgent
from launcher.transport.protocol import PROTOCOL_VERSION, Hello
from rendezvous.addresses import is_loopback, join_addr, resolve, source_address

#: hvdrun's exit code when it cannot start (or loses) an agent; ssh uses the same.
AGENT_FAILURE_EXIT = 255


class LaunchError(LauncherError):
    """Some hosts could not be started; ``failures`` maps each to the reason.
    ``start_timeout``: the start timeout, where it ran out (the error says how to raise it)."""

    def __init__(
        self, failures: dict[str, str], total: int, start_timeout: float | None = None
    ) -> None:
        self.failures = failures
        self.total = total
        lines = [f"could not start the job on {len(failures)} of {total} host(s):"]
        width = max(len(host) for host in failures)
        lines += [f"  {host:<{width}}  {reason}" for host, reason in failures.items()]
        if start_timeout is not None:
            lines.append(
                f"the start timeout ({start_timeout:g} s) ran out: give the hosts longer with "
                "--start-timeout SECONDS (or HOROVOD_START_TIMEOUT=SECONDS)"
            )
        super().__init__("\n".join(lines))


class RendezvousListenError(LauncherError):
    """The rendezvous server cannot listen where it was told to (a busy port, an address that
    is not this machine's); no host is to blame."""


class LaunchInterrupted(LauncherError):
    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


def make_agent(
    hostname: str, cwd: str, env: dict[str, str], options: LaunchOptions
) -> AgentConnection:
    """A LocalAgent for this machine, else a RemoteAgent (which imports paramiko)."""
    if is_local_host(hostname):
        return LocalAgent(hostname, cwd)
    from launcher.transport.remote import RemoteAgent
    from launcher.transport.ssh_config import resolve_target

    target = resolve_target(hostname, options.ssh)
    if target.hostname != hostname.rpartition("@")[2] and is_local_host(target.hostname):
        return LocalAgent(hostname, cwd)
    return RemoteAgent(target, options.python, cwd, env, options.agent_timeout)


def open_agents(
    hostnames: Sequence[str],
    cwd: str,
    env: dict[str, str],
    options: LaunchOptions,
    progress: Callable[[int, int], None] = lambda done, total: None,
    interrupted: Callable[[], int | None] = lambda: None,
) -> tuple[dict[str, AgentConnection], dict[str, str], int | None]:
    """Starts every host's agent in parallel, within the start timeout.

    Returns the agents that said hello, the reason for each host that failed, and the
    signal that interrupted the start, if any. Agents of failed hosts are already dropped.
    """
    agents: dict[str, AgentConnection] = {}
    failures: dict[str, str] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + options.start_timeout

    changed = threading.Event()
    step = None
    if options.launcher == "slurm":
        from launcher.transport.srun import SlurmStep

        step = SlurmStep(hostnames, options.python, cwd, options.agent_timeout)

    def start_one(hostname: str) -> None:
        try:
            if step is not None:
                agent: AgentConnection = step.agents[hostname]
            else:
                agent = make_agent(hostname, cwd, env, options)
            with lock:
                agents[hostname] = agent
            agent.start(deadline)
        except AgentStartError as exc:
            reason = str(exc)
        except Exception as exc:  # SSHConnectError from the config file, or a bug
            reason = str(exc) or repr(exc)
        else:
            changed.set()
            return
        with lock:
            failures.setdefault(hostname, reason)
        changed.set()

    def ready() -> int:
        with lock:
            return sum(1 for agent in agents.values() if agent.hello is not None)

    threads = {
        name: threading.Thread(target=start_one, args=(name,), daemon=True) for name in hostnames
    }
    for thread in threads.values():
        thread.start()
    signum = None
    while any(thread.is_alive() for thread in threads.values()):
        signum = interrupted()
        if signum is not None or time.monotonic() >= deadline:
            break
        progress(ready(), len(hostnames))
        changed.wait(0.05)
        changed.clear()
    progress(ready(), len(hostnames))
    with lock:
        for name, thread in threads.items():
            if thread.is_alive() and name not in failures:
                agent = agents.get(name)
                stage = agent.current_stage() if agent is not None else "resolving the host"
                failures[name] = f"timed out after {options.start_timeout:g} s {stage}"
        failed = [agents.pop(name) for name in failures if name in agents]
    for agent in failed:
        agent.abort()
    ordered = {name: failures[name] for name in hostnames if name in failures}
    return {name: agents[name] for name in hostnames if name in agents}, ordered, signum


def start_agents(
    hostnames: Sequence[str],
    cwd: str,
    env: dict[str, str],
    options: LaunchOptions,
    progress: Callable[[int, int], None] = lambda done, total: None,
    interrupted: Callable[[], int | None] = lambda: None,
) -> list[AgentConnection]:
    """Every host's agent, or LaunchError/LaunchInterrupted with none left running."""
    started = time.monotonic()
    agents, failures, signum = open_agents(hostnames, cwd, env, options, progress, interrupted)
    # (open_agents returns before the start timeout unless some host ran out of it)
    timed_out = time.monotonic() - started >= options.start_timeout
    if signum is None and not failures and options.check_versions:
        failures.update(version_problems(installed_versions(), list(agents.values())))
    if signum is not None or failures:
        stop_agents(list(agents.values()))
        if signum is not None:
            raise LaunchInterrupted(signum)
        raise LaunchError(failures, len(hostnames), options.start_timeout if timed_out else None)
    return [agents[name] for name in hostnames]


def shared_machines(agents: Sequence[AgentConnection]) -> list[str]:
    """A note for each machine that several of the job's hosts reach, by their agents' host
    names (``-H node1:1,10.0.0.11:1``, one machine under two names): their workers run as
    if on two hosts, each with local rank 0 (the same GPU) and all the machine's cores.
    Names that all name this machine are left out: hvdrun notes those before it starts."""
    by_machine: dict[str, list[str]] = {}
    for agent in agents:
        machine = agent.hello.hostname if agent.hello is not None else None
        if machine:
            by_machine.setdefault(machine, []).append(agent.hostname)
    return [
        f"hosts {', '.join(names)} are one machine ({machine}, as their agents say): their "
        "workers run as if on separate hosts, each host's first worker with local rank 0 (the "
        "same GPU) and each given all the machine's cores; list the machine once, with all "
        "its slots"
        for machine, names in by_machine.items()
        if len(names) > 1 and not all(is_local_host(name) for name in names)
    ]


def stop_agents(agents: Sequence[AgentConnection], timeout: float = 2.0) -> None:
    """Closes every agent's stdin, waits a little for them to finish, then drops them."""
    for agent in agents:
        agent.close()
    deadline = time.monotonic() + timeout
    for agent in agents:
        agent.wait_finished(max(deadline - time.monotonic(), 0))
        agent.abort()


def _minor(version: str | None) -> str | None:
    return ".".join(version.split(".")[:2]) if version else None


def _public(version: str | None) -> str | None:
    return version.split("+", 1)[0] if version else None


def version_problems(
    reference: dict[str, str | None], agents: Sequence[AgentConnection]
) -> dict[str, str]:
    """Hosts whose Python (major.minor), hvdrun or torch (public) version differs from ours."""
    problems: dict[str, str] = {}
    for agent in agents:
        hello = agent.hello or Hello(protocol=None)
        if hello.protocol != PROTOCOL_VERSION:
            problems[agent.hostname] = (
                f"its hvdrun agent speaks protocol {hello.protocol}, this one "
                f"{PROTOCOL_VERSION}: install the same hvdrun version on every host"
            )
            continue
        differences = []
        if _minor(hello.python) != _minor(reference["python"]):
            differences.append(f"Python {hello.python} (here {reference['python']})")
        if hello.hvdrun != reference["hvdrun"]:
            differences.append(
                f"hvdrun {hello.hvdrun or 'not installed as a package'} "
                f"(here {reference['hvdrun']})"
            )
        if _public(hello.torch) != _public(reference["torch"]):
            differences.append(
                f"torch {hello.torch or 'not installed'} (here {reference['torch']})"
            )
        if differences:
            problems[agent.hostname] = (
                f"{hello.executable or 'its Python'} has {', '.join(differences)}: "
                f"install the same versions on every host, or pass --skip-version-check"
            )
    return problems


@dataclass
class RendezvousPlan:
    bind_host: str
    port: int
    addr_host: dict[str, str]  # hostname -> the address its workers use


def split_explicit(addr: str) -> tuple[str, int]:
    """``--rendezvous-addr ADDR[:PORT]`` as (host without brackets, port or 0)."""
    host, _, port_text = addr.rpartition(":") if _has_port(addr) else (addr, "", "")
    return host.strip("[]"), int(port_text) if port_text else 0


def agent_address(agent: AgentConnection) -> str | None:
    """The address of this machine that a remote agent's host reaches: its SSH connection's
    own, or through a ProxyCommand what the routes say; None when neither is known."""
    address = getattr(agent, "local_address", None)
    target = getattr(agent, "target", None)
    if address is None and target is not None:
        address = source_address(target.hostname)
    return address


def dial_host(
    agent: AgentConnection, agents: Sequence[AgentConnection], explicit: str | None
) -> str:
    """The address a host's workers dial the rendezvous at (an elastic job's host that
    joins later): ``--rendezvous-addr`` if given; else the address of this machine its
    agent reaches, where local workers face the remote hosts, if any (as in
    :func:`plan_rendezvous`); loopback when none is known."""
    if explicit:
        return split_explicit(explicit)[0]
    facing = (
        agent if agent.kind != "local" else next((a for a in agents if a.kind != "local"), None)
    )
    address = agent_address(facing) if facing is not None else None
    return address or "127.0.0.1"


def plan_rendezvous(agents: Sequence[AgentConnection], explicit: str | None) -> RendezvousPlan:
    """Where the server listens, and the address each host's workers dial."""
    remote = [agent for agent in agents if agent.kind != "local"]
    if explicit:
        host, port = split_explicit(explicit)
        return RendezvousPlan(bind_address({host}), port, {a.hostname: host for a in agents})
    if not remote:
        return RendezvousPlan("127.0.0.1", 0, {agent.hostname: "127.0.0.1" for agent in agents})
    failures: dict[str, str] = {}
    addr_host: dict[str, str] = {}
    for agent in remote:
        address = agent_address(agent)
        if address is None:
            failures[agent.hostname] = (
                "cannot tell which address of this machine it can reach (its connection "
                "runs through a ProxyCommand or ProxyJump and its name does not resolve "
                "here): pass --rendezvous-addr"
            )
            continue
        addr_host[agent.hostname] = address
    if failures:
        raise LaunchError(failures, len(agents))
    first = addr_host[remote[0].hostname]
    for agent in agents:
        addr_host.setdefault(agent.hostname, first)
    return RendezvousPlan(bind_address(set(addr_host.values())), 0, addr_host)


def _link_local(address: str) -> bool:
    """An IPv6 link-local address (``fe80::...``), which binds only with its interface's
    zone, which the addresses here have lost."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    return parsed.version == 6 and parsed.is_link_local


def bind_address(dialled: set[str]) -> str:
    """Where the server listens, given the addresses the hosts dial: the one address of this
    machine (or loopback) that they all dial, so that no other network reaches the port;
    else (a name, an address this machine does not have, as behind NAT, or several) every
    interface, IPv6 ones too where a dialled address is IPv6."""
    if len(dialled) == 1:
        only = next(iter(dialled))
        if is_loopback(only) or (only in local_addresses() and not _link_local(only)):
            return only
    return "::" if any(":" in address for address in dialled) else "0.0.0.0"


def host_addresses(
    agents: Sequence[AgentConnection], addr_host: Mapping[str, str]
) -> dict[str, str]:
    """The address by which this machine reaches each host of the job: a remote host's SSH
    target, resolved here; this machine's own, the address it faces the remote hosts with
    (``addr_host``: a :class:`RendezvousPlan`'s, by host). Loopback and unresolvable ones
    are left out."""
    found: dict[str, str] = {}
    for agent in agents:
        target = getattr(agent, "target", None)
        if agent.kind == "local" or target is None:
            address: str | None = addr_host.get(agent.hostname)
        else:
            address = resolve(target.hostname)
        if address and not is_loopback(address):
            found[agent.hostname] = address
    return found


def peer_addresses(addresses: dict[str, str], host: str) -> list[str]:
    """Of :func:`host_addresses`' answer, the addresses of the hosts other than ``host``."""
    return [address for other, address in addresses.items() if other != host]


def member_peers(
    agent: AgentConnection, members: Sequence[AgentConnection], explicit: str | None
) -> list[str]:
    """The addresses of the other hosts of an elastic job's generation (``members``, whose
    agents run) as this machine reaches them (:func:`host_addresses`, this machine's own
    being where its workers dial the rendezvous): whom ``agent``'s workers connect to, so
    that its host chooses the interface toward them (the ``peers`` of a fixed job)."""
    dialled = {member.hostname: dial_host(member, members, explicit) for member in members}
    return peer_addresses(host_addresses(members, dialled), agent.hostname)


def _has_port(text: str) -> bool:
    if text.startswith("["):
        return "]:" in text
    return text.count(":") == 1


def rendezvous_addr(plan: RendezvousPlan, hostname: str, port: int) -> str:
    return join_addr(plan.addr_host[hostname], port)
