"""The supervision loop that fixed and elastic jobs share, and the records of how a job ended.

Both supervisors watch agents the same way; :class:`Supervision` does it once and leaves
them only what differs (the fixed one's pending hosts and status line; the elastic one's
membership, discovery and generations):

* Signals: the first SIGINT/SIGTERM stops every worker and, unless a worker failed first,
  makes the job exit with 128+signal; a second one kills without grace.
* The first failure decides the exit code and stops the job: every agent SIGTERMs its
  workers and SIGKILLs them after ``term_grace``. Agents that have not reported
  ``AGENT_REPORT_SLACK`` seconds after that are killed.
* Heartbeats: an agent silent for longer than its ``heartbeat_timeout`` (a cut network
  closes nothing) is given up on: its host counts as lost and its connection is dropped;
  the agent stops its workers on its own heartbeat timeout.
* A worker that its agent reports stopped (SIGSTOP, SIGTSTP, a debugger holding it) while
  another fails, or that was continued only moments before, is named as the cause
  (:meth:`Supervision.stop_behind`): its peers' collectives timed out waiting for it.
* Events are drained from one queue between those checks, in batches, so that a worker
  flooding its output cannot hold off a Ctrl-C.

Everything is driven by :meth:`Supervision.step` and an injectable clock, so tests can run
it with fake agents. :class:`JobResult` and :class:`WorkerFailure` are what the failure
report (:mod:`launcher.supervision.report`) reads. A supervisor given an ``insight`` watch
(:mod:`launcher.supervision.insight`) has it look at the workers' arrival figures every
step, and keeps their last figures in the result for the end-of-job table.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from launcher.output import OutputSink
from launcher.spec.job import JobSpec
from launcher.supervision.insight import InsightWatch
from launcher.transport.connection import AgentExit
from launcher.transport.protocol import (
    FORWARDED_SIGNALS,
    AgentSpec,
    Continued,
    Done,
    Stopped,
    WorkerLaunch,
)
from launcher.transport.startup import RendezvousListenError
from rendezvous import worker_env
from rendezvous.insight import RankFigures
from rendezvous.server.serving import ListenError, RendezvousServer
from rendezvous.slots import SlotInfo

log = logging.getLogger(__name__)

#: How long agents get, beyond the workers' grace period, to report before they are killed.
AGENT_REPORT_SLACK = 10.0
#: An agent answers a stop at once; one that has not within this long after hvdrun's stop is
#: taken for cut off (its host unreachable) and given up on, instead of waited for until the
#: stop deadline (the workers' grace and AGENT_REPORT_SLACK).
STOP_ANSWER_SECONDS = 5.0
#: At most this many events are handled between two rounds of signal and deadline checks.
EVENT_BATCH = 1000
#: The loop steps every poll interval; a gap this long means hvdrun itself was stopped or
#: starved, and the agents get as long again to be heard before their silence counts.
LOOP_STALL_SECONDS = 2.0
#: A worker continued less than this long before a peer failed still counts as stopped:
#: the peer's collective had timed out waiting for it before its exit reached hvdrun.
STOP_AFTERMATH_SECONDS = 2.0
#: A stop counts as a failure's cause only when it lasted at least this share of the
#: workers' collective timeout (HVDRUN_GLOO_TIMEOUT_SECONDS) before the failure: a peer
#: that failed sooner failed for its own reasons (a stop to look at a rank with a debugger
#: while another raises is not the cause of that).
STOP_BLAME_SHARE = 0.5
#: A worker that died of a signal at most this long before hvdrun learnt that the job was
#: signalled from outside (hvdrun's own signal, an agent's, Slurm cancelling the agents'
#: step) died of that signal: the same delivery reached it first (Slurm signals a whole
#: step or job at once), so it did not fail first.
SIGNALLED_WINDOW = 2.0


def collective_timeout(env: Mapping[str, str], default: float | None = None) -> float:
    """The collective timeout the workers read from ``env`` (HVDRUN_GLOO_TIMEOUT_SECONDS);
    ``default`` (else the setting's own) where it sets none, or not a valid one (the
    workers then refuse it themselves)."""
    name = worker_env.GLOO_TIMEOUT_SECONDS
    fallback = worker_env.NUMBERS[name].default if default is None else default
    try:
        return worker_env.number(name, fallback, env=env)
    except ValueError:
        return fallback


def rank_list(ranks: Sequence[int]) -> str:
    """Ranks for a message, runs of three or more as ranges (``0, 1``; ``0-1258, 1300``)."""
    ordered = sorted(ranks)
    parts: list[str] = []
    start = 0
    while start < len(ordered):
        end = start
        while end + 1 < len(ordered) and ordered[end + 1] == ordered[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{ordered[start]}-{ordered[end]}")
        else:
            parts.extend(str(rank) for rank in ordered[start : end + 1])
        start = end + 1
    return ", ".join(parts)


def signal_name(signum: int) -> str | None:
    """``SIGKILL`` for 9; None for a number that names no signal."""
    with contextlib.suppress(ValueError):
        return signal.Signals(signum).name
    return None


@dataclass
class WorkerStop:
    """A worker its agent reported stopped, from when hvdrun heard of it (``since``) until
    it was reported continued (``until``)."""

    rank: int
    hostname: str
    pid: int
    signum: int | None
    traced: bool
    since: float
    until: float | None = None

    def by(self) -> str:
        """What stopped it, in a word: ``SIGSTOP``, ``a debugger``, ``a signal``."""
        if self.traced:
            return "a debugger"
        found = signal_name(self.signum) if self.signum is not None else None
        return found or "a signal"

    def cause(self, peer: WorkerFailure) -> str:
        """Why it, not ``peer`` (a worker that exited while it was stopped), failed first."""
        how = f"it was stopped by {self.by()} ({'ptrace, ' if self.traced else ''}pid {self.pid})"
        if self.until is None:
            how += " and never continued; its peers' collectives timed out waiting for it"
        else:
            how += (
                f" for {self.until - self.since:.1f} s, continued only just before its peers "
                "failed; their collectives had timed out waiting for it"
            )
        return f"{how} (rank {peer.rank} exited first, with exit code {peer.code})"


@dataclass
class WorkerFailure:
    rank: int
    hostname: str
    code: int
    error: str | None = None
    #: The rank was stopped while ``peer`` failed: ``code`` is the peer's.
    stop: WorkerStop | None = None
    peer: WorkerFailure | None = None
    #: The rank whose leaving ended its collectives (its script ended), heard of exiting 0
    #: only after it.
    ended_by: int | None = None
    #: The op it never submitted, which ``peer`` waited for until the stall inspector
    #: stopped the job's collectives (``code`` is the peer's).
    stalled: str | None = None


@dataclass
class JobResult:
    exit_code: int
    failure: WorkerFailure | None = None
    interrupted_by: int | None = None
    exits: dict[int, int] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)  # exited after hvdrun began stopping
    lost: dict[int, str] = field(default_factory=dict)  # rank -> why it was never reported
    hosts: dict[int, str] = field(default_factory=dict)  # rank -> host
    figures: dict[str, RankFigures] = field(default_factory=dict)  # the workers' last figures
    # what the workers left in the rendezvous store under JobSpec.collect (hvdrun.run's results)
    collected: dict[str, bytes] = field(default_factory=dict)
    reason: str | None = None  # why the job was given up where no rank failed (elastic jobs)
    own_stall: float = 0.0  # the longest time hvdrun's own loop did not run (Ctrl-Z, starved)
    job_id: str = ""  # the job's id (HVDRUN_JOB_ID), which its timelines carry


def agent_spec(
    spec: JobSpec,
    hostname: str,
    slots: Sequence[SlotInfo],
    rendezvous: str,
    job_id: str,
    secret: str,
    heartbeat_timeout: float,
    cert_pem: str = "",
) -> AgentSpec:
    """What one host's agent is told to run: the job, and this host's share of ``slots``.

    The secret and the rendezvous's TLS certificate (``cert_pem``) travel in the workers'
    environment inside the start message, never in argv or a file."""
    env = dict(spec.env)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(worker_env.connection_env(rendezvous, job_id, secret, cert_pem))
    return AgentSpec(
        hostname=hostname,
        command=list(spec.command),
        cwd=spec.cwd,
        env=env,
        workers=[
            WorkerLaunch(rank=slot.rank, env=worker_env.slot_env(slot))
            for slot in slots
            if slot.hostname == hostname
        ],
        term_grace=spec.term_grace,
        rendezvous_addr=rendezvous,
        heartbeat_timeout=heartbeat_timeout,
        lost_after=spec.launch.lost_timeout,
        log_level=spec.launch.log_level,
    )


def agent_loss_reason(event: Done | AgentExit) -> str:
    """Why a host's agent went away, from its ``Done`` (too early) or its ``AgentExit``."""
    if isinstance(event, Done):
        return "its agent finished early"
    if event.code is None:
        why = "lost the connection to its agent"
    elif event.killed_by_hvdrun:
        why = "hvdrun killed its agent"
    elif event.code < 0:  # (a signal, as subprocess says: -9 is SIGKILL)
        why = f"its agent was killed by {signal_name(-event.code) or f'signal {-event.code}'}"
    else:
        why = f"its agent exited (code {event.code})"
    if event.reason:
        why += f": {event.reason}"
    return why


