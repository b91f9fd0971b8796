"""Runs one job: rendezvous server, one agent per host, and the supervision loop.

Exit rules (mpirun's): every worker exits 0 → 0. The first worker to fail decides the exit
code (128+N for signal N); every other worker on every host is then stopped, and hvdrun
names the rank, its host and the last lines of its stderr. SIGINT/SIGTERM to hvdrun stop
the job the same way and exit with 128+signal; a second signal kills without grace.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import secrets
import signal
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from launcher.hosts import HostSpec
from launcher.local import LocalAgent
from launcher.output import OutputSink
from launcher.protocol import AgentSpec, WorkerLaunch, bytes_of
from rendezvous.server import RendezvousServer
from rendezvous.slots import SlotInfo, assign_slots

log = logging.getLogger(__name__)

# How long agents get, beyond the workers' grace period, to report before they are killed.
AGENT_REPORT_SLACK = 10.0


@dataclass
class JobSpec:
    command: list[str]
    num_proc: int
    hosts: list[HostSpec]
    env: dict[str, str]
    cwd: str
    term_grace: float = 5.0


@dataclass
class WorkerFailure:
    rank: int
    hostname: str
    code: int
    error: str | None = None


@dataclass
class JobResult:
    exit_code: int
    failure: WorkerFailure | None = None
    interrupted_by: int | None = None
    exits: dict[int, int] = field(default_factory=dict)


def worker_env(slot: SlotInfo) -> dict[str, str]:
    """The per-rank part of a worker's environment (DESIGN.md)."""
    return {
        "HVDRUN_RANK": str(slot.rank),
        "HVDRUN_SIZE": str(slot.size),
        "HVDRUN_LOCAL_RANK": str(slot.local_rank),
        "HVDRUN_LOCAL_SIZE": str(slot.local_size),
        "HVDRUN_CROSS_RANK": str(slot.cross_rank),
        "HVDRUN_CROSS_SIZE": str(slot.cross_size),
        "HVDRUN_HOSTNAME": slot.hostname,
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_size),
    }


def agent_specs(
    spec: JobSpec, slots: Sequence[SlotInfo], rendezvous_addr: str, job_id: str, secret: str
) -> list[AgentSpec]:
    common = dict(spec.env)
    common.update(
        {
            "PYTHONUNBUFFERED": "1",
            "HVDRUN_RENDEZVOUS_ADDR": rendezvous_addr,
            "HVDRUN_JOB_ID": job_id,
            "HVDRUN_SECRET": secret,
        }
    )
    by_host: dict[str, AgentSpec] = {}
    for slot in slots:
        agent = by_host.get(slot.hostname)
        if agent is None:
            agent = by_host[slot.hostname] = AgentSpec(
                hostname=slot.hostname,
                command=list(spec.command),
                cwd=spec.cwd,
                env=common,
                term_grace=spec.term_grace,
            )
        agent.workers.append(WorkerLaunch(rank=slot.rank, env=worker_env(slot)))
    return list(by_host.values())


