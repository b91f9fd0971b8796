"""The agent's side of the protocol, driven directly through its stdin and stdout."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from launcher.agent.session import Emitter
from launcher.agent.workers import REAP_INTERVAL, HostAgent
from launcher.transport.protocol import (
    PROTOCOL_VERSION,
    AgentSpec,
    Exit,
    KillRequest,
    Lines,
    Output,
    PrepareRequest,
    ProbeRequest,
    ReachRequest,
    RunRequest,
    SignalRequest,
    TerminateRequest,
    WorkerLaunch,
    decode_event,
    encode,
    encode_request,
)
from rendezvous.addresses import split_addr

AGENT = [sys.executable, "-m", "launcher.agent"]


class Agent:
    """``python -m launcher.agent`` with its events read back one at a time; a run of whole
    lines (a ``lines`` event) reads as the ``out`` event each of its lines would be."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            AGENT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        self._lines: list[dict[str, Any]] = []

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def event(self) -> dict[str, Any]:
        if self._lines:
            return self._lines.pop(0)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the agent closed its stdout"
        event: dict[str, Any] = json.loads(line)
        if event["ev"] != "lines":
            return event
        place = {"rank": event["rank"], "stream": event["stream"]}
        assert event["data"].endswith("\n"), event
        self._lines = [
            {"ev": "out", **place, "data": text} for text in event["data"][:-1].split("\n")
        ]
        return self._lines.pop(0)

    def events_until_done(self) -> list[dict[str, Any]]:
        events = []
        while not events or events[-1]["ev"] != "done":
            events.append(self.event())
        return events

    def close(self) -> tuple[int, str]:
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        code = self.proc.wait(timeout=30)
        return code, self.proc.stderr.read().decode()


def spec(code: str, ranks: int = 1, **fields: Any) -> AgentSpec:
    return AgentSpec(
        hostname="localhost",
        command=[sys.executable, "-c", code],
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"},
        workers=[WorkerLaunch(rank=r, env={"HVDRUN_RANK": str(r)}) for r in range(ranks)],
        rendezvous_addr="127.0.0.1:29999",
        **fields,
    )


def test_hello_comes_first_with_versions() -> None:
    from importlib import metadata

    agent = Agent()
    hello = agent.event()
    assert hello["ev"] == "hello"
    assert hello["protocol"] == PROTOCOL_VERSION
    assert "node" not in hello  # only agents of an srun step name their Slurm node
    assert hello["python"] == ".".join(map(str, sys.version_info[:3]))
    assert hello["executable"] == sys.executable
    assert hello["torch"] == metadata.version("torch")
    assert hello["hvdrun"] == metadata.version("hvdrun")
    assert agent.close() == (0, "")  # end of file before any request: just leave


def test_run_picks_the_interface_facing_the_rendezvous() -> None:
    agent = Agent()
    agent.event()
    code = "import os; print(os.environ['GLOO_SOCKET_IFNAME'], os.environ['NCCL_SOCKET_IFNAME'])"
    agent.send(encode_request(RunRequest(spec(code))))
    events = agent.events_until_done()
    assert events[0] == {"ev": "network", "ifname": "lo", "address": "127.0.0.1"}
    assert {"ev": "out", "rank": 0, "stream": "stdout", "data": "lo lo"} in events
    assert {"ev": "exit", "rank": 0, "code": 0} in events
    agent.close()


def test_prepare_picks_the_address_facing_the_rendezvous_and_a_free_port() -> None:
    import socket

    agent = Agent()
    agent.event()
    agent.send(encode_request(PrepareRequest("127.0.0.1:29999")))
    prepared = agent.event()
    assert prepared["ev"] == "prepared" and prepared["address"] == "127.0.0.1"
    with socket.socket() as listener:  # torch's store can bind it on every interface
        listener.bind(("0.0.0.0", prepared["port"]))
    agent.send(encode_request(RunRequest(spec("print('ran')"))))  # then the job as usual
    assert {"ev": "out", "rank": 0, "stream": "stdout", "data": "ran"} in agent.events_until_done()
    agent.close()


