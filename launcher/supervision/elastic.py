"""The elastic driver: ``hvdrun -np N --min-np A --max-np B [--host-discovery-script S]``.

It runs the job on whatever hosts discovery offers and keeps it running while hosts fail,
join and leave, without restarting the workers that survive:

* Hosts are kept in the order they joined; every membership generation assigns ranks in
  that order (:func:`rendezvous.slots.assign_slots`), so older hosts keep the low ranks and
  rank 0 moves only when its host is gone.
* Each generation is published to the rendezvous server. Workers of the newest one start
  (new hosts) or re-register (survivors) and bootstrap fresh process groups; running
  workers hear of it on their Watch stream and switch at their next ``state.commit()``.
* A worker that fails, a host whose agent is lost (connection dropped, or silent for the
  failure timeout: a cut link), or whose workers do not rejoin the survivors of a failed
  collective within twice the Gloo timeout (a hung process) fails its host: it is
  blacklisted, its other workers are stopped, and the next generation is published from
  the rest at once, or, where a discovered host is starting to fill the freed slots, once
  it is up (for up to :data:`~launcher.supervision.membership.START_WINDOW`), so that both
  cost one reset. The survivors' collectives have failed meanwhile (Gloo notices a dead
  peer within milliseconds, a silent one after ``HVDRUN_GLOO_TIMEOUT_SECONDS``, 5 s in
  elastic jobs): they restore their last commit and join the new generation.
* Discovery runs every second; new hosts are started up to ``--max-np`` slots, hosts it no
  longer lists are removed gracefully (their workers take part in the commit that switches
  generations, then leave; their agents are stopped once the new generation is complete).
  Who holds the training state is read from the rendezvous right before each decision; a
  removal that would leave no holder waits for a sync under way to the hosts left.
* The job ends successfully once a worker has exited 0 and every other worker has exited.
  It fails, with one clear line, when fewer than ``--min-np`` slots are available for longer
  than ``--elastic-timeout``, when every worker is gone (their state with them), after
  more than ``--reset-limit`` resets, or when no worker left holds the training state.

A host's worker count is fixed once its workers start, since its agent starts them once: a
changed slot count, or slots that ``--max-np`` capped and a failure freed later, apply when
the host joins again (a host still starting takes them at once). Output lines are prefixed
with a worker number, which is the worker's rank in the generation it started with; later
workers get new numbers.

The decisions (which hosts, when a generation is due) live in
:mod:`launcher.supervision.membership`; this module carries them out with agents, the
rendezvous server and the output. The loop itself, signals, the stop deadline and heartbeat
checks are :mod:`launcher.supervision.core`'s, shared with fixed jobs.

Threads: the driver's main loop (the thread that calls :meth:`ElasticDriver.run`) owns the
membership and every host record in it (:class:`~launcher.supervision.membership.HostRecord`,
its ``agent`` included), and the driver's own fields; no other thread reads or writes them.
The driver's other threads only put events on its queue (a ``queue.Queue``), which the main
loop applies in order:

* discovery posts :class:`Discovered` or :class:`DiscoveryFailed` every interval;
* each host's start thread makes the agent and posts :class:`AgentCreated` with it before it
  starts it, then :class:`AgentReady` or :class:`AgentFailed`. It keeps its own reference to
  the agent, for ``start()`` and for ``abort()`` when the start fails; the main loop puts the
  agent on the host's record when it handles AgentCreated, so stopping the job (or removing
  the host) reaches a starting agent from then on: ``abort()`` cuts its start short at once.
  An agent whose host was removed, or whose job began stopping, before its AgentCreated was
  handled is aborted then. One whose AgentCreated is still queued when the loop ends is
  aborted by :meth:`ElasticDriver.run` on the way out, and a start thread that reports its
  agent after that sees ``_done`` (a ``threading.Event``) set and aborts it instead of
  starting it.

The agents' own reader threads post their events (output, exits, loss) to the same queue.
The rendezvous server's state is the server's own: the driver asks it through its
thread-safe methods.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass

from launcher.output import OutputSink
from launcher.spec.hosts import HostSpec, is_local_host
from launcher.spec.job import JobSpec
from launcher.spec.options import ElasticOptions
from launcher.supervision.core import (
    Events,
    JobResult,
    Signals,
    Supervised,
    Supervision,
    WorkerFailure,
    agent_loss_reason,
    agent_spec,
    collective_timeout,
    signalled_message,
    start_server,
)
from launcher.supervision.discovery import DiscoveryError, FixedHosts
from launcher.supervision.insight import InsightWatch
from launcher.supervision.membership import (
    UNLAUNCHED,
    HostRecord,
    Membership,
    Publish,
    Stop,
    Wait,
)
from launcher.supervision.report import describe_exit
from launcher.transport.connection import AgentConnection, AgentExit, HostEvent
from launcher.transport.hostinfo import installed_versions
from launcher.transport.protocol import (
    Continued,
    Done,
    Exit,
    Lines,
    Output,
    Signalled,
    Stopped,
)
from launcher.transport.startup import (
    dial_host,
    make_agent,
    member_peers,
    plan_rendezvous,
    stop_agents,
    version_problems,
)
from rendezvous import worker_env
from rendezvous.addresses import join_addr
from rendezvous.server import RendezvousServer
from rendezvous.slots import SlotInfo
from rendezvous.tls import certificate_for

log = logging.getLogger(__name__)

#: hvdrun's exit code when an elastic job cannot go on (too few hosts, too many resets).
ELASTIC_FAILURE_EXIT = 1


@dataclass(frozen=True)
class Discovered:
    """Discovery's latest answer."""

    hosts: list[HostSpec]


