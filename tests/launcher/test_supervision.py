"""The supervision core (launcher.supervision.core) and the fixed-job Supervisor, driven step
by step with fake agents, typed events and a fake clock: no processes, no sockets."""

from __future__ import annotations

import io
import os
import queue
import re
import signal
import time
from typing import Any, cast

import pytest

from launcher.output import OutputSink
from launcher.supervision.core import (
    AGENT_REPORT_SLACK,
    EVENT_BATCH,
    SIGNALLED_WINDOW,
    STOP_ANSWER_SECONDS,
    Signals,
    Supervised,
    Supervision,
    WorkerFailure,
    rank_list,
)
from launcher.supervision.fixed import ENDED_BY_WAIT, JOIN_NOTICE_SECONDS, Supervisor
from launcher.supervision.report import report_failure
from launcher.transport.connection import AgentExit, HostEvent, StepCancelled
from launcher.transport.protocol import Done, Exit, Output, Signalled
from rendezvous import worker_env
from rendezvous.slots import assign_slots

GRACE = 5.0


class FakeAgent:
    """Just what supervision uses of an agent; records what it was asked to do."""

    def __init__(
        self, hostname: str, heartbeat_timeout: float = 0.0, answers_stop: bool = True
    ) -> None:
        self.hostname = hostname
        self.heartbeat_timeout = heartbeat_timeout
        self.last_heard = 0.0
        self.answers_stop = answers_stop  # (a cut-off host's agent answers nothing)
        self.stop_answered = True
        self.calls: list[str] = []

    def terminate(self) -> None:
        self.calls.append("terminate")
        self.stop_answered = self.answers_stop

    def kill(self) -> None:
        self.calls.append("kill")

    def abort(self) -> None:
        self.calls.append("abort")

    def signal(self, signum: int) -> None:
        self.calls.append(f"signal {signal.Signals(signum).name}")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sink() -> tuple[OutputSink, io.BytesIO, io.BytesIO]:
    out, err = io.BytesIO(), io.BytesIO()
    return OutputSink(out, err), out, err


class Hosts(Supervision[HostEvent]):
    """The smallest supervisor on the core: a host is live until it reports Done, a
    non-zero exit fails the job, a silent host is dropped."""

    poll_interval = 0.0

    def __init__(self, *agents: FakeAgent, clock: Clock, signals: Signals | None = None) -> None:
        self.output, _, self.err = sink()
        super().__init__(self.output, queue.Queue(), GRACE, signals or Signals(), clock)
        self.agents = {agent.hostname: agent for agent in agents}
        self.live = set(self.agents)
        self.silent: list[tuple[str, str]] = []

    def finished(self) -> bool:
        return not self.live

    def live_agents(self) -> list[Supervised]:
        return [self.agents[host] for host in sorted(self.live)]

    def on_event(self, item: HostEvent) -> None:
        match item.event:
            case Exit(rank, code):
                self.record_exit(rank, code)
                if code != 0:
                    self.fail(WorkerFailure(rank, item.host, code))
            case Done():
                self.live.discard(item.host)

    def on_silent(self, agent: Supervised, why: str) -> bool:
        self.silent.append((agent.hostname, why))
        self.live.discard(agent.hostname)
        return True

    def put(self, host: str, *events: Exit | Done) -> None:
        for event in events:
            self.events.put(HostEvent(host, event))

    def messages(self) -> list[str]:
        return self.err.getvalue().decode().splitlines()


class StoppedWhileWaiting(queue.Queue[HostEvent]):
    """An event queue whose first wait for an event lasts ``stall`` seconds of ``clock``:
    hvdrun was stopped (Ctrl-Z) while its loop waited, and what happened meanwhile (every
    worker gave the job up) is queued all at once."""

    def __init__(self, clock: Clock, stall: float) -> None:
        super().__init__()
        self.clock, self.stall = clock, stall

    def get(self, block: bool = True, timeout: float | None = None) -> HostEvent:
        self.clock.now, self.stall = self.clock.now + self.stall, 0.0
        return super().get(block, timeout)


