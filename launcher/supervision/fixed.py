"""The fixed-job supervisor: every rank runs once, and the first failure ends the job.

Exit rules (mpirun's): every worker exits 0 → 0. The first worker to fail decides the exit
code (128+N for signal N); every other worker on every host is then stopped, and hvdrun
names the rank, its host and the last lines of its stderr, with a table of every rank. A
worker that fails while another is stopped (SIGSTOP, a debugger) names the stopped one as
the cause, with the failed worker's exit code.
SIGINT/SIGTERM to hvdrun stop the job the same way and exit with 128+signal; a second signal
kills without grace. So does a signal that reaches an agent from outside hvdrun (``scancel``
of the job, its time limit, a ``kill``), and the workers that the same signal killed are
not named as the first failure. A host that cannot be started, or whose agent is lost mid-job (SSH
connection dropped, no heartbeat), makes hvdrun exit with 255, like ssh.

The loop, signals, deadlines and heartbeats are :mod:`launcher.supervision.core`'s; this
module adds what is particular to a fixed job: every host must report each of its ranks,
and a status line counts the workers registered at the rendezvous. Elastic jobs
(``JobSpec.elastic`` set) are run by :mod:`launcher.supervision.elastic` instead.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Callable, Sequence

from launcher.output import OutputSink
from launcher.spec.job import JobSpec
from launcher.spec.options import ReportOptions
from launcher.supervision.core import (
    STOP_BLAME_SHARE,
    Events,
    JobResult,
    Signals,
    Supervised,
    Supervision,
    WorkerFailure,
    agent_loss_reason,
    agent_spec,
    collective_timeout,
    rank_list,
    signalled_message,
    start_server,
)
from launcher.supervision.insight import InsightWatch
from launcher.transport.connection import (
    AgentConnection,
    AgentExit,
    AgentStartError,
    HostEvent,
    StepCancelled,
)
from launcher.transport.protocol import (
    Continued,
    Done,
    Exit,
    Lines,
    Network,
    Output,
    Signalled,
    Stopped,
)
from launcher.transport.startup import (
    AGENT_FAILURE_EXIT,
    LaunchError,
    host_addresses,
    peer_addresses,
    plan_rendezvous,
    rendezvous_addr,
    shared_machines,
    start_agents,
    stop_agents,
)
from rendezvous import worker_env
from rendezvous.server import RendezvousServer
from rendezvous.slots import SlotInfo, assign_slots
from rendezvous.tls import certificate_for

log = logging.getLogger(__name__)

#: How long a failed worker whose collectives another rank's leaving ended waits for that
#: rank's exit, which names the job's first failure when it fails too (see
#: ``worker_env.ENDED_BY_KEY_PREFIX``).
ENDED_BY_WAIT = 5.0
#: A rank that has not called hvd.init() this long after the first rank did is named once:
#: the ranks in hvd.init() wait for it there (until their bootstrap times out).
JOIN_NOTICE_SECONDS = 30.0
#: A worker that fails while another host's agent has been silent for over this share of
#: its ``--agent-timeout`` (it pings every quarter) is held back until that agent is heard
#: from again or counts as lost: a host cut off from hvdrun stops its own workers after
#: ``--heartbeat-timeout``, and their peers' failures reach hvdrun before its own check of
#: the silence, which names the host that is the cause.
SILENT_SHARE = 0.5


class Supervisor(Supervision[HostEvent]):
    """Consumes agent events until every host has reported, stopping the job on failure."""

    def __init__(
        self,
        agents: Sequence[Supervised],
        slots: Sequence[SlotInfo],
        sink: OutputSink,
        events: Events[HostEvent],
        term_grace: float,
        signals: Signals,
        server: RendezvousServer | None = None,
        clock: Callable[[], float] = time.monotonic,
        report: ReportOptions | None = None,
    ) -> None:
        super().__init__(sink, events, term_grace, signals, clock)
        self.agents = {agent.hostname: agent for agent in agents}
        self.server = server
        self.host_of = {slot.rank: slot.hostname for slot in slots}
        self._slot_of = {slot.rank: (slot.hostname, slot.local_rank) for slot in slots}
        self.result.hosts = dict(self.host_of)
        self._pending_hosts = set(self.agents)  # hosts that have not reported every rank yet
        self._registered = -1
        # Failures held back: rank -> (its failure, the rank whose leaving ended its
        # collectives and has not exited yet, or None while another host's agent is
        # silent, when to stop waiting for it).
        self._held: dict[int, tuple[WorkerFailure, int | None, float]] = {}
        # Slurm cancelled the agents' step: every agent is then killed with its workers
        # (``scancel JOB.STEP`` sends SIGKILL), and the cancel message has said why.
        self._step_cancelled = False
        # Ranks that exited 0 without registering: they never joined the job (no
        # hvd.init()), and ranks that did may wait for them in hvd.init(). rank -> host
        self._unjoined: dict[int, str] = {}
        self._everyone_registered = False
        self._first_joined: float | None = None  # (clock) when a rank first registered
        if server is not None:
            self.insight = InsightWatch(server.values_under, sink, report)

    def run(self) -> JobResult:
        result = super().run()
        self.sink.status(None)
        return result

    def finished(self) -> bool:
        return not self._pending_hosts

    def live_agents(self) -> list[Supervised]:
        return [self.agents[host] for host in self._pending_hosts]

    def on_silent(self, agent: Supervised, why: str) -> bool:
        self._lose_host(agent.hostname, why)
        return True

    def after_events(self, now: float) -> None:
        for failure, culprit, deadline in list(self._held.values()):
            if now >= deadline or (
                culprit is None and self._silent_agent(failure.hostname, now) is None
            ):
                self._held.clear()
                self.fail(failure)
                break
        if self._unjoined and not self.stopping:
            self._fail_unjoined(self._registered_slots())
        self._show_status()

    def _registered_slots(self) -> frozenset[tuple[str, int]] | None:
        """The slots that registered; None when unknown or when every one has (then no rank
        can have left without joining: the server is not asked again at every exit)."""
        if self.server is None or self._everyone_registered:
            return None
        try:
            registered = self.server.registered_slots()
        except TimeoutError:  # (asked again after the next events)
            return None
        self._everyone_registered = len(registered) >= len(self._slot_of)
        return None if self._everyone_registered else registered

    def _fail_unjoined(self, registered: frozenset[tuple[str, int]] | None) -> None:
        """A rank that never joined the job exited while others that joined run on: they
        would wait for it in hvd.init() until the bootstrap's timeout (300 s). The job
        stops at once."""
        if self.stopping or registered is None:
            return
        waiting = [
            r
            for r, slot in self._slot_of.items()
            if slot in registered and r not in self.result.exits
        ]
        if not waiting:
            return
        rank, host = min(self._unjoined.items())
        why = (
            "it exited (code 0) without joining the job (no hvd.init()) while other ranks "
            "wait for it in hvd.init(): every rank must call hvd.init()"
        )
        self.fail(WorkerFailure(rank, host, 1, why))

    def on_event(self, item: HostEvent) -> None:
        host, event = item.host, item.event
        match event:
            case Output(rank, stream, data, end, shown):
                self.sink.line(rank, stream, data, end, shown)
            case Lines(rank, stream, data):
                self.sink.lines(rank, stream, data)
            case Exit(rank, code, error):
                self.record_exit(rank, code)
                if error:
                    self.sink.message(f"rank {rank} on {host}: {error}")
                if code != 0:
                    self._failed(WorkerFailure(rank, host, code, error))
                else:
                    registered = self._registered_slots()
                    if registered is not None and self._slot_of[rank] not in registered:
                        self._unjoined[rank] = host
                        self._fail_unjoined(registered)
                    self._left(rank)
            case Stopped() | Continued():
                self.record_stop(host, event)
            case Network(ifname):
                log.info("workers on %s use interface %s", host, ifname)
            case StepCancelled(message):
                self._step_cancelled = True
                if self.result.interrupted_by is not None:  # (an agent's SIGTERM came first)
                    self.sink.message(message)
                self.interrupt(signal.SIGTERM, message)
                self.answer_due = None  # (Slurm ends the agents: none is cut off)
            case Signalled(signum):
                self.interrupt(signum, signalled_message(host, signum))
            case Done() | AgentExit():
                if host in self._pending_hosts:
                    # (one hvdrun killed, after a second signal: said already)
                    quiet = isinstance(event, AgentExit) and event.killed_by_hvdrun
                    self._lose_host(host, agent_loss_reason(event), quiet)

    def _failed(self, failure: WorkerFailure) -> None:
        """A worker failed. When another rank's leaving ended its collectives and that rank
        is still exiting, that rank is waited for: if it fails too, it failed first."""
        stopped = self.stop_behind(failure)
        if stopped is not None:  # (a stopped worker, whose peers' collectives timed out)
            self._held.clear()
            self.fail(stopped)
            return
        rank = failure.rank
        stalled = self._stalled_by(failure)
        if stalled is not None:  # (a rank that never submitted an op the others waited for)
            self._held.clear()
            self.fail(stalled)
            return
        # Failures that waited for this rank: this one (or what it waits for) comes first.
        self._held = {r: held for r, held in self._held.items() if held[1] != rank}
        culprit = self._ended_by(rank)
        if culprit is not None and culprit not in self.result.exits and not self.stopping:
            self._held[rank] = (failure, culprit, self.clock() + ENDED_BY_WAIT)
            return
        silent = None if self.stopping else self._silent_agent(failure.hostname, self.clock())
        if silent is not None:
            self._held[rank] = (failure, None, self.clock() + silent.heartbeat_timeout)
            return
        self.fail(failure)

    def _silent_agent(self, host: str, now: float) -> Supervised | None:
        """Another live host's agent that has been silent for long (see SILENT_SHARE)."""
        for other in sorted(self._pending_hosts - {host}):
            agent = self.agents[other]
            timeout = agent.heartbeat_timeout
            if timeout > 0 and now - agent.last_heard > timeout * SILENT_SHARE:
                return agent
        return None

    def _left(self, rank: int) -> None:
        """A worker exited 0: failures that waited for it stand (it left cleanly)."""
        for failure, culprit, _ in list(self._held.values()):
            if culprit == rank:
                self._held.clear()
                self.fail(dataclasses.replace(failure, ended_by=rank))
                return

    def _worker_said(self, prefix: str, rank: int) -> bytes:
        """What rank ``rank`` left in the store under ``prefix`` before it exited (b"": nothing,
        or the server too busy to answer)."""
        if self.server is None:
            return b""
        key = prefix + str(rank)
        try:
            return self.server.values_under(key).get(key, b"")
        except TimeoutError:
            return b""

    def _ended_by(self, rank: int) -> int | None:
        value = self._worker_said(worker_env.ENDED_BY_KEY_PREFIX, rank)
        return int(value) if value.isdigit() else None

    def _stalled_by(self, failure: WorkerFailure) -> WorkerFailure | None:
        """The failure to name when the stall inspector stopped ``failure``'s collectives
        because another rank, still running, never submitted an op they waited for: that
        rank's, with ``failure``'s exit code (see ``worker_env.STALLED_BY_KEY_PREFIX``)."""
        value = self._worker_said(worker_env.STALLED_BY_KEY_PREFIX, failure.rank)
        rank_text, _, op = value.decode(errors="replace").partition("\n")
        if not rank_text.isdigit() or not op:
            return None
        rank = int(rank_text)
        if rank not in self.host_of or rank in self.result.exits:
            return None  # (an exit of its own: heard of, and named, as it came)
        why = (
            f"it never submitted {op}, which rank {failure.rank} waited for until the stall "
            "inspector stopped the job's collectives (--stall-check-shutdown-time-seconds) "
            f"(rank {failure.rank} exited first, with exit code {failure.code})"
        )
        return WorkerFailure(rank, self.host_of[rank], failure.code, why, peer=failure, stalled=op)

    def _show_status(self) -> None:
        if self.server is None or self._registered >= len(self.host_of):
            return
        try:
            registered = self.server.registered_count()
        except TimeoutError:  # (a status line: the next step asks again)
            return
        if registered and self._first_joined is None:
            self._first_joined = self.clock()
        self._name_late_joiners()
        if registered != self._registered:
            self._registered = registered
            total = len(self.host_of)
            if registered >= total or self.stopping:
                self.sink.status(None)
            else:
                hosts = len(self.agents)
                self.sink.status(
                    f"connected {hosts}/{hosts} hosts, {registered}/{total} workers registered"
                )

    def _name_late_joiners(self) -> None:
        """Once, :data:`JOIN_NOTICE_SECONDS` after the first rank registered: the live ranks
        that have not (a script that calls hvd.init() on some ranks only waits silently)."""
        first = self._first_joined
        if first is None or self.stopping or self.clock() - first < JOIN_NOTICE_SECONDS:
            return
        self._first_joined = float("inf")  # (said once)
        registered = self._registered_slots()
        if registered is None:
            return
        late = [
            rank
            for rank, slot in self._slot_of.items()
            if slot not in registered and rank not in self.result.exits
        ]
        if late:
            hosts = ", ".join(sorted({self.host_of[rank] for rank in late}))
            self.sink.message(
                f"rank(s) {rank_list(late)} (on {hosts}) have not called hvd.init() "
                f"{JOIN_NOTICE_SECONDS:g} s after the first rank did: the ranks in hvd.init() "
                "wait for them there until it times out (every rank must call hvd.init())"
            )

    def _lose_host(self, host: str, why: str, quiet: bool = False) -> None:
        self._pending_hosts.discard(host)
        missing = [r for r, h in self.host_of.items() if h == host and r not in self.result.exits]
        if not missing:
            return
        if not (self._step_cancelled or quiet):
            self.sink.message(f"host {host}: {why}; rank(s) {rank_list(missing)} not reported")
        for rank in missing:
            self.result.lost[rank] = why
        self.fail(WorkerFailure(missing[0], host, AGENT_FAILURE_EXIT, why))