@dataclass(frozen=True)
class DiscoveryFailed:
    error: str


@dataclass(frozen=True)
class AgentCreated:
    """The start thread made the agent of incarnation ``order`` of ``host`` and starts it now;
    the main loop puts it on the host's record (or aborts it, if it is no longer wanted)."""

    host: str
    order: int
    agent: AgentConnection


@dataclass(frozen=True)
class AgentReady:
    """The agent of incarnation ``order`` of ``host`` said hello."""

    host: str
    order: int


@dataclass(frozen=True)
class AgentFailed:
    host: str
    order: int
    reason: str


#: What the driver's own threads (discovery, agent start-up) put on its event queue.
DriverEvent = Discovered | DiscoveryFailed | AgentCreated | AgentReady | AgentFailed


class ElasticDriver(Supervision[HostEvent | DriverEvent]):
    """Runs discovery, starts agents, publishes generations and supervises the workers."""

    poll_interval = 0.05
    worker_word = "worker"
    stop_consequence = (
        "the other workers' collectives wait for it; unless it is continued, they time out "
        "and {host} fails for not rejoining them"
    )

    def __init__(
        self,
        spec: JobSpec,
        options: ElasticOptions,
        sink: OutputSink,
        signals: Signals,
        server: RendezvousServer,
        secret: str,
        job_id: str,
        initial: list[HostSpec],
        cert_pem: str = "",
    ) -> None:
        super().__init__(sink, Events(sink), spec.term_grace, signals)
        self.cert_pem = cert_pem  # the rendezvous's TLS certificate, "" on loopback
        self.spec = spec
        self.options = options
        self.server = server
        self.secret = secret
        self.job_id = job_id
        # (the rejoin window: twice the workers' Gloo timeout, see rendezvous.rejoin)
        rejoin_timeout = 2 * collective_timeout(spec.env, options.failure_timeout)
        self.members = Membership(options, spec.num_proc, rejoin_timeout)
        self.members.discovered = initial
        self.finishing = False  # a worker exited 0: no more generations
        self._finished_in: int | None = None  # the generation it synced the state in
        self._silent_hosts: set[str] = set()  # silent agents whose workers still train
        self._worker_ids = itertools.count()
        self._done = threading.Event()
        self._versions = installed_versions() if spec.launch.check_versions else None
        self._discovery_error: str | None = None
        self.insight = InsightWatch(lambda p: self.server.values_under(p), sink, spec.report)

    # ---- the loop -------------------------------------------------------------------

    def run(self) -> JobResult:
        threading.Thread(target=self._discover, daemon=True).start()
        try:
            return super().run()
        finally:
            self._done.set()
            self.options.discovery.stop()  # (a run under way outlives no job)
            stop_agents([h.agent for h in self.members.all_hosts() if h.agent is not None])
            _abort_unclaimed_agents(self.events)

    def finished(self) -> bool:
        hosts = self.members.all_hosts()
        if self.stopping:
            return not any(h.agent_alive for h in hosts)
        if not self.finishing:
            return False
        if all(h.all_exited() or h.agent_finished for h in hosts if h.state == "running"):
            for host in self.members.removed_to_stop(None, self.clock()):
                host.stop_agent()
            if self.members.still_leaving():
                return False
            for host in hosts:  # failed hosts still shutting down
                host.stop_agent()
            return True
        return False

    def live_agents(self) -> list[Supervised]:
        return [h.agent for h in self.members.all_hosts() if h.agent_alive]

    def watched_agents(self) -> list[Supervised]:
        # Agents send heartbeats once their workers run; a ready agent may wait silently.
        return [h.agent for h in self.members.running() if h.agent_alive]

    def on_silent(self, agent: Supervised, why: str) -> bool:
        """A silent agent fails its host when the others' collectives failed too (its workers
        are gone or cut off: the survivors wait for a new generation) or after the heartbeat
        timeout. Until then its workers train with the others and the agent is only stopped
        or starved: the server's view beats the heartbeat; nobody is killed for a hiccup."""
        host = self._record_of(agent)
        silent = self.clock() - agent.last_heard
        if (
            host.state == "running"
            and silent < self.spec.launch.lost_timeout
            and not self._others_wait(host)
        ):
            if host.name not in self._silent_hosts:
                self._silent_hosts.add(host.name)
                self.sink.message(
                    f"heard nothing from the agent of {host.name} for {silent:.0f} s, but its "
                    "workers still train with the others; waiting"
                )
            return False
        if host.name in self._silent_hosts:  # waited for: how long it was silent in all
            why = f"heard nothing from its agent for {silent:.0f} s"
        self._silent_hosts.discard(host.name)
        self._fail_host(host, why)
        host.agent_finished = True
        return True

    def _others_wait(self, host: HostRecord) -> bool:
        """Whether workers of other hosts wait for a new generation (their collectives
        failed)."""
        waiting = self.server.waiting_slots()
        return any(
            other is not host and other.slot_keys() & waiting for other in self.members.running()
        )

    def stop_agent(self, agent: Supervised) -> None:
        host = self._record_of(agent)
        if host.state == "starting":  # cut its start-up short: it has no workers yet
            agent.abort()
            host.agent_finished = True
        else:
            host.stop_agent()

    def abandon(self, agent: Supervised) -> None:
        self._record_of(agent).agent_finished = True

    def after_events(self, now: float) -> None:
        try:
            self._reconcile(now)
        except TimeoutError as error:  # (the server's loop starved: the next step decides)
            log.warning("%s; deciding at the next step", error)

    def _record_of(self, agent: Supervised) -> HostRecord:
        return next(host for host in self.members.all_hosts() if host.agent is agent)

    def _discover(self) -> None:
        discovery = self.options.discovery
        while not self._done.wait(self.options.discovery_interval):
            try:
                found = discovery.find()
            except DiscoveryError as exc:
                self.events.put(DiscoveryFailed(str(exc)))
            else:
                self.events.put(Discovered(found))

    # ---- events ---------------------------------------------------------------------

    def on_event(self, item: HostEvent | DriverEvent) -> None:
        match item:
            case Discovered(hosts):
                if self._discovery_error is not None:
                    self.sink.message("host discovery works again")
                    self._discovery_error = None
                self.members.discovered = hosts
            case DiscoveryFailed(error):
                if error != self._discovery_error:
                    self._discovery_error = error
                    self.sink.message(
                        f"{self.options.discovery.describe()} failed: {error} "
                        "(keeping the last host list; retrying every second)"
                    )
            case AgentCreated(name, order, agent):
                self._on_agent_created(self.members.find(name, order), agent)
            case AgentReady(name, order):
                host = self.members.find(name, order)
                if host is not None:
                    self._on_agent_ready(host)
            case AgentFailed(name, order, reason):
                host = self.members.find(name, order)
                if host is not None:
                    host.agent_finished = True
                    # (an agent hvdrun stopped itself, the job ending, has not failed)
                    if host.state == "starting" and not (self.stopping or self.finishing):
                        self._fail_host(host, f"could not start its agent: {reason}")
            case HostEvent(_, Output(rank, stream, data, end, shown)):
                self.sink.line(rank, stream, data, end, shown)
            case HostEvent(_, Lines(rank, stream, data)):
                self.sink.lines(rank, stream, data)
            case HostEvent(name, event, source):
                host = self.members.find_agent(name, source)
                if host is None:
                    return
                match event:
                    case Exit(worker, code, message):
                        self._on_exit(host, worker, code, message)
                    case Stopped() | Continued():
                        self.record_stop(host.name, event)
                    case Signalled(signum) if not self.stopping:  # (fails as they exit)
                        self.sink.message(signalled_message(host.name, signum, elastic=True))
                    case Done() | AgentExit():
                        self._on_agent_gone(host, event)

    def _on_agent_created(self, host: HostRecord | None, agent: AgentConnection) -> None:
        if host is None:  # removed, and its record already dropped
            agent.abort()
            return
        host.agent = agent
        if self.stopping or host.state != "starting":
            # Stopped or removed while the agent was being made: cut its start-up short, as
            # stop_agent() does for a starting agent it knows of.
            agent.abort()
            host.agent_finished = True

    def _on_agent_ready(self, host: HostRecord) -> None:
        agent = host.agent
        assert agent is not None
        if self._versions is not None:
            problems = version_problems(self._versions, [agent])
            if problems:
                self._fail_host(host, problems[host.name])
                return
        if host.state != "starting":  # removed by discovery while it started
            agent.close()
            return
        if self.stopping or self.finishing:
            host.state = "done"
            agent.close()
            return
        self.members.ready(host)

    def _on_exit(self, host: HostRecord, worker: int, code: int, error: str | None) -> None:
        host.exits[worker] = code
        self.record_exit(worker, code)
        if error:
            self.sink.message(f"worker {worker} on {host.name}: {error}")
        if host.state in ("removed", "failed", "done") or self.stopping:
            return
        if code == 0:
            if not self.finishing:
                self.finishing = True
                # The generation the finishing workers trained in: workers that do not
                # hold the state of that generation are still bootstrapping a later one.
                self._finished_in = self.server.state_holders().get(worker)
        elif self.finishing:
            self.fail(WorkerFailure(worker, host.name, code, error))
        else:
            what = describe_exit(code)
            what = f"was {what}" if what.startswith("killed") else f"exited with {what}"
            self._fail_host(host, f"worker {worker} {what}")

    def _on_agent_gone(self, host: HostRecord, event: Done | AgentExit) -> None:
        host.agent_finished = True
        if self.stopping:
            return
        if host.state in UNLAUNCHED:
            self._fail_host(host, "its agent was lost before its workers started")
            return
        if host.state != "running" or host.all_exited():
            if host.state == "running":
                host.state = "done"
            return
        why = agent_loss_reason(event)
        missing = [w for w in host.workers if w not in host.exits]
        for worker in missing:
            self.result.lost[worker] = why
        if self.finishing:
            self.fail(WorkerFailure(missing[0], host.name, 255, why))
        else:
            self._fail_host(host, why)

    # ---- carrying out the membership's decisions -------------------------------------

    def _fail_host(self, host: HostRecord, why: str) -> None:
        if host.state in ("failed", "removed", "done"):
            return
        cooldown = self.members.fail(host, self.clock())
        until = "for the rest of the job" if cooldown is None else f"for {cooldown:g} s"
        self.sink.message(f"host {host.name} failed ({why}); blacklisted {until}")
        host.stop_agent()

    def _give_up(self, message: str) -> None:
        """The job cannot go on (too few hosts, too many resets, the state lost): exit 1."""
        if self.stopping:
            return
        self.result.exit_code, self.result.reason = ELASTIC_FAILURE_EXIT, message
        for line in message.splitlines():
            self.sink.message(line)
        self.stop_all()

    def _reconcile(self, now: float) -> None:
        if self.finishing and not self.stopping:
            self._stop_stranded()
        if self.stopping or self.finishing:
            return
        members = self.members
        members.retire_finished()
        unlisted_since = members.unlisted_since
        dropped = members.drop_undiscovered(now)
        for host in dropped:
            self.sink.message(f"host {host.name} is no longer discovered; removing it")
            if not host.workers and host.agent is not None:
                host.agent.close()
        for notice in members.notices(unlisted_since, dropped):
            self.sink.message(notice)
        for host in members.hosts_to_start(now):
            self._start_host(host)
        late = members.rejoin_failures(
            now, self.server.waiting_slots(), self.server.present_workers
        )
        members.rejoin.call_roll_if_due(self.server.call_roll)
        for host, answered in late:
            stop = self.stopped_among(host.workers)
            self._fail_host(host, members.rejoin.failure(answered, stop.rank if stop else None))
            if host.agent is not None:
                host.agent.kill()  # a stopped process ignores SIGTERM until it runs
        if members.need_publish:
            # Read now, after this step's removals and failures: who holds the state at
            # the moment of the decision, not at the last publish.
            members.note_holders(self.server.state_holders())
        decision = members.decide(now)
        if isinstance(decision, Stop):
            self._give_up(decision.message)
        elif isinstance(decision, Wait):
            if decision.message:
                self.sink.message(decision.message)
        elif isinstance(decision, Publish):
            self._publish(decision)
        for host in members.removed_to_stop(self.server.registered_count(), now):
            host.stop_agent()

    def _stop_stranded(self) -> None:
        """After a worker finished (exit 0) the job's outcome is decided and no generation
        comes any more: workers that wait for one (their collectives failed when it left),
        and workers still bootstrapping a generation that the finishing workers never
        joined (they do not hold the state the others finished with), are stopped at once;
        the others finish on their own."""
        waiting = self.server.waiting_slots()
        finished_in = self._finished_in
        holders = self.server.state_holders() if finished_in is not None else {}
        for host in self.members.running():
            if host.all_exited():
                continue
            if host.slot_keys() & waiting:
                why = "they wait for a new generation"
            elif finished_in is not None and not any(
                holders.get(worker, -1) >= finished_in for worker in host.live_workers()
            ):
                why = "they are still joining a generation that will not train"
            else:
                continue
            self.sink.message(
                f"stopping the workers on {host.name}: {why}, but another worker has "
                "finished the job"
            )
            host.state = "done"
            host.stop_agent()

    def _start_host(self, host: HostRecord) -> None:
        # In a thread of its own, which never touches ``host``: the main loop owns it.
        args = (host.name, host.order, self.spec, self.events, self._done)
        threading.Thread(target=_start_agent, args=args, daemon=True).start()

    def _publish(self, decision: Publish) -> None:
        generation = self.server.publish(decision.slots)
        self.members.published(generation)
        agents = [host.agent for host in decision.members if host.agent is not None]
        for host in decision.members:
            if host.state == "ready":
                self._launch(host, decision.slots, generation, agents)
        names = ", ".join(h.name for h in decision.members)
        self.sink.message(
            f"generation {generation}: {len(decision.slots)} worker(s) on "
            f"{len(decision.members)} host(s): {names}"
        )

    def _launch(
        self,
        host: HostRecord,
        slots: list[SlotInfo],
        generation: int,
        members: list[AgentConnection],
    ) -> None:
        agent = host.agent
        assert agent is not None
        spec = agent_spec(
            self.spec,
            host.name,
            slots,  # agent_spec keeps this host's own slots
            self._rendezvous_addr(agent),
            self.job_id,
            self.secret,
            agent.heartbeat_timeout,
            self.cert_pem,
        )
        timeouts = self.options.elastic_timeout, self.options.failure_timeout
        spec.env.update(worker_env.elastic_env(self.spec.env, *timeouts))
        spec.peers = member_peers(agent, members, self.spec.launch.rendezvous_addr)
        for worker in spec.workers:
            number = next(self._worker_ids)
            worker.rank = number
            worker.env[worker_env.GENERATION] = str(generation)
            worker.env[worker_env.WORKER] = str(number)
            host.workers[number] = int(worker.env[worker_env.LOCAL_RANK])
            self.result.hosts[number] = host.name
        self.sink.open_files(host.workers)
        host.state = "running"
        agent.launch(spec, self.events)

    def _rendezvous_addr(self, agent: AgentConnection) -> str:
        agents = [h.agent for h in self.members.all_hosts() if h.agent is not None]
        host = dial_host(agent, agents, self.spec.launch.rendezvous_addr)
        return join_addr(host, self.server.port)