def test_a_job_lost_while_hvdrun_itself_was_stopped_says_so() -> None:
    """Both workers gave the job up while hvdrun was stopped, and the loop ends in the batch
    that reads their exits: hvdrun still says it was stopped, and its failure report names
    that stop beside the rank that failed first."""
    clock = Clock()
    job = Hosts(FakeAgent("a"), clock=clock)
    job.events = StoppedWhileWaiting(clock, 12.0)
    job.put("a", Exit(1, 1), Exit(0, 1), Done())
    job.run()
    report_failure(job.result, job.output)
    said = job.messages()
    assert said[0].startswith("hvdrun: hvdrun itself was stopped or starved of CPU for 12.0 s")
    assert said[2] == "hvdrun: rank 1 on host a failed first: exit code 1", said
    assert said[3].startswith(
        "hvdrun: hvdrun itself was stopped or starved of CPU for 12.0 s while the job ran "
        "(Ctrl-Z stops hvdrun, not the job): workers that hear nothing from it for "
        "--heartbeat-timeout give the job up"
    ), said
    assert sum("stopped or starved" in line for line in said) == 2, said


def test_a_failure_without_a_stop_of_hvdrun_does_not_mention_one() -> None:
    job = Hosts(FakeAgent("a"), clock=Clock())
    job.put("a", Exit(1, 1), Exit(0, 1), Done())
    job.run()
    report_failure(job.result, job.output)
    assert not any("stopped or starved" in line for line in job.messages())


def test_a_rank_that_failed_by_exiting_0_is_not_said_to_exit_non_zero() -> None:
    """Horovod's sentence opens every failure report; where the rank that failed first
    exited 0 (it never joined the job), it does not claim a non-zero status."""
    job = Hosts(FakeAgent("a"), clock=Clock())
    job.record_exit(1, 0)
    job.fail(WorkerFailure(1, "a", 1, "it exited (code 0) without joining the job"))
    report_failure(job.result, job.output)
    assert job.messages()[:2] == [
        "hvdrun: Horovod detected that one or more processes exited (with status 0) while the "
        "others still needed them, thus causing the job to be terminated.",
        "hvdrun: rank 1 on host a failed first: it exited (code 0) without joining the job",
    ]


def test_first_signal_stops_every_agent_and_exits_128_plus_signal() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    job = Hosts(a, b, clock=clock)
    job.signals.record(signal.SIGINT)
    job.step()
    assert a.calls == b.calls == ["terminate"]
    assert (job.result.exit_code, job.result.interrupted_by) == (130, signal.SIGINT)
    assert job.messages() == ["hvdrun: received SIGINT; stopping all workers"]
    assert job.stop_deadline == GRACE + AGENT_REPORT_SLACK
    job.step()  # a signal is acted on once
    assert a.calls == ["terminate"]


def test_second_signal_kills_without_grace() -> None:
    a = FakeAgent("a")
    job = Hosts(a, clock=Clock())
    job.signals.record(signal.SIGTERM)
    job.step()
    job.signals.record(signal.SIGINT)
    job.step()
    assert a.calls == ["terminate", "kill"]
    assert job.result.exit_code == 128 + signal.SIGTERM  # the first signal is the outcome
    assert job.messages()[-1] == "hvdrun: second signal: killing all workers now"


def test_sigusr1_is_forwarded_to_every_agent_and_the_job_runs_on() -> None:
    """As mpirun does: Slurm's ``--signal=USR1@60`` reaches the workers (a checkpoint
    before the time limit), and the job goes on; once stopping, nothing is forwarded."""
    a, b = FakeAgent("a"), FakeAgent("b")
    job = Hosts(a, b, clock=Clock())
    job.signals.record_forward(signal.SIGUSR1)
    job.step()
    assert a.calls == b.calls == ["signal SIGUSR1"]
    assert job.messages() == ["hvdrun: forwarding SIGUSR1 to the workers"]
    assert not job.stopping and job.result.exit_code == 0
    job.signals.record(signal.SIGTERM)
    job.step()
    job.signals.record_forward(signal.SIGUSR2)
    job.step()
    assert a.calls == ["signal SIGUSR1", "terminate"]


