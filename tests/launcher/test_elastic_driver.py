"""The elastic driver's agent start-up, driven step by step with fake agents: the start thread
makes the agent and reports it, and only the driver's main loop touches the host records."""

from __future__ import annotations

import io
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from launcher.output import OutputSink
from launcher.spec.hosts import HostSpec
from launcher.spec.job import JobSpec
from launcher.spec.options import ElasticOptions, LaunchOptions
from launcher.supervision import elastic
from launcher.supervision.core import Signals
from launcher.supervision.discovery import FixedHosts
from launcher.supervision.elastic import ElasticDriver
from launcher.supervision.membership import HostRecord
from launcher.transport.connection import AgentExit, AgentStartError, HostEvent
from rendezvous.slots import SlotInfo


class StartingAgent:
    """An agent whose start() waits until it is aborted (or the test gives up)."""

    kind = "local"
    heartbeat_timeout = 0.0
    hello = None

    def __init__(self, hostname: str) -> None:
        self.hostname = hostname
        self.last_heard = 0.0
        self.calls: list[str] = []
        self.started = threading.Event()
        self._aborted = threading.Event()

    def start(self, deadline: float) -> None:
        self.calls.append("start")
        self.started.set()
        self._aborted.wait(10)
        raise AgentStartError("aborted" if self._aborted.is_set() else "timed out")

    def abort(self) -> None:
        self.calls.append("abort")
        self._aborted.set()

    def terminate(self) -> None:
        self.calls.append("terminate")

    def kill(self) -> None:
        self.calls.append("kill")

    def close(self) -> None:
        self.calls.append("close")


class FakeServer:
    port = 1

    def waiting_slots(self) -> set[tuple[str, int]]:
        return set()

    def registered_count(self) -> int:
        return 0

    def present_workers(self, roll: int) -> set[int]:
        return set()

    def call_roll(self) -> int:
        raise AssertionError("nobody waits to rejoin in these tests")

    def publish(self, slots: list[SlotInfo]) -> int:
        raise AssertionError("no generation is published in these tests")


Make = Callable[..., StartingAgent]


@pytest.fixture
def make_driver(monkeypatch: pytest.MonkeyPatch) -> Callable[[Make], ElasticDriver]:
    """Builds a driver of an elastic job on one host, h1, whose agents ``make`` makes."""

    def build(make: Make) -> ElasticDriver:
        hosts = [HostSpec("h1", 1)]
        options = ElasticOptions(min_np=1, max_np=None, discovery=FixedHosts(hosts))
        spec = JobSpec(
            command=["true"],
            num_proc=1,
            hosts=hosts,
            env={},
            cwd="/",
            launch=LaunchOptions(check_versions=False),
            elastic=options,
        )
        monkeypatch.setattr(elastic, "make_agent", make)
        sink = OutputSink(io.BytesIO(), io.BytesIO())
        server: object = FakeServer()
        driver = ElasticDriver(spec, options, sink, Signals(), server, "s", "job", hosts)  # type: ignore[arg-type]
        driver.poll_interval = 0.01
        return driver

    return build