def signalled_message(host: str, signum: int, elastic: bool = False) -> str:
    """What hvdrun says when ``host``'s agent received ``signum`` from outside hvdrun: a
    fixed job stops; an elastic one loses the host."""
    name = signal.Signals(signum).name
    if elastic:
        return f"host {host}: its agent received {name} from outside hvdrun; its workers stop"
    return (
        f"the agent on {host} received {name} from outside hvdrun (scancel, a time limit, "
        "kill); stopping all workers"
    )


#: A signal that comes again within this many seconds is one signal sent twice: ``timeout``
#: (and a ``kill`` of the process group) sends hvdrun's SIGTERM to it and to its group.
REPEAT_SECONDS = 0.25


class Signals:
    """Records SIGINT/SIGTERM/SIGHUP/SIGQUIT for the supervision loop instead of raising
    mid-cleanup (SIGQUIT too, as torchrun does: Ctrl-\\ stops the job as a Ctrl-C does,
    rather than kill hvdrun alone). A SIGHUP that hvdrun started ignoring (``nohup``) stays
    ignored."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.received: list[int] = []
        self._taken = 0
        self._clock = clock
        self._last: tuple[int, float] | None = None
        #: SIGUSR1/SIGUSR2 to pass on to the workers (``FORWARDED_SIGNALS``), as mpirun does.
        self.to_forward: list[int] = []

    def record_forward(self, signum: int, frame: object = None) -> None:
        self.to_forward.append(signum)

    def record(self, signum: int, frame: object = None) -> None:
        now = self._clock()
        last = self._last
        if last is not None and last[0] == signum and now - last[1] < REPEAT_SECONDS:
            return  # (the same delivery twice, not a user's second signal)
        self._last = (signum, now)  # (from the last one recorded: Ctrl-C held down escalates)
        self.received.append(signum)

    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def take(self) -> list[tuple[int, int]]:
        """The signals received since the last call, each with how many came before it."""
        new = [(index, self.received[index]) for index in range(self._taken, len(self.received))]
        self._taken += len(new)
        return new

    @contextlib.contextmanager
    def installed(self) -> Iterator[Signals]:
        handled = [signal.SIGINT, signal.SIGTERM, signal.SIGQUIT]
        if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:  # (nohup hvdrun ...)
            handled.append(signal.SIGHUP)
        previous = {s: signal.signal(s, self.record) for s in handled}
        previous.update({s: signal.signal(s, self.record_forward) for s in FORWARDED_SIGNALS})
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class Supervised(Protocol):
    """What supervision needs of an agent: an AgentConnection, or a fake one in tests."""

    @property
    def hostname(self) -> str: ...

    @property
    def heartbeat_timeout(self) -> float: ...

    @property
    def last_heard(self) -> float: ...  # clock time of the agent's latest line

    @property
    def stop_answered(self) -> bool: ...  # whether it answered the latest terminate

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def abort(self) -> None: ...

    def signal(self, signum: int) -> None: ...


E = TypeVar("E")


class Events(queue.Queue[E]):
    """A supervisor's queue of events (its agents' and its own). An agent's reader that
    passes on a worker's line first waits for room in hvdrun's output
    (:meth:`OutputSink.wait_for_room`), so that the supervising thread never waits for a
    slow terminal or pipe (see :mod:`launcher.output`)."""

    def __init__(self, sink: OutputSink) -> None:
        super().__init__()
        self._sink = sink

    def room_for_output(self) -> None:
        self._sink.wait_for_room()


class Supervision(ABC, Generic[E]):
    """One job's supervision loop over events of type ``E``; see the module docstring.

    Subclasses say when the job is finished, which agents are still to be stopped, what an
    event means and what a silent agent means; the loop, signals, the stop deadline,
    heartbeats and stop/kill are here.
    """

    #: How long one step waits for the first event.
    poll_interval = 0.1

    def __init__(
        self,
        sink: OutputSink,
        events: queue.Queue[E],
        term_grace: float,
        signals: Signals,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.events = events
        self.term_grace = term_grace
        self.signals = signals
        self.clock = clock
        self.result = JobResult(exit_code=0)
        self.stopping = False  # every agent has been told to stop its workers
        self.stop_deadline: float | None = None  # then agents that have not reported are killed
        self.answer_due: float | None = None  # then those that did not answer it are given up
        self._last_check: float | None = None  # when this loop last judged heartbeats
        self._grace_until = 0.0  # after this loop itself stalled, silence is its own
        self.insight: InsightWatch | None = None  # watches the workers' arrival figures
        self.worker_stops: dict[int, WorkerStop] = {}  # rank (elastic: worker) -> its latest stop
        # how long a stop must have lasted before a failure to be its cause (set from the
        # workers' collective timeout: STOP_BLAME_SHARE)
        self.stop_blame_after = 0.0
        self._failed_at = 0.0  # (clock) when result.failure was recorded

    # ---- what differs between supervisors ----------------------------------------------

    #: What a worker is called in messages (its number is its rank in a fixed job)...
    worker_word = "rank"
    #: ... and what a stopped one means for the job ({host}: its host).
    stop_consequence = (
        "the other ranks' collectives wait for it, and time out unless it is continued"
    )

    @abstractmethod
    def finished(self) -> bool:
        """Whether the loop is done."""

    @abstractmethod
    def live_agents(self) -> list[Supervised]:
        """The agents that stopping and killing the job still has to reach."""

    def watched_agents(self) -> list[Supervised]:
        """The agents whose heartbeats are checked (by default every live agent)."""
        return self.live_agents()

    @abstractmethod
    def on_event(self, event: E) -> None: ...

    @abstractmethod
    def on_silent(self, agent: Supervised, why: str) -> bool:
        """``agent`` has been silent too long: True when that ends it (its connection is
        aborted right after this); False to give it more time."""

    def stop_agent(self, agent: Supervised) -> None:
        """Tells one live agent to stop its workers (SIGTERM, SIGKILL after the grace)."""
        agent.terminate()

    def abandon(self, agent: Supervised) -> None:
        """``agent`` was killed at the stop deadline; a supervisor that will not wait for
        its report forgets it here."""

    def after_events(self, now: float) -> None:
        """Called once per step, after the events (status lines, decisions)."""

    # ---- the loop --------------------------------------------------------------------

    def run(self) -> JobResult:
        while not self.finished():
            self.step()
        if self.insight is not None:
            try:
                self.result.figures = self.insight.figures()
            except Exception as error:  # the report is a bonus: never fail the job over it
                log.warning("could not read the workers' figures: %s", error)
        return self.result

    def step(self) -> None:
        self.act_on_signals()
        now = self.clock()
        if self.stop_deadline is not None and now > self.stop_deadline:
            late = self.live_agents()
            hosts = ", ".join(agent.hostname for agent in late)
            self.sink.message(
                f"the agents on {hosts or 'no host'} did not report within "
                f"{self.term_grace + AGENT_REPORT_SLACK:g} s of the stop; killing them"
            )
            self.stop_deadline = None
            for agent in late:
                agent.kill()
                self.abandon(agent)
        self.check_heartbeats(now)
        # (after a stall of this loop, the answers may wait unread in the pipes: see
        # check_heartbeats)
        if self.answer_due is not None and now > max(self.answer_due, self._grace_until):
            self.answer_due = None
            for agent in self.live_agents():
                if not agent.stop_answered:
                    self.sink.message(
                        f"host {agent.hostname}: its agent did not answer the stop within "
                        f"{STOP_ANSWER_SECONDS:g} s (is the host cut off?); giving up on it "
                        "(the agent stops its workers itself once it has heard nothing from "
                        "hvdrun for --heartbeat-timeout)"
                    )
                    agent.abort()  # (a kill request would not reach it either)
                    self.abandon(agent)
        self.drain_events()
        self.after_events(self.clock())
        if self.insight is not None and not self.stopping:
            self.insight.step(self.clock())

    def act_on_signals(self) -> None:
        forward = self.signals.to_forward
        while forward:
            signum = forward.pop(0)
            if not self.stopping:
                self.sink.message(f"forwarding {signal.Signals(signum).name} to the workers")
                for agent in self.live_agents():
                    agent.signal(signum)
        for before, signum in self.signals.take():
            if before == 0:
                name = signal.Signals(signum).name
                self.interrupt(signum, f"received {name}; stopping all workers")
            else:
                self.sink.message("second signal: killing all workers now")
                self.kill_all()

    def interrupt(self, signum: int, message: str) -> None:
        """The job was signalled from outside: hvdrun itself, an agent (its host's workers
        got the signal too, as a rule), or Slurm cancelling the agents' step. It stops and
        exits with 128+``signum``, unless a worker failed first: one that died of this
        signal just before (:data:`SIGNALLED_WINDOW`) was not the first to fail."""
        if self.result.interrupted_by is not None:
            return
        self.sink.message(message)
        failure = self.result.failure
        if (
            failure is not None
            and failure.code == 128 + signum
            and failure.error is None
            and failure.stop is None
            and self.clock() - self._failed_at <= SIGNALLED_WINDOW
        ):
            self.result.failure = None
        if self.result.failure is None:
            self.result.interrupted_by = signum
            self.result.exit_code = 128 + signum
        self.stop_all()

    def check_heartbeats(self, now: float) -> None:
        last, self._last_check = self._last_check, now
        if last is not None and now - last > LOOP_STALL_SECONDS:
            self.own_stall(last, now)
        if self.sink.backed_up():
            # The agents' readers wait for room in hvdrun's output (a slow reader of it):
            # their silence is hvdrun's own again, and their lines wait in the pipes.
            self._grace_until = now + LOOP_STALL_SECONDS
        if now < self._grace_until:
            return
        for agent in self.watched_agents():
            timeout = agent.heartbeat_timeout
            # The reader thread stamps last_heard, so a slow terminal cannot fake a silence.
            if (
                timeout > 0
                and now - agent.last_heard > timeout
                and self.on_silent(agent, f"heard nothing from its agent for {timeout:g} s")
            ):
                agent.abort()  # its agent stops its workers on its own heartbeat timeout

    def own_stall(self, since: float, now: float) -> None:
        """This loop did not run from ``since`` to ``now`` (hvdrun was stopped or starved of
        CPU): the agents' silence was hvdrun's own, and their lines wait in the pipes to be
        read. Said at once, and in the failure's report."""
        self.sink.message(
            f"hvdrun itself was stopped or starved of CPU for {now - since:.1f} s (Ctrl-Z "
            "stops hvdrun, not the job): its workers give the job up once it has been "
            "silent for --heartbeat-timeout and does not answer them"
        )
        self._grace_until = now + LOOP_STALL_SECONDS
        self._last_check = now
        self.result.own_stall = max(self.result.own_stall, now - since)

    def drain_events(self) -> None:
        waiting_since = self.clock()
        try:
            event = self.events.get(timeout=self.poll_interval)
        except queue.Empty:
            return
        now = self.clock()
        if now - waiting_since > LOOP_STALL_SECONDS:  # (stopped while it waited: the events
            self.own_stall(waiting_since, now)  # of that time may end the job in this batch)
        self.on_event(event)
        for _ in range(EVENT_BATCH - 1):
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                return
            self.on_event(event)

    # ---- acting on the job --------------------------------------------------------------

    def record_exit(self, rank: int, code: int) -> None:
        self.result.exits[rank] = code
        self.worker_stops.pop(rank, None)
        if self.stopping:
            self.result.stopped.add(rank)

    def record_stop(self, host: str, event: Stopped | Continued) -> None:
        """A worker was stopped (SIGSTOP, a debugger) or continued, as its agent saw it."""
        if self.stopping or event.rank in self.result.exits:
            return  # (hvdrun's own stop continues the stopped workers)
        if isinstance(event, Stopped):
            open_stop = self.worker_stops.get(event.rank)
            if open_stop is not None and open_stop.until is None:
                return  # (still the stop it told of: stopped since then)
            stop = WorkerStop(event.rank, host, event.pid, event.signum, event.traced, self.clock())
            self.sink.message(
                f"{self.worker_word} {event.rank} on {host} was stopped by {stop.by()} "
                f"(pid {event.pid}): {self.stop_consequence.format(host=host)}"
            )
            self.worker_stops[event.rank] = stop
            return
        stopped = self.worker_stops.get(event.rank)
        if stopped is not None and stopped.until is None:
            stopped.until = self.clock()
            self.sink.message(f"{self.worker_word} {event.rank} on {host} was continued")

    def stopped_among(self, workers: Iterable[int]) -> WorkerStop | None:
        """The first of ``workers`` that is stopped now (reported, not continued)."""
        stops = (self.worker_stops.get(worker) for worker in workers)
        now = [stop for stop in stops if stop is not None and stop.until is None]
        return min(now, key=lambda stop: stop.since, default=None)

    def stop_behind(self, failure: WorkerFailure) -> WorkerFailure | None:
        """The failure to name when ``failure`` (a worker's exit) came while another worker
        was stopped, or was continued less than ``STOP_AFTERMATH_SECONDS`` before: the one
        stopped first, with ``failure``'s exit code. None when no worker was stopped."""
        now = self.clock()
        stops = [
            stop
            for rank, stop in self.worker_stops.items()
            if rank != failure.rank
            and (stop.until is None or now - stop.until < STOP_AFTERMATH_SECONDS)
            and (stop.until or now) - stop.since >= self.stop_blame_after
        ]
        if not stops:
            return None
        stop = min(stops, key=lambda stop: (stop.since, stop.rank))
        return WorkerFailure(
            stop.rank, stop.hostname, failure.code, stop.cause(failure), stop, failure
        )

    def fail(self, failure: WorkerFailure) -> None:
        """The first failure decides the exit code, unless a signal came first, and stops
        the job."""
        if self.stopping:
            return
        self.result.failure = failure
        self.result.exit_code = failure.code
        self._failed_at = self.clock()
        self.stop_all()

    def stop_all(self) -> None:
        """Every live agent stops its workers; the stop deadline starts."""
        if self.stopping:
            return
        self.stopping = True
        self.sink.stop_waiting()  # (the agents' reports must not wait behind the output)
        if self.insight is not None:
            self.insight.stop()
        self.sink.status(None)
        self.stop_deadline = self.clock() + self.term_grace + AGENT_REPORT_SLACK
        self.answer_due = self.clock() + STOP_ANSWER_SECONDS
        for agent in self.live_agents():
            self.stop_agent(agent)

    def kill_all(self) -> None:
        for agent in self.live_agents():
            agent.kill()


def start_server(server: RendezvousServer, explicit: str | None) -> int:
    """Starts the job's rendezvous server; a port or address it cannot listen on becomes
    :class:`RendezvousListenError`, one line for the user."""
    try:
        return server.start()
    except ListenError as exc:
        where = f"--rendezvous-addr {explicit}: " if explicit else ""
        raise RendezvousListenError(f"{where}the rendezvous server {exc}") from None