def _abort_unclaimed_agents(events: queue.Queue[HostEvent | DriverEvent]) -> None:
    """Aborts agents whose AgentCreated the driver's loop never handled (it ended first):
    nobody else would stop their start-up. A start thread that posts one after this checks
    the driver's ``_done`` itself."""
    while True:
        try:
            event = events.get_nowait()
        except queue.Empty:
            return
        if isinstance(event, AgentCreated):
            event.agent.abort()


def _start_agent(
    name: str,
    order: int,
    spec: JobSpec,
    events: Events[HostEvent | DriverEvent],
    done: threading.Event,
) -> None:
    """Starts host ``name``'s agent, saying how it went on ``events`` (AgentCreated, then
    AgentReady or AgentFailed); an agent nobody will claim any more (``done``) is aborted."""
    launch = spec.launch
    deadline = time.monotonic() + launch.start_timeout
    agent: AgentConnection | None = None
    try:
        agent = make_agent(name, spec.cwd, spec.env, launch)
        events.put(AgentCreated(name, order, agent))
        if done.is_set():  # the loop has ended: nobody will claim the agent
            agent.abort()
            return
        agent.start(deadline)
    except Exception as exc:
        events.put(AgentFailed(name, order, str(exc) or repr(exc)))
        if agent is not None:
            agent.abort()
    else:
        events.put(AgentReady(name, order))