def test_one_signal_delivered_twice_at_once_is_one_signal() -> None:
    """``timeout`` sends SIGTERM to hvdrun and then to its process group: hvdrun stops the
    job with the grace period, rather than killing it as for a user's second signal."""
    now = [0.0]
    signals = Signals(clock=lambda: now[0])
    signals.record(signal.SIGTERM)
    now[0] += 0.001
    signals.record(signal.SIGTERM)
    assert signals.take() == [(0, signal.SIGTERM)]
    now[0] += 1.0
    signals.record(signal.SIGTERM)  # a second one, later: the user means it
    assert signals.take() == [(1, signal.SIGTERM)]
    for _ in range(3):  # Ctrl-C pressed again and again, 0.2 s apart: the second one counts
        now[0] += 0.2
        signals.record(signal.SIGINT)
    assert signals.take() == [(2, signal.SIGINT), (3, signal.SIGINT)]


def test_a_sighup_ignored_before_hvdrun_started_stays_ignored() -> None:
    """``nohup hvdrun ...``: the job outlives the terminal, as nohup promises."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Signals().installed():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signals = Signals()
        with signals.installed():
            assert signal.getsignal(signal.SIGHUP) == signals.record
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_failure_before_the_signal_decides_the_exit_code() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    job = Hosts(a, b, clock=Clock())
    job.put("b", Exit(1, 3))
    job.step()
    assert a.calls == b.calls == ["terminate"]  # one failure stops every host
    job.signals.record(signal.SIGINT)
    job.step()
    assert job.result.failure == WorkerFailure(1, "b", 3)
    assert (job.result.exit_code, job.result.interrupted_by) == (3, None)
    assert a.calls == ["terminate"]  # already stopping


def test_a_signal_before_the_failure_decides_the_exit_code() -> None:
    a = FakeAgent("a")
    job = Hosts(a, clock=Clock())
    job.signals.record(signal.SIGTERM)
    job.step()
    job.put("a", Exit(0, 143), Exit(1, 1))
    job.step()
    assert job.result.failure is None
    assert job.result.exit_code == 143
    assert job.result.stopped == {0, 1}  # exited after hvdrun began stopping


def test_stop_deadline_escalates_to_kill_for_agents_that_have_not_reported() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    job = Hosts(a, b, clock=clock)
    job.put("a", Exit(0, 9))
    job.step()
    job.put("a", Done())  # a reports in time, b does not
    clock.now = GRACE + AGENT_REPORT_SLACK
    job.step()
    assert b.calls == ["terminate"]
    clock.now += 0.1
    job.step()
    assert a.calls == ["terminate"]
    assert b.calls == ["terminate", "kill"]
    assert job.stop_deadline is None
    late = f"hvdrun: the agents on b did not report within {GRACE + AGENT_REPORT_SLACK:g} s"
    assert any(line.startswith(late) for line in job.messages()), job.messages()
    clock.now += 100
    job.step()
    assert b.calls == ["terminate", "kill"]  # killed once


def test_an_agent_that_does_not_answer_the_stop_is_given_up_on_soon() -> None:
    # Ctrl-C while host b is cut off: its agent never hears the stop. hvdrun gives it up
    # after STOP_ANSWER_SECONDS instead of waiting out the workers' grace and the slack
    # (17.7 s in all on a real cluster before); an agent that answered is waited for.
    a, b = FakeAgent("a"), FakeAgent("b", answers_stop=False)
    clock = Clock()
    job = Hosts(a, b, clock=clock)
    job.signals.record(signal.SIGINT)
    job.step()
    while clock.now < STOP_ANSWER_SECONDS:
        clock.now += 0.5
        job.step()
    assert b.calls == ["terminate"]  # (not before the time)
    clock.now += 0.1
    job.step()
    assert a.calls == ["terminate"]
    assert b.calls == ["terminate", "abort"]
    said = "hvdrun: host b: its agent did not answer the stop within 5 s (is the host cut off?)"
    assert any(line.startswith(said) for line in job.messages()), job.messages()
    job.put("a", Done())
    job.put("b", Done())  # (as the end of b's aborted connection ends it)
    job.step()
    assert job.finished() and clock.now < GRACE + AGENT_REPORT_SLACK
    assert b.calls == ["terminate", "abort"]  # given up once


def test_after_hvdrun_itself_stalled_the_stops_answers_get_time_to_be_read() -> None:
    # hvdrun was stopped (Ctrl-Z) or starved right after its stop: the agents' answers wait
    # unread in the pipes, and no host is given up on before they could be read.
    a = FakeAgent("a", answers_stop=False)
    clock = Clock()
    job = Hosts(a, clock=clock)
    job.signals.record(signal.SIGINT)
    job.step()
    clock.now = STOP_ANSWER_SECONDS + 3  # (this loop did not run meanwhile)
    job.step()
    assert a.calls == ["terminate"]
    a.stop_answered = True  # (its reader, running again, reads the answer)
    clock.now += 2.5
    job.step()
    assert a.calls == ["terminate"]
    assert not any("did not answer the stop" in line for line in job.messages())


def test_rank_lists_in_messages_give_runs_as_ranges() -> None:
    assert rank_list([1]) == "1"
    assert rank_list([3, 2]) == "2, 3"
    assert rank_list([*range(1259), 1300, 1302, 1303]) == "0-1258, 1300, 1302, 1303"


def test_a_silent_agent_is_lost_and_its_connection_dropped() -> None:
    watched, unwatched = FakeAgent("a", heartbeat_timeout=2.0), FakeAgent("b")
    clock = Clock()
    job = Hosts(watched, unwatched, clock=clock)
    clock.now = 2.0
    job.step()
    assert job.silent == []
    watched.last_heard = 1.0  # the reader thread heard it
    clock.now = 3.0
    job.step()
    assert job.silent == []
    clock.now = 3.1
    job.step()
    assert job.silent == [("a", "heard nothing from its agent for 2 s")]
    assert watched.calls == ["abort"]
    assert unwatched.calls == []  # no heartbeat timeout: never silent


def test_after_hvdrun_itself_stalled_its_agents_get_time_to_be_heard() -> None:
    # hvdrun was stopped (SIGSTOP) or starved: its own loop did not run, so the agents'
    # silence meanwhile is not theirs; they are judged again only after a grace period.
    agent = FakeAgent("a", heartbeat_timeout=2.0)
    clock = Clock()
    job = Hosts(agent, clock=clock)
    clock.now = 1.0
    job.step()
    clock.now = 9.0  # the loop stalled for 8 s; the agent was last heard at 0
    job.step()
    assert job.silent == []
    said = job.err.getvalue().decode()
    assert "hvdrun: hvdrun itself was stopped or starved of CPU for 8.0 s (Ctrl-Z" in said
    agent.last_heard = 9.5  # its lines, read once hvdrun runs again
    clock.now = 10.5
    job.step()
    assert job.silent == []
    clock.now = 12.0  # silent again for longer than its timeout, after the grace
    job.step()
    assert job.silent == [("a", "heard nothing from its agent for 2 s")]


def test_hosts_reporting_done_end_the_loop() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    job = Hosts(a, b, clock=Clock())
    job.put("a", Exit(0, 0), Done())
    job.put("b", Exit(1, 0), Done())
    result = job.run()
    assert (result.exit_code, result.exits, result.failure) == (0, {0: 0, 1: 0}, None)
    assert a.calls == b.calls == []


def test_events_are_handled_in_batches_between_signal_checks() -> None:
    job = Hosts(FakeAgent("a"), clock=Clock())
    job.put("a", *(Exit(rank, 0) for rank in range(EVENT_BATCH + 5)))
    job.step()
    assert len(job.result.exits) == EVENT_BATCH
    job.step()
    assert len(job.result.exits) == EVENT_BATCH + 5


def test_signals_are_recorded_while_installed_then_handlers_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with Signals().installed() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not signals.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert signals.received == [signal.SIGTERM]
        assert signals.take() == [(0, signal.SIGTERM)]
        assert signals.take() == []
    assert signal.getsignal(signal.SIGTERM) == before


# ---- the fixed-job Supervisor ----------------------------------------------------------


class FakeServer:
    """What the fixed supervisor reads of its rendezvous server: the store's values."""

    def __init__(
        self, values: dict[str, bytes], registered: frozenset[tuple[str, int]] | None = None
    ) -> None:
        self.values = values
        self.registered = registered  # the (host, local rank) slots; None: every slot

        self.busy = False  # its loop does not answer (a starved machine)

    def values_under(self, prefix: str) -> dict[str, bytes]:
        if self.busy:
            raise TimeoutError("the rendezvous server did not answer")
        return {key: value for key, value in self.values.items() if key.startswith(prefix)}

    def registered_count(self) -> int:
        if self.busy:
            raise TimeoutError("the rendezvous server did not answer")
        return 4 if self.registered is None else len(self.registered)

    def registered_slots(self) -> Any:
        if self.busy:
            raise TimeoutError("the rendezvous server did not answer")
        return _Every() if self.registered is None else self.registered


