"""Runs one job: one agent per host, the rendezvous server, and the supervision loop.

Exit rules (mpirun's): every worker exits 0 → 0. The first worker to fail decides the exit
code (128+N for signal N); every other worker on every host is then stopped, and hvdrun
names the rank, its host and the last lines of its stderr, with a table of every rank.
SIGINT/SIGTERM to hvdrun stop the job the same way and exit with 128+signal; a second signal
kills without grace. A host that cannot be started, or whose agent is lost mid-job (SSH
connection dropped, no heartbeat), makes hvdrun exit with 255, like ssh.

Elastic jobs (``JobSpec.elastic`` set) are run by :mod:`launcher.supervision.elastic` instead, which
keeps going when hosts fail, join or leave.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Sequence

from launcher.output import OutputSink
from launcher.spec.job import JobSpec
from launcher.supervision.core import (
    AGENT_REPORT_SLACK,
    JobResult,
    Signals,
    WorkerFailure,
    agent_loss_reason,
    agent_spec,
)
from launcher.supervision.report import report_failure
from launcher.transport.connection import AgentConnection, AgentExit, HostEvent
from launcher.transport.protocol import Done, Exit, Network, Output
from launcher.transport.startup import (
    AGENT_FAILURE_EXIT,
    plan_rendezvous,
    rendezvous_addr,
    start_agents,
    stop_agents,
)
from rendezvous import worker_env
from rendezvous.server import RendezvousServer
from rendezvous.slots import SlotInfo, assign_slots

log = logging.getLogger(__name__)


class Supervisor:
    """Consumes agent events until every host has reported, stopping the job on failure."""

    def __init__(
        self,
        agents: list[AgentConnection],
        slots: Sequence[SlotInfo],
        sink: OutputSink,
        events: queue.Queue[HostEvent],
        term_grace: float,
        server: RendezvousServer | None = None,
    ) -> None:
        self.agents = {agent.hostname: agent for agent in agents}
        self.sink = sink
        self.events = events
        self.term_grace = term_grace
        self.server = server
        self.host_of = {slot.rank: slot.hostname for slot in slots}
        self.result = JobResult(exit_code=0, hosts=dict(self.host_of))
        self._pending_hosts = set(self.agents)
        self._stop_deadline: float | None = None
        self._stopping = False
        self._registered = -1

    def run(self, signals: Signals) -> JobResult:
        while self._pending_hosts:
            signals.handle(self.result, self.sink, self._stop_all, self._kill_all)
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                log.warning("agents did not report in time; killing them")
                self._kill_all()
                self._stop_deadline = None
            self._check_heartbeats()
            self._show_status()
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._on_event(event)
        self.sink.status(None)
        return self.result

    def _show_status(self) -> None:
        if self.server is None or self._registered >= len(self.host_of):
            return
        registered = self.server.registered_count()
        if registered != self._registered:
            self._registered = registered
            total = len(self.host_of)
            if registered >= total or self._stopping:
                self.sink.status(None)
            else:
                hosts = len(self.agents)
                self.sink.status(
                    f"connected {hosts}/{hosts} hosts, {registered}/{total} workers registered"
                )

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for host in list(self._pending_hosts):
            agent = self.agents[host]
            timeout = agent.heartbeat_timeout
            # The reader thread stamps last_heard, so a slow terminal cannot fake a silence.
            if timeout > 0 and now - agent.last_heard > timeout:
                self._lose_host(host, f"heard nothing from its agent for {timeout:g} s")
                agent.abort()  # its agent stops its workers on its own heartbeat timeout

    def _on_event(self, item: HostEvent) -> None:
        host, event = item.host, item.event
        match event:
            case Output(rank, stream, data):
                self.sink.line(rank, stream, data)
            case Exit(rank, code, error):
                self.result.exits[rank] = code
                if self._stopping:
                    self.result.stopped.add(rank)
                if error:
                    self.sink.message(f"rank {rank} on {host}: {error}")
                if code != 0:
                    self._fail(WorkerFailure(rank, host, code, error))
            case Network(ifname):
                log.info("workers on %s use interface %s", host, ifname)
            case Done() | AgentExit():
                if host in self._pending_hosts:
                    self._lose_host(host, agent_loss_reason(event))

    def _lose_host(self, host: str, why: str) -> None:
        self._pending_hosts.discard(host)
        missing = [r for r, h in self.host_of.items() if h == host and r not in self.result.exits]
        if not missing:
            return
        self.sink.message(
            f"host {host}: {why}; rank(s) {', '.join(map(str, missing))} not reported"
        )
        for rank in missing:
            self.result.lost[rank] = why
        self._fail(WorkerFailure(missing[0], host, AGENT_FAILURE_EXIT, why))

    def _fail(self, failure: WorkerFailure) -> None:
        if self.result.failure is None and self.result.interrupted_by is None:
            self.result.failure = failure
            self.result.exit_code = failure.code
            self._stop_all()

    def _kill_all(self) -> None:
        for host in self._pending_hosts:
            self.agents[host].kill()

    def _stop_all(self) -> None:
        if self._stop_deadline is None and not self._stopping:
            self._stopping = True
            self.sink.status(None)
            self._stop_deadline = time.monotonic() + self.term_grace + AGENT_REPORT_SLACK
            for host in self._pending_hosts:
                self.agents[host].terminate()


def run_fixed_job(spec: JobSpec, sink: OutputSink) -> JobResult:
    """Starts and supervises a fixed job; raises LaunchError when a host cannot be started."""
    slots = assign_slots([(h.hostname, h.slots) for h in spec.hosts], spec.num_proc)
    hostnames = list(dict.fromkeys(slot.hostname for slot in slots))
    secret = worker_env.new_secret()
    job_id = worker_env.new_job_id()
    events: queue.Queue[HostEvent] = queue.Queue()
    options = spec.launch
    sink.open_files(range(spec.num_proc))
    try:
        with Signals().installed() as signals:
            agents = start_agents(
                hostnames,
                spec.cwd,
                spec.env,
                options,
                progress=lambda done, total: sink.status(
                    f"connected {done}/{total} hosts, 0/{spec.num_proc} workers registered"
                ),
                interrupted=signals.first,
            )
            try:
                result = _supervise(spec, agents, slots, sink, events, signals, secret, job_id)
            finally:
                stop_agents(agents)
    finally:
        sink.close()
    report_failure(result, sink)
    return result


def _supervise(
    spec: JobSpec,
    agents: list[AgentConnection],
    slots: Sequence[SlotInfo],
    sink: OutputSink,
    events: queue.Queue[HostEvent],
    signals: Signals,
    secret: str,
    job_id: str,
) -> JobResult:
    plan = plan_rendezvous(agents, spec.launch.rendezvous_addr)
    server = RendezvousServer(slots, secret, job_id, bind_host=plan.bind_host, port=plan.port)
    port = server.start()
    try:
        for agent in agents:
            host = agent.hostname
            addr = rendezvous_addr(plan, host, port)
            agent.launch(
                agent_spec(spec, host, slots, addr, job_id, secret, agent.heartbeat_timeout),
                events,
            )
        return Supervisor(agents, slots, sink, events, spec.term_grace, server).run(signals)
    finally:
        server.stop()