class _Signals:
    """Records SIGINT/SIGTERM for the supervision loop instead of raising mid-cleanup."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def _handle(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Signals]:
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class Supervisor:
    """Consumes agent events until every host has reported, stopping the job on failure."""

    def __init__(
        self,
        agents: list[LocalAgent],
        slots: Sequence[SlotInfo],
        sink: OutputSink,
        events: queue.Queue[dict[str, Any]],
        term_grace: float,
    ) -> None:
        self.agents = agents
        self.sink = sink
        self.events = events
        self.term_grace = term_grace
        self.host_of = {slot.rank: slot.hostname for slot in slots}
        self.pids: dict[int, int] = {}
        self.result = JobResult(exit_code=0)
        self._pending_hosts = {agent.hostname for agent in agents}
        self._stop_deadline: float | None = None

    def run(self, signals: _Signals) -> JobResult:
        handled_signals = 0
        while self._pending_hosts:
            while handled_signals < len(signals.received):
                self._on_signal(signals.received[handled_signals], first=handled_signals == 0)
                handled_signals += 1
            if self._stop_deadline is not None and time.monotonic() > self._stop_deadline:
                log.warning("agents did not report in time; killing them")
                for agent in self.agents:
                    agent.kill()
                self._stop_deadline = None
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            self._on_event(event)
        return self.result

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event["ev"]
        if kind == "out":
            self.sink.line(event["rank"], event["stream"], bytes_of(event["data"]))
        elif kind == "started":
            self.pids[event["rank"]] = event["pid"]
        elif kind == "exit":
            rank, code = event["rank"], event["code"]
            self.result.exits[rank] = code
            if event.get("error"):
                self.sink.message(f"rank {rank} on {event['host']}: {event['error']}")
            if code != 0:
                self._fail(WorkerFailure(rank, event["host"], code, event.get("error")))
        elif kind in ("done", "agent_exit"):
            host = event["host"]
            if host in self._pending_hosts:
                self._pending_hosts.discard(host)
                missing = [
                    r for r, h in self.host_of.items() if h == host and r not in self.result.exits
                ]
                if missing:
                    code = event.get("code", 1) or 1
                    self.sink.message(
                        f"the agent on {host} exited (code {code}) without reporting "
                        f"rank(s) {', '.join(map(str, missing))}"
                    )
                    self._fail(WorkerFailure(missing[0], host, 1, "agent exited"))

    def _fail(self, failure: WorkerFailure) -> None:
        if self.result.failure is None and self.result.interrupted_by is None:
            self.result.failure = failure
            self.result.exit_code = failure.code
            self._stop_all()

    def _on_signal(self, signum: int, first: bool) -> None:
        if first:
            self.sink.message(f"received {signal.Signals(signum).name}; stopping all workers")
            if self.result.failure is None:
                self.result.interrupted_by = signum
                self.result.exit_code = 128 + signum
            self._stop_all()
        else:
            self.sink.message("second signal: killing all workers now")
            for pid in self.pids.values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            for agent in self.agents:
                agent.kill()

    def _stop_all(self) -> None:
        if self._stop_deadline is None:
            self._stop_deadline = time.monotonic() + self.term_grace + AGENT_REPORT_SLACK
            for agent in self.agents:
                agent.terminate()


def describe_exit(code: int) -> str:
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(code - 128).name} (exit code {code})"
    return f"exit code {code}"


def report_failure(result: JobResult, sink: OutputSink) -> None:
    failure = result.failure
    if failure is None:
        return
    what = describe_exit(failure.code)
    sink.message(f"rank {failure.rank} on host {failure.hostname} failed first: {what}")
    others = sorted(r for r, c in result.exits.items() if c != 0 and r != failure.rank)
    if others:
        sink.message(f"stopped or failed afterwards: rank(s) {', '.join(map(str, others))}")
    tail = sink.stderr_tail(failure.rank)
    if tail:
        sink.message(f"last lines of rank {failure.rank}'s stderr:")
        for line in tail:
            sink.message(f"    {line}")


def run_job(spec: JobSpec, sink: OutputSink) -> JobResult:
    slots = assign_slots([(h.hostname, h.slots) for h in spec.hosts], spec.num_proc)
    secret = secrets.token_urlsafe(32)
    job_id = uuid.uuid4().hex[:16]
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    with _Signals().installed() as signals:
        server = RendezvousServer(slots, secret, job_id, bind_host="127.0.0.1")
        port = server.start()
        try:
            specs = agent_specs(spec, slots, f"127.0.0.1:{port}", job_id, secret)
            agents = [LocalAgent(agent_spec, events) for agent_spec in specs]
            for agent in agents:
                agent.start()
            result = Supervisor(agents, slots, sink, events, spec.term_grace).run(signals)
        finally:
            server.stop()
    report_failure(result, sink)
    return result