class _Every:
    def __contains__(self, slot: object) -> bool:
        return True

    def __len__(self) -> int:
        return 1 << 20


def fixed(
    *agents: FakeAgent,
    slots_per_host: int = 2,
    clock: Clock | None = None,
    server: FakeServer | None = None,
) -> tuple[Supervisor, io.BytesIO, io.BytesIO]:
    slots = assign_slots([(a.hostname, slots_per_host) for a in agents], 2 * len(agents))
    output, out, err = sink()
    supervisor = Supervisor(
        list(agents),
        slots,
        output,
        queue.Queue(),
        GRACE,
        Signals(),
        server=cast(Any, server),
        clock=clock or Clock(),
    )
    supervisor.poll_interval = 0.0
    return supervisor, out, err


def put(supervisor: Supervisor, host: str, *events: Exit | Done | Output | AgentExit) -> None:
    for event in events:
        supervisor.events.put(HostEvent(host, event))


def test_fixed_job_that_succeeds() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    supervisor, out, _ = fixed(a, b)
    put(supervisor, "a", Output(0, "stdout", b"hello"), Exit(0, 0), Exit(1, 0), Done())
    put(supervisor, "b", Exit(2, 0), Exit(3, 0), Done())
    result = supervisor.run()
    assert result.exit_code == 0
    assert result.hosts == {0: "a", 1: "a", 2: "b", 3: "b"}
    assert out.getvalue() == b"[0]<stdout>:hello\n"
    assert a.calls == b.calls == []


