"""``hvdrun --check-hosts -H ...``: can a job run on these hosts? Ask before launching.

Connects to every host exactly as a job would (same SSH settings, same agent), has each
agent describe its host (Python, torch, hvdrun, GPUs, NCCL, the interface that faces this
machine, or the one a job's Gloo and NCCL get where another faces most of the other hosts)
and open a TCP connection back to this machine, as the workers will to reach the
rendezvous. With several hosts, every host then tries a TCP connection to every other one's
Gloo address, as the ranks of a job will. Prints one table row per host, then each host's
problems and the versions on which hosts disagree. Exits 1 when any host is unusable
(unreachable, hvdrun or torch missing, versions that differ from this machine's, no route
back, another host it cannot reach), else 0.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from launcher.spec.options import LaunchOptions
from launcher.transport.connection import AgentConnection, AgentStartError
from launcher.transport.hostinfo import installed_versions
from launcher.transport.reachability import PEER_TIMEOUT, Listener
from launcher.transport.startup import (
    LaunchError,
    host_addresses,
    open_agents,
    peer_addresses,
    plan_rendezvous,
    stop_agents,
    version_problems,
)
from rendezvous.addresses import join_addr

PROBE_TIMEOUT = 180.0
#: How long hvdrun waits for a host to say which others it reached (each try gets
#: reachability.PEER_TIMEOUT; the tries run at once).
REACH_TIMEOUT = PEER_TIMEOUT + 20.0
COLUMNS = ("HOST", "STATUS", "PYTHON", "TORCH", "HVDRUN", "GPUS", "NCCL", "INTERFACE")


@dataclass
class HostReport:
    hostname: str
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not self.problems

    def cells(self) -> dict[str, str]:
        facts = self.facts
        gpus = facts.get("gpus")
        if gpus is None:
            gpu_text = "-"
        elif gpus:
            names = sorted({name.removeprefix("NVIDIA ") for name in gpus})
            gpu_text = f"{len(gpus)} x {names[0]}" if len(names) == 1 else f"{len(gpus)} (mixed)"
        else:
            gpu_text = "0"
        interface = "-"
        if facts.get("gloo_ifname"):  # Gloo's interface faces the other hosts, not hvdrun
            interface = f"{facts['gloo_ifname']} {facts.get('gloo_address') or ''}".strip()
            interface += f" (hvdrun: {facts.get('ifname') or '?'})"
        elif facts.get("ifname") or facts.get("address"):
            interface = f"{facts.get('ifname') or '?'} {facts.get('address') or ''}".strip()
        return {
            "HOST": self.hostname,
            "STATUS": "ok" if self.usable else "UNUSABLE",
            "PYTHON": facts.get("python") or "-",
            "TORCH": facts.get("torch") or ("-" if not facts else "missing"),
            "HVDRUN": facts.get("hvdrun") or ("-" if not facts else "missing"),
            "GPUS": gpu_text,
            "NCCL": facts.get("nccl") or "-",
            "INTERFACE": interface,
        }


def probe_agents(
    agents: Sequence[AgentConnection], explicit_addr: str | None
) -> dict[str, HostReport]:
    reports = {agent.hostname: HostReport(agent.hostname) for agent in agents}
    if not agents:
        return reports
    try:
        plan = plan_rendezvous(agents, explicit_addr)
    except LaunchError as exc:
        for host, reason in exc.failures.items():
            reports[host].problems.append(reason)
        agents = [agent for agent in agents if agent.hostname not in exc.failures]
        if not agents:
            return reports
        plan = plan_rendezvous(agents, explicit_addr)
    listener = Listener(plan.bind_host)
    try:
        addresses = host_addresses(agents, plan.addr_host)
        mesh = len(agents) > 1

        def probe(agent: AgentConnection) -> None:
            report = reports[agent.hostname]
            addr = join_addr(plan.addr_host[agent.hostname], listener.port)
            peers = peer_addresses(addresses, agent.hostname)
            try:
                report.facts = agent.request_probe(addr, PROBE_TIMEOUT, peers, mesh)
            except AgentStartError as exc:
                report.facts = agent.hello.facts() if agent.hello is not None else {}
                report.problems.append(str(exc))
                return
            if report.facts.get("torch_error"):
                report.problems.append(report.facts["torch_error"])
            if report.facts.get("connect_back_error"):
                report.problems.append(
                    "its workers could not reach this machine: "
                    f"{report.facts['connect_back_error']} (firewall? try --rendezvous-addr)"
                )
            if report.facts.get("gloo_listen_error"):
                report.problems.append(
                    f"the other hosts cannot be checked: {report.facts['gloo_listen_error']}"
                )

        each_at_once(probe, agents)
        if mesh:
            reach_each_other(agents, reports)
    finally:
        listener.close()
    return reports


def each_at_once(
    work: Callable[[AgentConnection], None], agents: Sequence[AgentConnection]
) -> None:
    threads = [threading.Thread(target=work, args=(agent,)) for agent in agents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def reach_each_other(agents: Sequence[AgentConnection], reports: dict[str, HostReport]) -> None:
    """Every host that listens on its Gloo address (its mesh probe's ``gloo_listen``) tries
    a TCP connection to every other one's, as a job's ranks will: a firewall between two
    hosts that both reach this machine shows here, not as a job that stops in hvd.init()."""
    facts = {agent.hostname: reports[agent.hostname].facts for agent in agents}
    targets = {host: f["gloo_listen"] for host, f in facts.items() if f.get("gloo_listen")}
    listening = [agent for agent in agents if agent.hostname in targets]

    def reach(agent: AgentConnection) -> None:
        others = {host: addr for host, addr in targets.items() if host != agent.hostname}
        try:
            results = agent.request_reach(others, REACH_TIMEOUT)
        except AgentStartError as exc:
            reports[agent.hostname].problems.append(str(exc))
            return
        for host, why in sorted(results.items()):
            if why is not None:
                interface = facts[host].get("gloo_ifname") or facts[host].get("ifname") or "?"
                reports[agent.hostname].problems.append(
                    f"cannot reach host {host} at the address its workers give Gloo "
                    f"({interface}): {why} (a firewall between the hosts? "
                    "--network-interface chooses the interface)"
                )

    each_at_once(reach, listening if len(listening) > 1 else [])


def disagreements(reports: Sequence[HostReport]) -> list[str]:
    """One line per fact on which the reachable hosts differ."""
    lines = []
    for column in ("PYTHON", "TORCH", "HVDRUN", "GPUS", "NCCL"):
        values: dict[str, list[str]] = {}
        for report in reports:
            if report.facts:
                values.setdefault(report.cells()[column], []).append(report.hostname)
        if len(values) > 1:
            parts = [f"{value} on {', '.join(hosts)}" for value, hosts in values.items()]
            lines.append(f"hosts disagree on {column.lower()}: {'; '.join(parts)}")
    return lines


def format_table(reports: Sequence[HostReport]) -> list[str]:
    rows = [dict(zip(COLUMNS, COLUMNS, strict=True))] + [report.cells() for report in reports]
    widths = {column: max(len(row[column]) for row in rows) for column in COLUMNS}
    return [
        "  ".join(row[column].ljust(widths[column]) for column in COLUMNS).rstrip() for row in rows
    ]


def check_hosts(
    hostnames: Sequence[str],
    cwd: str,
    env: dict[str, str],
    options: LaunchOptions,
    echo: Callable[[str], None],
) -> int:
    """Prints the table; returns 0 when every host is usable, else 1."""
    agents, failures, _ = open_agents(hostnames, cwd, env, options)
    try:
        reports = probe_agents(list(agents.values()), options.rendezvous_addr)
        if options.check_versions:
            mismatches = version_problems(installed_versions(), list(agents.values()))
            for host, problem in mismatches.items():
                reports[host].problems.append(problem)
    finally:
        stop_agents(list(agents.values()))
    for host, reason in failures.items():
        reports[host] = HostReport(host, problems=[reason])
    ordered = [reports[name] for name in hostnames]
    for line in format_table(ordered):
        echo(line)
    problems = [(r.hostname, p) for r in ordered for p in r.problems]
    if problems:
        echo("")
        echo("problems:")
        for host, problem in problems:
            echo(f"  {host}: {problem}")
    conflicts = disagreements(ordered)
    if conflicts:
        echo("")
        for line in conflicts:
            echo(line)
    usable = sum(1 for r in ordered if r.usable)
    echo("")
    echo(f"{usable} of {len(ordered)} host(s) usable")
    return 0 if usable == len(ordered) else 1