def wait_for(condition: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def record(driver: ElasticDriver) -> HostRecord:
    host = driver.members.find("h1", None)
    assert host is not None
    return host


def test_the_main_loop_puts_the_agent_on_its_record_and_a_stop_cuts_its_start_short(
    make_driver: Callable[[Make], ElasticDriver],
) -> None:
    agent = StartingAgent("h1")
    driver = make_driver(lambda *args: agent)
    driver.step()  # starts h1's agent in a thread of its own
    wait_for(agent.started.is_set)
    host = record(driver)
    # The start thread made it and reported it, but left the record alone.
    assert host.agent is None and driver.events.qsize() == 1
    driver.step()
    assert host.agent is agent and host.agent_alive
    driver.stop_all()
    assert agent.calls == ["start", "abort"]
    assert host.agent_finished
    assert driver.finished()


def test_an_agent_made_after_the_stop_is_aborted_when_the_loop_hears_of_it(
    make_driver: Callable[[Make], ElasticDriver],
) -> None:
    agent = StartingAgent("h1")
    gate = threading.Event()

    def make(*args: object) -> StartingAgent:
        gate.wait(10)
        return agent

    driver = make_driver(make)
    driver.step()
    host = record(driver)
    driver.stop_all()  # the agent is still being made: nothing to stop yet
    assert driver.finished()
    gate.set()
    wait_for(agent.started.is_set)
    driver.step()  # AgentCreated: the job is stopping, so its start is cut short at once
    assert "abort" in agent.calls
    assert host.agent is agent and host.agent_finished


def test_an_agent_of_a_removed_host_is_aborted_when_the_loop_hears_of_it(
    make_driver: Callable[[Make], ElasticDriver],
) -> None:
    agent = StartingAgent("h1")
    gate = threading.Event()

    def make(*args: object) -> StartingAgent:
        gate.wait(10)
        return agent

    driver = make_driver(make)
    driver.step()
    assert record(driver).state == "starting"
    driver.members.discovered = []  # discovery no longer lists h1
    driver.step()
    driver.step()
    gate.set()
    wait_for(agent.started.is_set)
    driver.step()
    assert "abort" in agent.calls


def test_an_agent_made_after_the_loop_ended_is_aborted_by_its_start_thread(
    make_driver: Callable[[Make], ElasticDriver],
) -> None:
    agent = StartingAgent("h1")
    gate = threading.Event()

    def make(*args: object) -> StartingAgent:
        gate.wait(10)
        return agent

    driver = make_driver(make)
    driver.step()  # h1's agent is being made
    driver.signals.record(signal.SIGTERM)
    result = driver.run()  # stops at once: no agent is known yet
    assert result.interrupted_by == signal.SIGTERM
    gate.set()
    wait_for(lambda: "abort" in agent.calls, timeout=5)  # at once, not when start() gives up


def test_a_removed_hosts_old_agent_ending_late_leaves_its_new_agent_alone(
    make_driver: Callable[[Make], ElasticDriver],
) -> None:
    # Discovery removed h1 and listed it again: its old agent's Done let the driver start a
    # new agent there, and the old one's AgentExit came after. It was taken for the new
    # agent's loss: "host h1 failed (its agent was lost before its workers started);
    # blacklisted for the rest of the job".
    driver = make_driver(lambda *args: StartingAgent("h1"))
    old, new = cast(Any, StartingAgent("h1")), cast(Any, StartingAgent("h1"))
    gone = HostRecord(name="h1", slots=1, order=1, state="removed", agent=old)
    gone.agent_finished = True  # its Done came
    driver.members.retired.append(gone)
    current = driver.members.hosts["h1"] = HostRecord(name="h1", slots=1, order=2, agent=new)
    driver.on_event(HostEvent("h1", AgentExit(0, ""), old))
    assert current.state == "starting" and current.agent_alive
    assert not driver.members.blacklist.blocked("h1", time.monotonic())
    driver.on_event(HostEvent("h1", AgentExit(1, "lost"), new))  # its own agent's loss
    assert current.state == "failed"


def test_a_silent_host_that_was_waited_for_fails_with_its_whole_silence(
    make_driver: Callable[[Make], ElasticDriver],
) -> None:
    # Its workers trained on with the others while its agent was silent; when it fails at
    # last, the message said "for 5 s" (the first check's figure) after some 30 s.
    driver = make_driver(lambda *args: StartingAgent("h1"))
    agent = cast(Any, StartingAgent("h1"))
    host = driver.members.hosts["h1"] = HostRecord(
        name="h1", slots=1, order=1, state="running", agent=agent
    )
    host.workers = {0: 0}
    messages: list[str] = []
    driver.sink.message = messages.append  # type: ignore[method-assign,assignment]
    agent.last_heard = time.monotonic() - 5
    assert not driver.on_silent(agent, "heard nothing from its agent for 5 s")
    agent.last_heard = time.monotonic() - 40
    assert driver.on_silent(agent, "heard nothing from its agent for 5 s")
    assert "host h1 failed (heard nothing from its agent for 40 s)" in messages[-1], messages