def test_fixed_job_first_failure_stops_every_host() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    supervisor, _, _ = fixed(a, b)
    put(supervisor, "b", Exit(2, 3))
    supervisor.step()
    assert a.calls == b.calls == ["terminate"]
    put(supervisor, "a", Exit(0, 143), Exit(1, 143), Done())
    put(supervisor, "b", Exit(3, 143), Done())
    result = supervisor.run()
    assert result.exit_code == 3
    assert result.failure == WorkerFailure(2, "b", 3, None)
    assert result.stopped == {0, 1, 3}


@pytest.mark.parametrize(
    ("after", "code", "blamed"),
    [
        (0.5, 143, False),  # the agent's news came just behind the worker's death: no blame
        (SIGNALLED_WINDOW + 1, 143, True),  # long after: the worker had failed by then
        (0.5, 137, True),  # a death by another signal is the worker's own failure
    ],
)
def test_a_signal_from_outside_that_reached_the_workers_first_is_not_their_failure(
    after: float, code: int, blamed: bool
) -> None:
    """``scancel`` of a job (or its time limit) signals the agents and the workers at once;
    the worker's exit may reach hvdrun before its agent's word that a SIGTERM came from
    outside, and that rank must not be named as the job's first failure."""
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    supervisor, _, err = fixed(a, b, clock=clock)
    put(supervisor, "b", Exit(2, code))
    supervisor.step()
    clock.now += after
    supervisor.events.put(HostEvent("b", Signalled(signal.SIGTERM)))
    put(supervisor, "a", Exit(0, 143), Exit(1, 143), Done())
    put(supervisor, "b", Exit(3, 143), Done())
    result = supervisor.run()
    report_failure(result, supervisor.sink)  # (what hvdrun says at the end)
    said = err.getvalue().decode()
    assert "the agent on b received SIGTERM from outside hvdrun" in said
    if blamed:
        assert result.failure is not None and result.failure.rank == 2
        assert (result.exit_code, result.interrupted_by) == (code, None)
        assert "rank 2 on host b failed first" in said
    else:
        assert (result.failure, result.interrupted_by) == (None, signal.SIGTERM)
        assert result.exit_code == 143
        assert "failed first" not in said and "Horovod detected" not in said
    assert a.calls == b.calls == ["terminate"]