def run_elastic_job(spec: JobSpec, sink: OutputSink) -> JobResult:
    """Runs an elastic job (``spec.elastic`` set) until it ends; see the module docstring."""
    options = spec.elastic
    assert options is not None
    initial = list(spec.hosts)  # the discovery's first answer (the CLI's run of it)
    secret = worker_env.new_secret()
    job_id = worker_env.new_job_id()
    # Hosts may join from anywhere later: listen on every interface unless told otherwise,
    # or unless the job is bound to this machine's own fixed hosts.
    plan = plan_rendezvous([], spec.launch.rendezvous_addr)
    bind = plan.bind_host if spec.launch.rendezvous_addr else "0.0.0.0"
    fixed = options.discovery
    if (
        not spec.launch.rendezvous_addr
        and isinstance(fixed, FixedHosts)
        and all(is_local_host(host.hostname) for host in fixed.hosts)
    ):
        bind = "127.0.0.1"
    tls = certificate_for(bind, job_id)  # hosts may join over the network: TLS
    server = RendezvousServer(
        [], secret, job_id, bind_host=bind, port=plan.port, elastic=True, tls=tls
    )
    start_server(server, spec.launch.rendezvous_addr)
    with Signals().installed() as signals:
        try:
            server.put_values(spec.preset)
            cert_pem = tls.cert_pem.decode("ascii") if tls is not None else ""
            driver = ElasticDriver(
                spec, options, sink, signals, server, secret, job_id, initial, cert_pem
            )
            result = driver.run()
            result.job_id = job_id
            if spec.collect is not None:
                result.collected = server.values_under(spec.collect)
            return result
        finally:
            server.stop()
            sink.close(interrupted=signals.first)  # (a Ctrl-C ends a wait for a slow reader)
