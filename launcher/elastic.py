"""The elastic driver: ``hvdrun -np N --min-np A --max-np B [--host-discovery-script S]``.

It runs the job on whatever hosts discovery offers and keeps it running while hosts fail,
join and leave, without restarting the workers that survive:

* Hosts are kept in the order they joined; every membership generation assigns ranks in
  that order (:func:`rendezvous.slots.assign_slots`), so older hosts keep the low ranks and
  rank 0 moves only when its host is gone.
* Each generation is published to the rendezvous server. Workers of the newest one start
  (new hosts) or re-register (survivors) and bootstrap fresh process groups; running
  workers hear of it on their Watch stream and switch at their next ``state.commit()``.
* A worker that fails, or a host whose agent is lost (connection dropped, or silent for the
  failure timeout: a cut link), fails its host: it is blacklisted, its other workers are
  stopped, and the next generation is published from the rest at once. The survivors'
  collectives have failed meanwhile (Gloo notices a dead peer within milliseconds, a silent
  one after ``HVDRUN_GLOO_TIMEOUT_SECONDS``, 5 s in elastic jobs): they restore their last
  commit and join the new generation.
* Discovery runs every second; new hosts are started up to ``--max-np`` slots, hosts it no
  longer lists are removed gracefully (their workers take part in the commit that switches
  generations, then leave; their agents are stopped once the new generation is complete).
* The job ends successfully once a worker has exited 0 and every other worker has exited.
  It fails, with one clear line, when fewer than ``--min-np`` slots are available for longer
  than ``--elastic-timeout``, when every worker is gone (their state with them), or after
  more than ``--reset-limit`` resets.

A host's slot count is fixed while its agent runs; a changed count applies when the host
comes back after leaving the job. Output lines are prefixed with a worker number, which is
the worker's rank in the generation it started with; later workers get new numbers.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from launcher.connection import AgentConnection
from launcher.discovery import Blacklist, DiscoveryError, HostDiscovery
from launcher.hostinfo import installed_versions, source_address
from launcher.hosts import HostSpec
from launcher.job import (
    AGENT_REPORT_SLACK,
    JobResult,
    JobSpec,
    WorkerFailure,
    _Signals,
    agent_spec,
)
from launcher.options import ElasticOptions
from launcher.output import OutputSink
from launcher.protocol import bytes_of
from launcher.report import describe_exit, report_failure
from launcher.startup import (
    _bracket,
    _has_port,
    make_agent,
    plan_rendezvous,
    stop_agents,
    version_problems,
)
from rendezvous.server import RendezvousServer
from rendezvous.slots import SlotInfo, assign_slots

log = logging.getLogger(__name__)

#: hvdrun's exit code when an elastic job cannot go on (too few hosts, too many resets).
ELASTIC_FAILURE_EXIT = 1
#: Workers wait this much longer than the launcher for the next generation, so that the
#: launcher's clear message, not a worker's timeout, ends a job that runs out of hosts.
WORKER_TIMEOUT_SLACK = 30.0

ACTIVE = ("starting", "ready", "running")


@dataclass
class _Host:
    name: str
    slots: int
    order: int  # when it joined: older hosts get the lower ranks
    state: str = "starting"  # starting, ready, running, removed, failed, done
    agent: AgentConnection | None = None
    workers: dict[int, int] = field(default_factory=dict)  # worker number -> local rank
    exits: dict[int, int] = field(default_factory=dict)
    agent_finished: bool = False
    terminated: bool = False

    def all_exited(self) -> bool:
        return bool(self.workers) and len(self.exits) == len(self.workers)


class ElasticDriver:
    """Discovers hosts, starts their agents, publishes generations and supervises workers."""

    def __init__(
        self,
        spec: JobSpec,
        options: ElasticOptions,
        sink: OutputSink,
        signals: _Signals,
        server: RendezvousServer,
        secret: str,
        job_id: str,
    ) -> None:
        self.spec = spec
        self.options = options
        self.sink = sink
        self.signals = signals
        self.server = server
        self.secret = secret
        self.job_id = job_id
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.hosts: dict[str, _Host] = {}
        self.retired: list[_Host] = []  # earlier incarnations whose agents may still run
        self.blacklist = Blacklist(options.cooldown)
        self.discovered: list[HostSpec] = []
        self.result = JobResult(exit_code=0)
        self.generation = 0
        self.resets = 0
        self.need_publish = False
        self.finishing = False
        self.stopping = False
        self._stop_deadline: float | None = None
        self._short_since: float | None = None
        self._orders = itertools.count()
        self._worker_ids = itertools.count()
        self._done = threading.Event()
        self._versions = installed_versions() if spec.launch.check_versions else None
        self._rejoin_since: float | None = None
        # Survivors of a failed collective wait in Register; a member that has not joined
        # them this long after is hung or cut off (twice the workers' Gloo timeout).
        self.rejoin_timeout = 2 * _gloo_timeout(spec.env, options.failure_timeout)
        self._discovery_error: str | None = None

    # ---- the loop -------------------------------------------------------------------

    def run(self, initial: list[HostSpec]) -> JobResult:
        self.discovered = initial
        threading.Thread(target=self._discover, daemon=True).start()
        handled_signals = 0
        try:
            while not self._finished():
                while handled_signals < len(self.signals.received):
                    self._on_signal(handled_signals == 0)
                    handled_signals += 1
                now = time.monotonic()
                if self._stop_deadline is not None and now > self._stop_deadline:
                    log.warning("agents did not report in time; killing them")
                    for host in self._all_hosts():
                        if host.agent is not None and not host.agent_finished:
                            host.agent.kill()
                            host.agent_finished = True
                self._check_heartbeats(now)
                try:
                    event: dict[str, Any] | None = self.events.get(timeout=0.05)
                except queue.Empty:
                    event = None
                while event is not None:
                    self._on_event(event)
                    try:
                        event = self.events.get_nowait()
                    except queue.Empty:
                        event = None
                self._reconcile(time.monotonic())
        finally:
            self._done.set()
            stop_agents([h.agent for h in self._all_hosts() if h.agent is not None])
        return self.result

    def _all_hosts(self) -> list[_Host]:
        return [*self.retired, *self.hosts.values()]

    def _finished(self) -> bool:
        hosts = self._all_hosts()
        if self.stopping:
            return all(h.agent is None or h.agent_finished for h in hosts)
        if not self.finishing:
            return False
        running = [h for h in hosts if h.state == "running"]
        if all(h.all_exited() or h.agent_finished for h in running):
            for host in hosts:  # removed or failed hosts still shutting down
                if host.agent is not None and not host.agent_finished:
                    host.agent.terminate()
            return True
        return False

    def _discover(self) -> None:
        interval = self.options.discovery_interval
        discovery: HostDiscovery = self.options.discovery
        while not self._done.wait(interval):
            try:
                found = discovery.find()
            except DiscoveryError as exc:
                self.events.put({"ev": "discovery_failed", "error": str(exc)})
            else:
                self.events.put({"ev": "discovered", "hosts": found})

    # ---- events ---------------------------------------------------------------------

    def _host_of(self, event: dict[str, Any]) -> _Host | None:
        name = event.get("host")
        order = event.get("order")
        host = self.hosts.get(name) if isinstance(name, str) else None
        if host is not None and (order is None or order == host.order):
            return host
        for old in self.retired:
            if old.name == name and (order is None or order == old.order):
                return old
        return None

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event["ev"]
        if kind == "discovered":
            if self._discovery_error is not None:
                self.sink.message("host discovery works again")
                self._discovery_error = None
            self.discovered = event["hosts"]
            return
        if kind == "discovery_failed":
            if event["error"] != self._discovery_error:
                self._discovery_error = event["error"]
                self.sink.message(
                    f"{self.options.discovery.describe()} failed: {event['error']} "
                    "(keeping the last host list; retrying every second)"
                )
            return
        if kind == "out":
            self.sink.line(event["rank"], event["stream"], bytes_of(event["data"]))
            return
        host = self._host_of(event)
        if host is None:
            return
        if kind == "agent_ready":
            self._on_agent_ready(host)
        elif kind == "agent_failed":
            host.agent_finished = True
            if host.state == "starting":
                self._fail_host(host, f"could not start its agent: {event['reason']}")
        elif kind == "exit":
            self._on_exit(host, int(event["rank"]), int(event["code"]), event.get("error"))
        elif kind in ("done", "agent_exit"):
            self._on_agent_gone(host, kind, event)

    def _on_agent_ready(self, host: _Host) -> None:
        agent = host.agent
        assert agent is not None
        if self._versions is not None:
            problems = version_problems(self._versions, [agent])
            if problems:
                self._fail_host(host, problems[host.name])
                return
        if host.state != "starting":
            return
        if self.stopping or self.finishing:
            host.state = "done"
            agent.close()
            return
        host.state = "ready"
        self.need_publish = True

    def _on_exit(self, host: _Host, worker: int, code: int, error: str | None) -> None:
        host.exits[worker] = code
        self.result.exits[worker] = code
        if error:
            self.sink.message(f"worker {worker} on {host.name}: {error}")
        if host.state in ("removed", "failed") or self.stopping:
            if self.stopping:
                self.result.stopped.add(worker)
            return
        if code == 0:
            self.finishing = True
            return
        if self.finishing:
            self._fail_job(WorkerFailure(worker, host.name, code, error))
            return
        self._fail_host(host, f"worker {worker} exited with {describe_exit(code)}")

    def _on_agent_gone(self, host: _Host, kind: str, event: dict[str, Any]) -> None:
        host.agent_finished = True
        if host.state in ("starting", "ready") and not self.stopping:
            self._fail_host(host, "its agent was lost before its workers started")
            return
        if host.state != "running" or self.stopping or host.all_exited():
            if host.state == "running" and host.all_exited():
                host.state = "done"
            return
        code = event.get("code")
        why = "lost the connection to its agent" if code is None else f"its agent exited ({code})"
        if kind == "done":
            why = "its agent finished early"
        if event.get("reason"):
            why += f": {event['reason']}"
        missing = [w for w in host.workers if w not in host.exits]
        for worker in missing:
            self.result.lost[worker] = why
        if self.finishing:
            self._fail_job(WorkerFailure(missing[0], host.name, 255, why))
        else:
            self._fail_host(host, why)

    def _check_heartbeats(self, now: float) -> None:
        for host in list(self.hosts.values()):
            agent = host.agent
            if agent is None or host.agent_finished or host.state != "running":
                continue
            timeout = agent.heartbeat_timeout
            if timeout > 0 and now - agent.last_heard > timeout:
                self._fail_host(host, f"heard nothing from its agent for {timeout:g} s")
                agent.abort()  # its agent stops its workers on its own heartbeat timeout
                host.agent_finished = True

    # ---- membership -----------------------------------------------------------------

    def _fail_host(self, host: _Host, why: str) -> None:
        if host.state in ("failed", "removed", "done"):
            return
        was_member = host.state in ("ready", "running")
        host.state = "failed"
        cooldown = self.blacklist.add(host.name)
        until = "for the rest of the job" if cooldown is None else f"for {cooldown:g} s"
        self.sink.message(f"host {host.name} failed ({why}); blacklisted {until}")
        if host.agent is not None and not host.agent_finished:
            host.agent.terminate()
        if was_member:
            self.need_publish = True

    def _fail_job(self, failure: WorkerFailure | None, message: str | None = None) -> None:
        if self.stopping:
            return
        if failure is not None:
            self.result.failure = failure
            self.result.exit_code = failure.code
        else:
            self.result.exit_code = ELASTIC_FAILURE_EXIT
        if message:
            self.sink.message(message)
        self._stop_all()

    def _stop_all(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self._stop_deadline = time.monotonic() + self.spec.term_grace + AGENT_REPORT_SLACK
        for host in self._all_hosts():
            if host.agent is not None and not host.agent_finished:
                if host.state == "starting":
                    host.agent.abort()
                    host.agent_finished = True
                else:
                    host.agent.terminate()

    def _on_signal(self, first: bool) -> None:
        signum = self.signals.received[0]
        if first:
            import signal

            self.sink.message(f"received {signal.Signals(signum).name}; stopping all workers")
            if self.result.failure is None:
                self.result.interrupted_by = signum
                self.result.exit_code = 128 + signum
            self._stop_all()
        else:
            self.sink.message("second signal: killing all workers now")
            for host in self._all_hosts():
                if host.agent is not None and not host.agent_finished:
                    host.agent.kill()

    def _reconcile(self, now: float) -> None:
        if self.stopping or self.finishing:
            return
        self._retire_finished()
        listed = {spec.hostname: spec for spec in self.discovered}
        for host in list(self.hosts.values()):
            if host.state in ACTIVE and host.name not in listed:
                self.sink.message(f"host {host.name} is no longer discovered; removing it")
                if host.state == "running":
                    host.state = "removed"
                    self.need_publish = True
                else:
                    host.state = "removed"
                    if host.agent is not None:
                        host.agent.close()
        self._start_new_hosts(listed, now)
        self._check_rejoin(now)
        self._publish_if_needed(now)
        self._stop_removed_hosts()

    def _check_rejoin(self, now: float) -> None:
        """Workers whose collectives failed wait for the next generation. If every member
        waits, publish one (a transient error); a member that does not join them within
        the rejoin timeout is hung or cut off: its host fails."""
        if self.generation == 0 or self.need_publish:
            self._rejoin_since = None
            return
        running = [h for h in self.hosts.values() if h.state == "running"]
        waiting = self.server.waiting_slots()
        members = {(h.name, local) for h in running for local in range(h.slots)}
        if not waiting & members:
            self._rejoin_since = None
            return
        if members <= waiting:
            self.need_publish = True
            self._rejoin_since = None
            return
        if self._rejoin_since is None:
            self._rejoin_since = now
            return
        if now - self._rejoin_since < self.rejoin_timeout:
            return
        self._rejoin_since = None
        for host in running:
            if any((host.name, local) not in waiting for local in range(host.slots)):
                self._fail_host(
                    host,
                    f"its workers did not rejoin within {self.rejoin_timeout:g} s after the "
                    "others' collectives failed: hung or cut off",
                )
                if host.agent is not None:
                    host.agent.kill()  # a stopped process ignores SIGTERM until it runs

    def _retire_finished(self) -> None:
        for name, host in list(self.hosts.items()):
            if host.state not in ACTIVE:
                del self.hosts[name]
                self.retired.append(host)
        self.retired = [h for h in self.retired if not (h.agent is None or h.agent_finished)]

    def _used_slots(self) -> int:
        return sum(h.slots for h in self.hosts.values() if h.state in ACTIVE)

    def _start_new_hosts(self, listed: dict[str, HostSpec], now: float) -> None:
        limit = self.options.max_np
        capacity = (limit if limit is not None else 1 << 30) - self._used_slots()
        for spec in listed.values():
            if capacity <= 0:
                return
            if spec.hostname in self.hosts or self.blacklist.blocked(spec.hostname, now):
                continue
            if any(h.name == spec.hostname for h in self.retired):
                continue  # its previous agent is still shutting down
            slots = min(spec.slots, capacity)
            capacity -= slots
            self._start_host(spec.hostname, slots)

    def _start_host(self, name: str, slots: int) -> None:
        host = _Host(name=name, slots=slots, order=next(self._orders))
        self.hosts[name] = host
        launch = self.spec.launch
        deadline = time.monotonic() + launch.start_timeout

        def start() -> None:
            try:
                agent = make_agent(name, self.spec.cwd, self.spec.env, launch)
                host.agent = agent
                agent.start(deadline)
            except Exception as exc:
                reason = str(exc) or repr(exc)
                self.events.put(
                    {"ev": "agent_failed", "host": name, "order": host.order, "reason": reason}
                )
                if host.agent is not None:
                    host.agent.abort()
            else:
                self.events.put({"ev": "agent_ready", "host": name, "order": host.order})

        threading.Thread(target=start, daemon=True).start()

    def _publish_if_needed(self, now: float) -> None:
        members = sorted(
            (h for h in self.hosts.values() if h.state in ("ready", "running")),
            key=lambda h: h.order,
        )
        total = sum(h.slots for h in members)
        starting = any(h.state == "starting" for h in self.hosts.values())
        if self.generation == 0:
            # The first generation: every host that discovery offered, or -np slots.
            if (starting and total < self.spec.num_proc) or total < self.options.min_np:
                self._wait_for_slots(now, total, starting)
                return
        elif not self.need_publish:
            return
        elif not any(h.state == "running" for h in members):
            self._fail_job(
                None,
                "every worker of the elastic job has failed or left, and its training state "
                "with them; stopping the job",
            )
            return
        elif total < self.options.min_np:
            self._wait_for_slots(now, total, starting)
            return
        self._short_since = None
        if self.generation > 0:
            self.resets += 1
            limit = self.options.reset_limit
            if limit is not None and self.resets > limit:
                self._fail_job(
                    None,
                    f"the elastic job would need reset {self.resets}, more than --reset-limit "
                    f"{limit}; stopping the job",
                )
                return
        slots = assign_slots([(h.name, h.slots) for h in members], total)
        self.generation = self.server.publish(slots)
        self.need_publish = False
        for host in members:
            if host.state == "ready":
                self._launch(host, slots)
        names = ", ".join(h.name for h in members)
        self.sink.message(
            f"generation {self.generation}: {total} worker(s) on {len(members)} host(s): {names}"
        )

    def _wait_for_slots(self, now: float, total: int, starting: bool) -> None:
        if self._short_since is None:
            self._short_since = now
            if not starting:
                self.sink.message(
                    f"{total} slot(s) available, --min-np is {self.options.min_np}: waiting up "
                    f"to {self.options.elastic_timeout:g} s for more hosts"
                )
        elif now - self._short_since > self.options.elastic_timeout:
            self._fail_job(
                None,
                f"only {total} slot(s) were available for longer than the elastic timeout "
                f"({self.options.elastic_timeout:g} s), fewer than --min-np "
                f"{self.options.min_np}; stopping the job",
            )

    def _stop_removed_hosts(self) -> None:
        """Removed hosts' workers leave on their own at the switching commit; stop whatever
        is left of them once the new generation is complete."""
        if self.server.registered_count() < sum(
            h.slots for h in self.hosts.values() if h.state == "running"
        ):
            return
        for host in self.retired:
            if host.state == "removed" and not host.terminated and host.agent is not None:
                host.terminated = True
                host.agent.terminate()

    def _launch(self, host: _Host, slots: list[SlotInfo]) -> None:
        agent = host.agent
        assert agent is not None
        own = [slot for slot in slots if slot.hostname == host.name]
        spec = agent_spec(
            self.spec,
            host.name,
            own,
            self._rendezvous_addr(agent),
            self.job_id,
            self.secret,
            agent.heartbeat_timeout,
        )
        timeout = self.options.elastic_timeout + WORKER_TIMEOUT_SLACK
        spec.env.update(
            {"HVDRUN_ELASTIC": "1", "HVDRUN_ELASTIC_TIMEOUT": f"{timeout:g}"},
        )
        if "HVDRUN_GLOO_TIMEOUT_SECONDS" not in spec.env and (
            "HOROVOD_GLOO_TIMEOUT_SECONDS" not in spec.env
        ):
            spec.env["HVDRUN_GLOO_TIMEOUT_SECONDS"] = f"{self.options.failure_timeout:g}"
        first = None
        for worker in spec.workers:
            number = next(self._worker_ids)
            first = number if first is None else first
            worker.rank = number
            worker.env["HVDRUN_GENERATION"] = str(self.generation)
            host.workers[number] = int(worker.env["HVDRUN_LOCAL_RANK"])
            self.result.hosts[number] = host.name
        if first is not None:
            self.sink.open_files(range(first, first + len(spec.workers)))
        host.state = "running"
        agent.launch(spec, self.events)

    def _rendezvous_addr(self, agent: AgentConnection) -> str:
        port = self.server.port
        explicit = self.spec.launch.rendezvous_addr
        if explicit:
            return f"{_bracket(_explicit_host(explicit))}:{port}"
        if agent.kind == "local":
            remote = next(
                (
                    h.agent
                    for h in self._all_hosts()
                    if h.agent is not None and h.agent.kind != "local"
                ),
                None,
            )
            address = _remote_address(remote) if remote is not None else None
            return f"{_bracket(address or '127.0.0.1')}:{port}"
        return f"{_bracket(_remote_address(agent) or '127.0.0.1')}:{port}"


def _gloo_timeout(env: dict[str, str], default: float) -> float:
    for name in ("HVDRUN_GLOO_TIMEOUT_SECONDS", "HOROVOD_GLOO_TIMEOUT_SECONDS"):
        try:
            return float(env[name])
        except (KeyError, ValueError):
            continue
    return default


def _explicit_host(addr: str) -> str:
    host = addr.rpartition(":")[0] if _has_port(addr) else addr
    return host.strip("[]")


def _remote_address(agent: AgentConnection) -> str | None:
    """The address of this machine that the agent's host reaches (its SSH connection's)."""
    address = getattr(agent, "local_address", None)
    target = getattr(agent, "target", None)
    if address is None and target is not None:
        address = source_address(target.hostname)
    return address


def run_elastic_job(spec: JobSpec, sink: OutputSink) -> JobResult:
    """Runs an elastic job (``spec.elastic`` set) until it ends; see the module docstring."""
    import secrets
    import uuid

    options = spec.elastic
    assert options is not None
    initial = list(spec.hosts)  # the discovery's first answer (the CLI's run of it)
    secret = secrets.token_urlsafe(32)
    job_id = uuid.uuid4().hex[:16]
    # Hosts may join from anywhere later: listen on every interface unless told otherwise.
    plan = plan_rendezvous([], spec.launch.rendezvous_addr)
    bind = plan.bind_host if spec.launch.rendezvous_addr else "0.0.0.0"
    server = RendezvousServer([], secret, job_id, bind_host=bind, port=plan.port, elastic=True)
    server.start()
    try:
        with _Signals().installed() as signals:
            driver = ElasticDriver(spec, options, sink, signals, server, secret, job_id)
            result = driver.run(initial)
    finally:
        server.stop()
        sink.close()
    report_failure(result, sink)
    return result