def test_a_signal_from_outside_on_one_host_stops_the_job() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    supervisor, _, err = fixed(a, b)
    supervisor.events.put(HostEvent("a", Signalled(signal.SIGHUP)))
    supervisor.step()
    assert a.calls == b.calls == ["terminate"]
    assert "the agent on a received SIGHUP from outside hvdrun" in err.getvalue().decode()
    put(supervisor, "a", Exit(0, 129), Exit(1, 129), Done())
    put(supervisor, "b", Exit(2, 143), Exit(3, 143), Done())
    result = supervisor.run()
    assert (result.exit_code, result.interrupted_by, result.failure) == (129, signal.SIGHUP, None)


def test_a_cancelled_step_is_said_after_an_agents_signal_and_no_agent_is_cut_off() -> None:
    # scancel of the job: an agent's word of its SIGTERM may come before srun's of the
    # cancelled step; both are said. The agents, which Slurm ends, answer no stop (srun
    # forwards nothing any more): hvdrun does not take their hosts for cut off.
    a, b = FakeAgent("a", answers_stop=False), FakeAgent("b", answers_stop=False)
    clock = Clock()
    supervisor, _, err = fixed(a, b, clock=clock)
    supervisor.events.put(HostEvent("b", Signalled(signal.SIGTERM)))
    supervisor.step()
    supervisor.events.put(HostEvent("a", StepCancelled("the Slurm job step was cancelled")))
    supervisor.step()
    clock.now += 2 * STOP_ANSWER_SECONDS
    supervisor.step()
    said = err.getvalue().decode()
    assert "the agent on b received SIGTERM from outside hvdrun" in said
    assert "hvdrun: the Slurm job step was cancelled" in said
    assert "did not answer the stop" not in said
    assert a.calls == b.calls == ["terminate"]


@pytest.mark.parametrize(
    ("then", "first"),
    [
        (Exit(0, 1), 0),  # the rank that left failed too: it failed first
        (Exit(0, 0), 1),  # it left cleanly: the failure stands
        (None, 1),  # it is not heard of in time: the failure stands
    ],
)
def test_fixed_job_names_the_rank_whose_leaving_ended_a_failed_ones_collectives(
    then: Exit | None, first: int
) -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    server = FakeServer({worker_env.ENDED_BY_KEY_PREFIX + "1": b"0"})
    supervisor, _, _ = fixed(a, b, clock=clock, server=server)
    put(supervisor, "a", Exit(1, 1))  # rank 1 failed because rank 0 left
    supervisor.step()
    assert supervisor.result.failure is None and a.calls == b.calls == []
    if then is None:
        clock.now += ENDED_BY_WAIT
    else:
        put(supervisor, "a", then)
    supervisor.step()
    left = 0 if then == Exit(0, 0) else None  # (the report lists it as having exited 0)
    assert supervisor.result.failure == WorkerFailure(first, "a", 1, None, ended_by=left)
    assert a.calls == b.calls == ["terminate"]