def test_interface_set_by_the_user_is_kept() -> None:
    agent = Agent()
    agent.event()
    job = spec("import os; print(os.environ['GLOO_SOCKET_IFNAME'])")
    job.env["GLOO_SOCKET_IFNAME"] = "eth7"
    agent.send(encode_request(RunRequest(job)))
    assert {"ev": "out", "rank": 0, "stream": "stdout", "data": "eth7"} in agent.events_until_done()
    agent.close()


@pytest.mark.parametrize(("timeout", "lost_after", "said"), [(0.6, 0.0, 0.6), (30.0, 0.6, 0.6)])
def test_silence_from_hvdrun_stops_the_workers(
    timeout: float, lost_after: float, said: float
) -> None:
    # (--heartbeat-timeout shorter than --agent-timeout: the shorter one counts)
    agent = Agent()
    agent.event()
    job = spec("import time; time.sleep(60)", ranks=2, heartbeat_timeout=timeout)
    job.lost_after = lost_after
    agent.send(encode_request(RunRequest(job)))
    start = time.monotonic()
    events = agent.events_until_done()
    assert time.monotonic() - start < 10
    exits = [e for e in events if e["ev"] == "exit"]
    assert {e["code"] for e in exits} == {143}
    # (each exit says why: hvdrun, once it hears again, names the cause, not a SIGTERM)
    why = f"it heard nothing from hvdrun for over {said:g} s (hvdrun stopped or starved of CPU"
    assert all(e["error"].startswith(f"stopped by its host's agent: {why}") for e in exits)
    if timeout < 1:
        assert {"ev": "ping"} in events  # it told hvdrun it was alive meanwhile
    _, stderr = agent.close()
    assert f"stopping workers: {why}" in stderr


def test_workers_stopped_at_hvdrun_s_request_exit_without_a_reason() -> None:
    agent = Agent()
    agent.event()
    agent.send(encode_request(RunRequest(spec("import time; time.sleep(60)", ranks=2))))
    assert agent.event()["ev"] == "network"
    agent.event(), agent.event()  # (both started)
    agent.send(encode_request(TerminateRequest()))
    exits = [e for e in agent.events_until_done() if e["ev"] == "exit"]
    assert [e["code"] for e in exits] == [143, 143]
    assert not [e for e in exits if e.get("error")], exits
    agent.close()


@pytest.mark.parametrize("how", ["signal", "request"])
def test_a_signal_from_outside_is_reported_to_hvdrun(how: str) -> None:
    # (scancel, a time limit: hvdrun must tell the job's end from a worker's own failure;
    # a stop it asked for itself is not reported so)
    agent = Agent()
    agent.event()
    agent.send(encode_request(RunRequest(spec("print('ready'); import time; time.sleep(60)"))))
    while agent.event().get("data") != "ready":
        pass
    if how == "signal":
        agent.proc.send_signal(signal.SIGTERM)
    else:
        agent.send(encode_request(TerminateRequest()))
    events = agent.events_until_done()
    assert {"ev": "exit", "rank": 0, "code": 143} in events
    signalled = [e for e in events if e["ev"] == "signalled"]
    assert signalled == ([{"ev": "signalled", "signum": 15}] if how == "signal" else [])
    agent.close()


def stubborn_worker() -> Agent:
    """An agent running one worker that ignores SIGTERM (a grace period of 60 s), ready."""
    agent = Agent()
    agent.event()
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready'); time.sleep(60)"
    )
    agent.send(encode_request(RunRequest(spec(stubborn, term_grace=60))))
    while agent.event().get("data") != "ready":
        pass
    return agent


def test_a_stop_is_answered_at_once_while_the_workers_take_their_grace() -> None:
    # hvdrun tells a cut-off host (no answer) from workers slow to stop (an answer, then
    # their exits within the grace period) by this answer.
    agent = stubborn_worker()
    start = time.monotonic()
    agent.send(encode_request(TerminateRequest()))
    assert agent.event() == {"ev": "stopping"}
    assert time.monotonic() - start < 3
    agent.send(encode_request(KillRequest()))
    assert {"ev": "exit", "rank": 0, "code": 137} in agent.events_until_done()
    agent.close()