def run_fixed_job(spec: JobSpec, sink: OutputSink) -> JobResult:
    """Starts and supervises a fixed job; raises LaunchError when a host cannot be started."""
    slots = assign_slots([(h.hostname, h.slots) for h in spec.hosts], spec.num_proc)
    hostnames = list(dict.fromkeys(slot.hostname for slot in slots))
    secret = worker_env.new_secret()
    job_id = worker_env.new_job_id()
    events: Events[HostEvent] = Events(sink)
    options = spec.launch
    sink.open_files(range(spec.num_proc))
    with Signals().installed() as signals:
        try:
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
            for note in shared_machines(agents):
                sink.message(f"note: {note}")
            try:
                return _supervise(spec, agents, slots, sink, events, signals, secret, job_id)
            finally:
                stop_agents(agents)
        finally:
            sink.close(interrupted=signals.first)  # (a Ctrl-C ends a wait for a slow reader)


def master_env(
    spec: JobSpec,
    agents: Sequence[AgentConnection],
    slots: Sequence[SlotInfo],
    addr: str,
    addresses: dict[str, str],
) -> dict[str, str]:
    """``MASTER_ADDR``/``MASTER_PORT`` for plain torch.distributed scripts, picked by rank 0's
    agent on its host (facing most of the other hosts, at ``addresses``), unless the user
    set both with ``-x``."""
    if worker_env.TORCH_MASTER_ADDR in spec.env and worker_env.TORCH_MASTER_PORT in spec.env:
        return {}
    host = next(slot.hostname for slot in slots if slot.rank == 0)
    agent = next(agent for agent in agents if agent.hostname == host)
    try:
        prepared = agent.request_prepare(
            addr, spec.launch.start_timeout, peer_addresses(addresses, host)
        )
    except AgentStartError as exc:
        raise LaunchError({host: str(exc)}, len(agents)) from None
    env = worker_env.master_env(prepared.address, prepared.port)
    for name in env:  # a user's -x MASTER_ADDR=... (or MASTER_PORT) wins
        if name in spec.env:
            env[name] = spec.env[name]
    return env