@pytest.mark.parametrize("waiting", [True, False])
def test_a_rank_that_never_joined_stops_a_job_whose_other_ranks_wait(waiting: bool) -> None:
    """Rank 1 exits 0 without registering (no hvd.init()): rank 0, registered and still
    running, waits for it in hvd.init(), so the job stops at once naming rank 1. Where
    the registered rank has exited too (a script that is done), nobody waits."""
    a = FakeAgent("a")
    server = FakeServer({}, registered=frozenset({("a", 0)}))
    supervisor, _, _ = fixed(a, server=server)
    if not waiting:
        put(supervisor, "a", Exit(0, 0))
    put(supervisor, "a", Exit(1, 0))
    supervisor.step()
    if waiting:
        assert supervisor.result.failure is not None
        assert (supervisor.result.failure.rank, supervisor.result.exit_code) == (1, 1)
        assert a.calls == ["terminate"]
    else:
        assert supervisor.result.failure is None and a.calls == []


def test_a_live_rank_that_has_not_called_init_long_after_the_first_is_named_once() -> None:
    """Rank 1 runs on without hvd.init() (a script that calls it on some ranks only): rank
    0 waits for it in hvd.init() until that times out. hvdrun names rank 1 once, after
    JOIN_NOTICE_SECONDS, instead of a silent wait."""
    a = FakeAgent("a")
    clock = Clock()
    server = FakeServer({}, registered=frozenset({("a", 0)}))
    supervisor, _, err = fixed(a, clock=clock, server=server)
    supervisor.step()  # (rank 0 registered: the wait starts)
    clock.now += JOIN_NOTICE_SECONDS - 1
    supervisor.step()
    assert b"have not called" not in err.getvalue()
    for _ in range(3):
        clock.now += 2
        supervisor.step()
    said = err.getvalue().decode()
    line = (
        "hvdrun: rank(s) 1 (on a) have not called hvd.init() 30 s after the first rank did: "
        "the ranks in hvd.init() wait for them there until it times out (every rank must "
        "call hvd.init())\n"
    )
    assert said.count(line) == 1, said
    assert supervisor.result.failure is None and a.calls == []  # (a note: it may come yet)


def test_fixed_job_rides_out_a_server_too_busy_to_answer() -> None:
    # Its status line waits for the next step; a failure is decided without the hint.
    a, b = FakeAgent("a"), FakeAgent("b")
    server = FakeServer({worker_env.ENDED_BY_KEY_PREFIX + "1": b"0"})
    server.busy = True
    supervisor, _, _ = fixed(a, b, server=server)
    supervisor.step()
    put(supervisor, "a", Exit(1, 1))
    supervisor.step()
    assert supervisor.result.failure == WorkerFailure(1, "a", 1, None)


def test_fixed_job_names_the_ranks_of_a_lost_agent() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    supervisor, _, err = fixed(a, b)
    put(supervisor, "a", Exit(0, 0), AgentExit(None, "Connection reset by peer"))
    supervisor.step()
    why = "lost the connection to its agent: Connection reset by peer"
    assert err.getvalue().decode() == f"hvdrun: host a: {why}; rank(s) 1 not reported\n"
    assert supervisor.result.exit_code == 255
    assert supervisor.result.lost == {1: why}
    assert (a.calls, b.calls) == ([], ["terminate"])  # a is gone already