@pytest.mark.parametrize("terminated_first", [False, True])
def test_kill_skips_the_grace_period(terminated_first: bool) -> None:
    # A kill request at once, or during the grace period of a stop (hvdrun's second
    # Ctrl-C while the workers ignore the first one's SIGTERM).
    agent = stubborn_worker()
    if terminated_first:
        agent.send(encode_request(TerminateRequest()))
        time.sleep(0.3)
    start = time.monotonic()
    agent.send(encode_request(KillRequest()))
    events = agent.events_until_done()
    assert time.monotonic() - start < 5
    assert {"ev": "exit", "rank": 0, "code": 137} in events
    agent.close()


def test_a_stop_while_workers_start_skips_the_ones_not_started_yet() -> None:
    agent = Agent()
    agent.event()
    many = spec("", ranks=400)
    many.command = ["sleep", "60"]
    agent.send(encode_request(RunRequest(many)))
    assert agent.event()["ev"] == "network"
    assert agent.event()["ev"] == "started"
    agent.send(encode_request(TerminateRequest()))
    events = agent.events_until_done()
    started = [e for e in events if e["ev"] == "started"]
    exits = [e for e in events if e["ev"] == "exit"]
    # Every rank is reported stopped; the ones not started by then never start.
    assert sorted(e["rank"] for e in exits) == list(range(400))
    assert {e["code"] for e in exits} == {143}
    assert len(started) < 399, len(started)
    agent.close()


def test_a_stop_before_the_job_is_answered_with_done() -> None:
    # (an elastic host that was ready when the job stopped; a forwarded signal before it)
    agent = Agent()
    agent.event()
    agent.send(encode_request(SignalRequest(signal.SIGUSR1)))
    agent.send(encode_request(TerminateRequest()))
    assert agent.event()["ev"] == "done"
    code, stderr = agent.close()
    assert (code, stderr) == (0, "")


def test_a_mesh_probe_listens_where_gloo_would_until_hvdrun_is_done() -> None:
    # --check-hosts with several hosts: each agent listens on its Gloo address, tries the
    # others' when asked, and keeps listening until hvdrun has heard from every host.
    back = socket.socket()
    back.bind(("127.0.0.1", 0))
    back.listen(4)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # (bound, not listening: refused)
    agent = Agent()
    agent.event()
    connect_back = f"127.0.0.1:{back.getsockname()[1]}"
    agent.send(encode_request(ProbeRequest(connect_back, (), mesh=True)))
    facts = agent.event()
    assert facts["ev"] == "probe" and facts["connect_back_error"] is None, facts
    listen = facts["gloo_listen"]
    assert listen.startswith("127.0.0.1:"), facts
    refused = f"127.0.0.1:{closed.getsockname()[1]}"
    agent.send(encode_request(ReachRequest({"itself": listen, "nobody": refused})))
    reached = agent.event()
    assert reached == {
        "ev": "reached",
        "results": {"itself": None, "nobody": f"cannot connect to {refused}: Connection refused"},
    }
    socket.create_connection(split_addr(listen), timeout=5).close()  # still listening
    code, _ = agent.close()
    assert code == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(split_addr(listen), timeout=5)
    back.close()
    closed.close()


def test_unknown_request_is_refused() -> None:
    agent = Agent()
    agent.event()
    agent.send(encode({"op": "dance"}))
    code, stderr = agent.close()
    assert code == 2
    assert "unexpected request 'dance'" in stderr


