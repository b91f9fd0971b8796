"""A worker that is stopped (SIGSTOP, SIGTSTP, a debugger holding it) is named as the cause
when its peers' collectives time out waiting for it: the agent reports the stop, the fixed
supervisor names the stopped rank, the report says what stopped it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from launcher.agent.workers import HostAgent
from launcher.supervision.core import STOP_AFTERMATH_SECONDS, WorkerFailure
from launcher.supervision.fixed import Supervisor
from launcher.supervision.report import report_failure, summary_table
from launcher.transport.connection import HostEvent
from launcher.transport.protocol import (
    AgentEvent,
    AgentSpec,
    Continued,
    Exit,
    Stopped,
    WorkerLaunch,
    decode_event,
    encode_event,
)
from tests.launcher.test_supervision import Clock, FakeAgent, fixed, sink


def wait_status(pid: int, want: bool) -> None:
    """Until ``pid`` is stopped (``want``) or runs again (bounded: a stop is delivered at once)."""
    deadline = time.monotonic() + 10
    while (psutil.Process(pid).status() == psutil.STATUS_STOPPED) != want:
        assert time.monotonic() < deadline, f"pid {pid} never became stopped={want}"
        time.sleep(0.01)


def test_stop_events_travel_both_ways() -> None:
    for event in (Stopped(1, 42, signal.SIGTSTP), Stopped(2, 43, traced=True), Continued(1)):
        assert decode_event(encode_event(event)) == event


def test_the_agent_reports_a_worker_stopped_and_continued_once_each() -> None:
    events: list[AgentEvent] = []
    spec = AgentSpec("h", ["sleep", "60"], os.getcwd(), {}, [WorkerLaunch(0, {})], term_grace=1)
    agent = HostAgent(spec, os.environ, events.append)
    agent.start()
    pid = agent.workers[0].proc.pid
    try:
        agent.check_stops(force=True)
        os.kill(pid, signal.SIGSTOP)
        wait_status(pid, True)
        agent.check_stops(force=True)
        agent.check_stops(force=True)  # (still stopped: said once)
        os.kill(pid, signal.SIGCONT)
        wait_status(pid, False)
        agent.check_stops(force=True)
    finally:
        agent.terminate()
    stops = [event for event in events if isinstance(event, (Stopped, Continued))]
    assert stops == [Stopped(0, pid, signal.SIGSTOP), Continued(0)]


def test_a_failure_while_a_rank_is_stopped_names_the_stopped_rank() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    supervisor, _, _ = fixed(a, b, clock=clock)
    put(supervisor, "b", Stopped(3, 4242, signal.SIGSTOP))
    supervisor.step()
    clock.now += 30  # (the peers' collectives time out)
    put(supervisor, "a", Exit(0, 1))
    supervisor.step()
    failure = supervisor.result.failure
    assert failure is not None and (failure.rank, failure.hostname, failure.code) == (3, "b", 1)
    assert supervisor.result.exit_code == 1  # the first exit's, as mpirun's
    assert a.calls == b.calls == ["terminate"]
    put(supervisor, "b", Continued(3))  # (hvdrun's stop continues it)
    put(supervisor, "a", Exit(1, 143))
    put(supervisor, "b", Exit(2, 143), Exit(3, 143))
    supervisor.step()

    output, _, err = sink()
    output.line(0, "stderr", b"HorovodInternalError: a collective failed")
    report_failure(supervisor.result, output)
    said = err.getvalue().decode()
    assert (
        "hvdrun: rank 3 on host b failed first: it was stopped by SIGSTOP (pid 4242) and never "
        "continued; its peers' collectives timed out waiting for it (rank 0 exited first, with "
        "exit code 1)\n"
    ) in said
    assert "last lines of rank 0's stderr (it exited first):" in said
    table = summary_table(supervisor.result, output, supervisor.result.hosts)
    assert table[4].split(None, 3)[:3] == ["3", "b", "143"]
    assert table[4].split(None, 3)[3].split("  ")[0] == "FAILED FIRST (SIGSTOP)"
    assert table[4].endswith("(stopped, never continued)")


def test_a_rank_stopped_and_continued_before_anything_failed_is_not_blamed() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    supervisor, _, err = fixed(a, b, clock=clock)
    put(supervisor, "b", Stopped(3, 4242, signal.SIGTSTP), Continued(3))
    supervisor.step()
    # said at once, while the job goes on
    assert err.getvalue().decode().splitlines() == [
        "hvdrun: rank 3 on b was stopped by SIGTSTP (pid 4242): the other ranks' collectives "
        "wait for it, and time out unless it is continued",
        "hvdrun: rank 3 on b was continued",
    ]
    clock.now += STOP_AFTERMATH_SECONDS
    put(supervisor, "a", Exit(0, 1))
    supervisor.step()
    assert supervisor.result.failure == WorkerFailure(0, "a", 1, None)


def test_a_rank_continued_just_before_its_peer_failed_is_still_named() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    supervisor, _, _ = fixed(a, b, clock=clock)
    put(supervisor, "b", Stopped(2, 4242, traced=True))
    supervisor.step()
    clock.now += 30
    put(supervisor, "b", Continued(2))
    supervisor.step()
    put(supervisor, "a", Exit(1, 1))
    supervisor.step()
    failure = supervisor.result.failure
    assert (
        failure is not None
        and failure.rank == 2
        and failure.error
        == (
            "it was stopped by a debugger (ptrace, pid 4242) for 30.0 s, continued only just "
            "before its peers failed; their collectives had timed out waiting for it (rank 1 "
            "exited first, with exit code 1)"
        )
    )


def test_a_stopped_rank_killed_outright_is_its_own_failure() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    supervisor, _, _ = fixed(a, b)
    put(supervisor, "b", Stopped(3, 4242, signal.SIGSTOP))
    put(supervisor, "b", Exit(3, 137))
    supervisor.step()
    assert supervisor.result.failure == WorkerFailure(3, "b", 137, None)


def put(supervisor: Supervisor, host: str, *events: Exit | Stopped | Continued) -> None:
    for event in events:
        supervisor.events.put(HostEvent(host, event))


def failure_after_a_stop(seconds: float) -> WorkerFailure | None:
    """Rank 3 is held by a debugger; rank 0 exits 1 ``seconds`` later (the workers'
    collectives would have waited 30 s for rank 3)."""
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    supervisor, _, _ = fixed(a, b, clock=clock)
    supervisor.stop_blame_after = 15.0
    put(supervisor, "b", Stopped(3, 4242, None, traced=True))
    supervisor.step()
    clock.now += seconds
    put(supervisor, "a", Exit(0, 1))
    supervisor.step()
    return supervisor.result.failure


def test_a_failure_soon_after_a_stop_is_its_own() -> None:
    # one second later, nothing timed out waiting for rank 3: rank 0 failed for its own reasons
    assert failure_after_a_stop(1.0) == WorkerFailure(0, "a", 1, None)
    # a stop longer than half the timeout is the cause
    failure = failure_after_a_stop(16.0)
    assert failure is not None and failure.rank == 3


def test_a_job_whose_rank_stops_itself_names_it(tmp_path: Path) -> None:
    """End to end, torch-free: rank 1 stops itself; rank 0 exits 1 a little later, as a
    rank whose collective timed out waiting for it would."""
    script = tmp_path / "stops.py"
    script.write_text(
        "import os, pathlib, signal, sys, time\n"
        "import psutil\n"
        f"mark = pathlib.Path({str(tmp_path / 'pid')!r})\n"
        "if os.environ['HVDRUN_RANK'] == '1':\n"
        "    mark.write_text(str(os.getpid()))\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    time.sleep(60)\n"
        "while not mark.exists() or mark.read_text() == '':\n"
        "    time.sleep(0.05)\n"
        "peer = psutil.Process(int(mark.read_text()))\n"
        "while peer.status() != psutil.STATUS_STOPPED:\n"
        "    time.sleep(0.05)\n"
        "time.sleep(2.0)  # (the agent looks twice a second)\n"
        "print('collective timed out', file=sys.stderr, flush=True)\n"
        "sys.exit(1)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "hvdrun", "-np", "2", "--no-report", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        # (the collectives' timeout: a stop counts as the cause after half of it)
        env={**os.environ, "HVDRUN_GLOO_TIMEOUT_SECONDS": "2"},
    )
    pid = (tmp_path / "pid").read_text()
    assert result.returncode == 1, result.stderr
    assert (
        f"rank 1 on host localhost failed first: it was stopped by SIGSTOP (pid {pid}) and "
        "never continued"
    ) in result.stderr, result.stderr
    assert not psutil.pid_exists(int(pid)) or (
        psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
    )


def test_a_stop_told_again_keeps_its_start_and_is_said_once() -> None:
    a, b = FakeAgent("a"), FakeAgent("b")
    clock = Clock()
    supervisor, _, err = fixed(a, b, clock=clock)
    supervisor.stop_blame_after = 15.0
    put(supervisor, "b", Stopped(3, 4242, None))
    supervisor.step()
    clock.now += 10.0
    put(supervisor, "b", Stopped(3, 4242, signal.SIGSTOP))  # (its signal read only now)
    supervisor.step()
    clock.now += 10.0
    put(supervisor, "a", Exit(0, 1))
    supervisor.step()
    assert err.getvalue().decode().count("was stopped by") == 1
    assert supervisor.result.failure is not None and supervisor.result.failure.rank == 3


def test_the_stopped_worker_among_some_is_one_stopped_now() -> None:
    # (an elastic host that fails for not rejoining names its own stopped worker, not one of
    # an earlier host of that name, nor one continued since)
    a, b = FakeAgent("a"), FakeAgent("b")
    supervisor, _, _ = fixed(a, b, clock=Clock())
    put(supervisor, "b", Stopped(3, 4242, signal.SIGSTOP), Stopped(5, 4343, signal.SIGTSTP))
    supervisor.step()
    stop = supervisor.stopped_among([2, 3])
    assert stop is not None and (stop.rank, stop.pid) == (3, 4242)
    assert supervisor.stopped_among([2, 4]) is None
    put(supervisor, "b", Continued(3))
    supervisor.step()
    assert supervisor.stopped_among([2, 3]) is None
    stop = supervisor.stopped_among([3, 5])
    assert stop is not None and stop.rank == 5