def test_fixed_job_loses_a_silent_host() -> None:
    a, b = FakeAgent("a"), FakeAgent("b", heartbeat_timeout=30.0)
    clock = Clock()
    supervisor, _, err = fixed(a, b, clock=clock)
    clock.now = 30.5
    supervisor.step()
    assert err.getvalue().decode() == (
        "hvdrun: host b: heard nothing from its agent for 30 s; rank(s) 2, 3 not reported\n"
    )
    assert (a.calls, b.calls) == (["terminate"], ["abort"])
    assert supervisor.result.failure == WorkerFailure(
        2, "b", 255, "heard nothing from its agent for 30 s"
    )
    report_failure(supervisor.result, supervisor.sink)
    said = err.getvalue().decode()
    assert (
        "rank 2 on host b failed first: heard nothing from its agent for 30 s (hvdrun exits "
        "with code 255)\n"
    ) in said, said
    assert re.search(r"hvdrun: +2 +b +- +FAILED FIRST", said), said  # (no exit code: "-")


def test_fixed_job_reports_a_worker_that_could_not_start() -> None:
    supervisor, _, err = fixed(FakeAgent("a"))
    put(supervisor, "a", Exit(1, 127, "cannot run 'trian.py': No such file or directory"))
    supervisor.step()
    assert err.getvalue().decode() == (
        "hvdrun: rank 1 on a: cannot run 'trian.py': No such file or directory\n"
    )
    assert supervisor.result.exit_code == 127


def test_a_worker_its_agent_stopped_on_its_own_is_named_with_the_agent_s_reason() -> None:
    """A host's agent that heard nothing from hvdrun for the heartbeat timeout (a network
    down that long) stops its workers; once hvdrun hears again, the failure is that, not a
    SIGTERM from nowhere."""
    supervisor, _, err = fixed(FakeAgent("a"), FakeAgent("b"))
    why = "stopped by its host's agent: it heard nothing from hvdrun for over 30 s (...)"
    put(supervisor, "b", Exit(2, 143, why))
    supervisor.step()
    report_failure(supervisor.result, supervisor.sink)
    said = err.getvalue().decode()
    assert f"hvdrun: rank 2 on host b failed first: {why}\n" in said, said


@pytest.mark.parametrize(
    ("event", "why"),
    [
        (Done(), "its agent finished early"),
        (AgentExit(3, ""), "its agent exited (code 3)"),
        (AgentExit(-9, ""), "its agent was killed by SIGKILL"),  # (kill -9 of the agent)
    ],
)
def test_fixed_job_says_why_an_agent_went_away(event: Done | AgentExit, why: str) -> None:
    supervisor, _, err = fixed(FakeAgent("a"))
    put(supervisor, "a", event)
    supervisor.run()
    assert err.getvalue().decode() == f"hvdrun: host a: {why}; rank(s) 0, 1 not reported\n"


@pytest.mark.parametrize("heard_again", [False, True])
def test_a_failure_while_another_host_is_silent_waits_for_that_hosts_verdict(
    heard_again: bool,
) -> None:
    """Host b is cut off from hvdrun (not from a): its agent stops its workers after its
    own heartbeat timeout, and a's ranks fail at once. hvdrun hears of a's failure before
    its own check of b's silence: b, the cause, is named first. Where b is heard from
    again (it was only slow), a's failure stands."""
    a, b = FakeAgent("a", heartbeat_timeout=30.0), FakeAgent("b", heartbeat_timeout=30.0)
    clock = Clock()
    supervisor, _, _ = fixed(a, b, clock=clock)
    clock.now = a.last_heard = 29.0  # b silent since 0
    put(supervisor, "a", Exit(1, 1))
    supervisor.step()
    assert supervisor.result.failure is None and a.calls == b.calls == []
    if heard_again:
        b.last_heard = 29.5
        supervisor.step()
        assert supervisor.result.failure == WorkerFailure(1, "a", 1, None)
        return
    clock.now = a.last_heard = 30.5
    supervisor.step()
    why = "heard nothing from its agent for 30 s"
    assert supervisor.result.failure == WorkerFailure(2, "b", 255, why)
    assert supervisor.result.exit_code == 255