def test_the_agent_starts_without_paramiko_grpc_or_torch() -> None:
    code = (
        "import sys\n"
        "import launcher.agent.__main__, launcher.agent.probe\n"
        "print(sorted(m for m in ('paramiko', 'grpc', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout == "[]\n", result.stderr


def test_omp_num_threads_default_shares_the_hosts_cores(monkeypatch: Any) -> None:
    from launcher.agent import session

    monkeypatch.setattr(session, "host_cores", lambda: 8)
    env: dict[str, str] = {}
    session.omp_default(env, 3)
    assert env["OMP_NUM_THREADS"] == "2"
    env = {}
    session.omp_default(env, 16)  # more workers than cores: one thread each
    assert env["OMP_NUM_THREADS"] == "1"
    env = {"OMP_NUM_THREADS": "5"}
    session.omp_default(env, 2)  # the job's own setting stays
    assert env["OMP_NUM_THREADS"] == "5"


def test_each_process_of_a_worker_tree_gets_a_signal_once() -> None:
    """The worker's group gets the signal, then only the processes that left it: a worker's
    SIGTERM handler must not run twice (the second call cut the first's cleanup short).
    Counted with a real-time signal, which the kernel queues where SIGTERMs would merge."""
    import psutil

    from launcher.agent.workers import signal_tree

    rt = signal.SIGRTMIN
    counter = (
        "import signal, sys, time\n"
        f"signal.pthread_sigmask(signal.SIG_BLOCK, [{int(rt)}])\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "n = 0\n"
        f"while signal.sigtimedwait([{int(rt)}], 0.2) is not None: n += 1\n"
        "print(n, flush=True)\n"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", counter],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    left = subprocess.Popen(  # a process of the tree in a session of its own
        [sys.executable, "-c", counter],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    procs = [leader, left]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        signal_tree(leader.pid, [psutil.Process(p.pid) for p in procs], rt)
        counts = [proc.communicate("\n", timeout=10)[0].strip() for proc in procs]
        assert counts == ["1", "1"]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_hvdruns_usr1_reaches_each_worker_once_and_one_sent_to_the_agent_does_not_kill_it() -> None:
    """hvdrun forwards SIGUSR1 as a request: each worker gets it once. One sent to the
    agent itself (Slurm signals every process of a step, the workers too) is not passed on
    again, and does not kill the agent."""
    agent = Agent()
    agent.event()
    agent.proc.send_signal(signal.SIGUSR1)  # (before any job: a held-back elastic host)
    counting = (
        "import signal, time; got = []; "
        "signal.signal(signal.SIGUSR1, lambda *_: got.append(1)); print('ready'); "
        "deadline = time.monotonic() + 20\n"
        "while not got and time.monotonic() < deadline: time.sleep(0.05)\n"
        "time.sleep(0.5); print(len(got))"
    )
    agent.send(encode_request(RunRequest(spec(counting, ranks=2))))
    ready = 0
    while ready < 2:
        ready += agent.event().get("data") == "ready"
    agent.proc.send_signal(signal.SIGUSR1)
    time.sleep(0.3)
    agent.send(encode_request(SignalRequest(signal.SIGUSR1)))
    events = agent.events_until_done()
    said = sorted(e["data"] for e in events if e["ev"] == "out")
    assert said == ["1", "1"], events
    assert agent.close()[0] == 0


def test_a_stopped_worker_is_continued_to_run_its_sigterm_handler() -> None:
    """A worker stopped by SIGSTOP (a hang, Ctrl-Z) holds SIGTERM pending until it runs
    again: the agent continues it, as mpirun and Slurm do, so it exits through its handler
    at once instead of being SIGKILLed at the end of the grace period."""
    agent = Agent()
    agent.event()
    stops = (
        "import os, signal, sys\n"
        "def bye(*_):\n"
        "    print('handler ran', flush=True)\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSTOP)\n"
        "signal.pause()\n"
    )
    agent.send(encode_request(RunRequest(spec(stops, term_grace=30))))
    while agent.event().get("data") != "ready":
        pass
    time.sleep(0.3)  # (it stops itself)
    start = time.monotonic()
    agent.send(encode_request(TerminateRequest()))
    events = agent.events_until_done()
    assert {"ev": "exit", "rank": 0, "code": 143} in events, events
    assert any(event.get("data") == "handler ran" for event in events), events
    assert time.monotonic() - start < 15
    agent.close()


def test_what_a_worker_left_outside_its_process_group_ends_with_the_host_s_workers(
    tmp_path: Path,
) -> None:
    # A child in a session of its own outlives its worker's process group; the agent adopts
    # it and stops it (SIGTERM first) once the host's workers have exited. A grandchild
    # whose parent exits meanwhile is adopted too, and reaped when it exits (no zombie).
    agent = Agent()
    agent.event()
    said = tmp_path / "said"
    kept = f"trap 'echo terminated > {said}; exit 0' TERM; while :; do sleep 0.1; done"
    code = (
        "import subprocess, time\n"
        f"kept = subprocess.Popen(['sh', '-c', {kept!r}], start_new_session=True)\n"
        "subprocess.run(['sh', '-c', 'sleep 0.3 & echo $!'])\n"
        "print('kept', kept.pid, flush=True)\n"
        f"time.sleep({REAP_INTERVAL + 2.5})\n"
    )
    agent.send(encode_request(RunRequest(spec(code))))
    events = []
    while not str(events[-1].get("data", "") if events else "").startswith("kept"):
        events.append(agent.event())
    short = int(next(e["data"] for e in events if str(e.get("data", "")).isdigit()))
    kept_pid = int(str(events[-1]["data"]).split()[1])
    time.sleep(REAP_INTERVAL + 1.0)  # (the short one exited and was reaped meanwhile)
    assert not psutil.pid_exists(short)
    events += agent.events_until_done()
    assert {"ev": "exit", "rank": 0, "code": 0} in events
    assert not psutil.pid_exists(kept_pid)  # (ended and reaped before the agent said done)
    assert said.read_text() == "terminated\n"
    agent.close()


def test_the_lines_of_one_read_leave_the_agent_in_one_write() -> None:
    """A worker's burst of lines (what one read of its pipe gets) goes to hvdrun as one
    ``lines`` event in one write, not an event, a write and a flush per line."""

    class Counted(io.BytesIO):
        writes = 0

        def write(self, data: bytes) -> int:  # type: ignore[override]
            self.writes += 1
            return super().write(data)

    stream = Counted()
    script = "import os; os.write(1, b''.join(b'line %d\\n' % i for i in range(1000)))"
    spec = AgentSpec("h", [sys.executable, "-c", script], os.getcwd(), {}, [WorkerLaunch(0, {})])
    agent = HostAgent(spec, os.environ, Emitter(stream))
    agent.start()
    assert agent.wait(timeout=30)
    events = [decode_event(line) for line in stream.getvalue().splitlines()]
    written = b"".join(event.data for event in events if isinstance(event, Lines))
    assert written == b"".join(b"line %d\n" % i for i in range(1000))
    assert not any(isinstance(event, Output) for event in events)
    assert stream.writes < 10, stream.writes  # (started, the lines, the exit)


@pytest.mark.parametrize(
    ("name", "hint"),
    [("train.py", "run it as python train.py"), ("run.sh", "run it as ./run.sh"), ("none", None)],
)
def test_a_bare_name_of_a_file_in_the_working_directory_gets_the_hint(
    tmp_path: Path, name: str, hint: str | None
) -> None:
    """A remote host's worker cannot run ``train.py`` (a bare name: no shell looks in the
    working directory for it). hvdrun checks the command before a local job only, so the
    agent's error says how to run it, as hvdrun's own check does."""
    if name != "none":
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    events: list[Any] = []
    spec = AgentSpec("h", [name], str(tmp_path), {}, [WorkerLaunch(0, {})])
    HostAgent(spec, {"PATH": "/usr/bin:/bin"}, events.append).start()
    exits = [event for event in events if isinstance(event, Exit)]
    said = f"cannot run {name!r}: No such file or directory"
    if hint is not None:
        said += f" (a file in the working directory: {hint})"
    assert exits == [Exit(0, 127, said)]