def _supervise(
    spec: JobSpec,
    agents: list[AgentConnection],
    slots: Sequence[SlotInfo],
    sink: OutputSink,
    events: Events[HostEvent],
    signals: Signals,
    secret: str,
    job_id: str,
) -> JobResult:
    plan = plan_rendezvous(agents, spec.launch.rendezvous_addr)
    # Reachable from other hosts: TLS with a certificate of this job (the key stays here).
    tls = certificate_for(plan.bind_host, job_id)
    cert_pem = tls.cert_pem.decode("ascii") if tls is not None else ""
    server = RendezvousServer(
        slots, secret, job_id, bind_host=plan.bind_host, port=plan.port, tls=tls
    )
    port = start_server(server, spec.launch.rendezvous_addr)
    try:
        server.put_values(spec.preset)
        rank0 = next(slot.hostname for slot in slots if slot.rank == 0)
        addresses = host_addresses(agents, plan.addr_host)
        master = master_env(spec, agents, slots, rendezvous_addr(plan, rank0, port), addresses)
        for agent in agents:
            host = agent.hostname
            addr = rendezvous_addr(plan, host, port)
            launch = agent_spec(
                spec, host, slots, addr, job_id, secret, agent.heartbeat_timeout, cert_pem
            )
            launch.env.update(master)
            launch.peers = peer_addresses(addresses, host)
            agent.launch(launch, events)
        supervisor = Supervisor(
            agents, slots, sink, events, spec.term_grace, signals, server, report=spec.report
        )
        supervisor.stop_blame_after = STOP_BLAME_SHARE * collective_timeout(spec.env)
        result = supervisor.run()
        result.job_id = job_id
        if spec.collect is not None:
            result.collected = server.values_under(spec.collect)
        return result
    finally:
        server.stop()
