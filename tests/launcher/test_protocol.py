"""The wire protocol: typed requests and events, and the exact lines they travel as."""

from __future__ import annotations

import pytest

from launcher.transport.protocol import (
    PIECE_BYTES,
    AgentEvent,
    AgentSpec,
    Done,
    Exit,
    Hello,
    Joiner,
    KillRequest,
    Lines,
    Network,
    Output,
    Ping,
    PingRequest,
    Prepared,
    PrepareRequest,
    Probe,
    ProbeRequest,
    Reached,
    ReachRequest,
    RunRequest,
    Signalled,
    SignalRequest,
    Started,
    Stopping,
    TerminateRequest,
    UnknownRequest,
    WorkerLaunch,
    decode_event,
    decode_request,
    encode_event,
    encode_request,
    pieces,
)

EVENT_LINES = [
    (
        Hello(1, "node1", 42, "3.11.7", "/usr/bin/python3", "0.1.0", "2.13.0"),
        b'{"ev": "hello", "protocol": 1, "hostname": "node1", "pid": 42, "python": "3.11.7", '
        b'"executable": "/usr/bin/python3", "hvdrun": "0.1.0", "torch": "2.13.0"}\n',
    ),
    (
        Hello(2, "n1", 7, node="hvdh1", task=0, step="12.3"),
        b'{"ev": "hello", "protocol": 2, "hostname": "n1", "pid": 7, "python": null, '
        b'"executable": null, "hvdrun": null, "torch": null, "node": "hvdh1", "task": 0, '
        b'"step": "12.3"}\n',
    ),
    (Prepared("10.0.0.2", 29500), b'{"ev": "prepared", "address": "10.0.0.2", "port": 29500}\n'),
    (
        Network("eth0", "10.0.0.2"),
        b'{"ev": "network", "ifname": "eth0", "address": "10.0.0.2"}\n',
    ),
    (Started(3, 1234), b'{"ev": "started", "rank": 3, "pid": 1234}\n'),
    (
        Output(0, "stderr", b"caf\xc3\xa9 \xff"),
        b'{"ev": "out", "rank": 0, "stream": "stderr", "data": "caf\\u00e9 \\udcff"}\n',
    ),
    (  # (a progress bar's carriage return, kept for --output-filename's files)
        Output(1, "stdout", b"50%", b"\r"),
        b'{"ev": "out", "rank": 1, "stream": "stdout", "data": "50%", "end": "\\r"}\n',
    ),
    (
        Output(1, "stdout", b"", b"\n", shown=False),
        b'{"ev": "out", "rank": 1, "stream": "stdout", "data": "", "shown": false}\n',
    ),
    (  # (a run of whole lines, as one read got them)
        Lines(2, "stdout", b"one\ncaf\xc3\xa9 \xff\n"),
        b'{"ev": "lines", "rank": 2, "stream": "stdout", "data": "one\\ncaf\\u00e9 \\udcff\\n"}\n',
    ),
    (Exit(1, 137), b'{"ev": "exit", "rank": 1, "code": 137}\n'),
    (
        Exit(2, 127, "cannot run 'x'"),
        b'{"ev": "exit", "rank": 2, "code": 127, "error": "cannot run \'x\'"}\n',
    ),
    (Signalled(15), b'{"ev": "signalled", "signum": 15}\n'),
    (Stopping(), b'{"ev": "stopping"}\n'),
    (Ping(), b'{"ev": "ping"}\n'),
    (Probe({"hostname": "n", "gpus": []}), b'{"ev": "probe", "hostname": "n", "gpus": []}\n'),
    (
        Reached({"n1": None, "n2": "timed out"}),
        b'{"ev": "reached", "results": {"n1": null, "n2": "timed out"}}\n',
    ),
    (Done(), b'{"ev": "done"}\n'),
]


@pytest.mark.parametrize(("event", "line"), EVENT_LINES)
def test_events_travel_as_the_same_lines_and_come_back(event: AgentEvent, line: bytes) -> None:
    assert encode_event(event) == line
    assert decode_event(line) == event


def test_an_old_agents_hello_decodes_with_what_it_has() -> None:
    assert decode_event(b'{"ev": "hello", "protocol": 0, "extra": 1}\n') == Hello(protocol=0)


def test_unknown_event_kinds_are_skipped_and_broken_ones_refused() -> None:
    assert decode_event(b'{"ev": "from-the-future", "x": 1}\n') is None
    for line in (b"[1, 2]\n", b'{"rank": 1}\n', b'{"ev": "exit", "rank": 1}\n', b"{oops\n"):
        with pytest.raises(ValueError):
            decode_event(line)


def test_requests_travel_as_the_same_lines_and_come_back() -> None:
    spec = AgentSpec("h", ["python", "t.py"], "/w", {"A": "1"}, [WorkerLaunch(0, {"R": "0"})])
    run = encode_request(RunRequest(spec))
    assert run.startswith(b'{"op": "run", "spec": {"hostname": "h", "command": ["python"')
    assert decode_request(run) == RunRequest(spec)
    probe = ProbeRequest("10.0.0.1:5000", ("10.0.0.2",))
    line = b'{"op": "probe", "connect_back": "10.0.0.1:5000", "peers": ["10.0.0.2"]}\n'
    assert encode_request(probe) == line
    assert decode_request(line) == probe
    for request, line in (
        (PingRequest(), b'{"op": "ping"}\n'),
        (TerminateRequest(), b'{"op": "terminate"}\n'),
        (KillRequest(), b'{"op": "kill"}\n'),
        (
            PrepareRequest("10.0.0.1:5000", ("10.0.0.2", "fd00::3")),
            b'{"op": "prepare", "rendezvous_addr": "10.0.0.1:5000", '
            b'"peers": ["10.0.0.2", "fd00::3"]}\n',
        ),
        (SignalRequest(10), b'{"op": "signal", "signum": 10}\n'),
        (
            ProbeRequest("10.0.0.1:5000", (), mesh=True),
            b'{"op": "probe", "connect_back": "10.0.0.1:5000", "peers": [], "mesh": true}\n',
        ),
        (
            ReachRequest({"n2": "10.0.0.2:4000"}),
            b'{"op": "reach", "targets": {"n2": "10.0.0.2:4000"}}\n',
        ),
        (UnknownRequest("dance"), b'{"op": "dance"}\n'),
    ):
        assert encode_request(request) == line
        assert decode_request(line) == request
    # an older hvdrun's requests name no peers
    older = b'{"op": "prepare", "rendezvous_addr": "10.0.0.1:5000"}\n'
    assert decode_request(older) == PrepareRequest("10.0.0.1:5000", ())
    older = b'{"op": "probe", "connect_back": "10.0.0.1:5000"}\n'
    assert decode_request(older) == ProbeRequest("10.0.0.1:5000", ())


def test_broken_requests_are_refused() -> None:
    for line in (b'{"ev": "ping"}\n', b'{"op": "run", "spec": {"hostname": "h"}}\n', b"x\n"):
        with pytest.raises(ValueError):
            decode_request(line)


def test_an_agent_of_an_srun_step_reads_only_its_own_lines_of_the_shared_stdin() -> None:
    import io

    from launcher.agent.session import AddressedStdin

    shared = io.BytesIO(b'0 {"op": "ping"}\n1 {"op": "kill"}\n* {"op": "terminate"}\n1 EOF\n0 x\n')
    mine = AddressedStdin(shared, 1)
    assert mine.readline() == b'{"op": "kill"}\n'
    assert mine.readline() == b'{"op": "terminate"}\n'
    assert mine.readline() == b""  # its own end of file, while task 0 still reads on
    assert mine.readline() == b""
    task0 = AddressedStdin(io.BytesIO(b'0 {"op": "ping"}\n'), 0)
    assert task0.readline() == b'{"op": "ping"}\n'
    assert task0.readline() == b""  # srun's stdin closed


def test_long_event_lines_go_as_pieces_srun_keeps_whole_and_join_back() -> None:
    # srun --label cuts a task's line into 1024-byte pieces and labels each as a line: an
    # agent under srun writes a long event as marked pieces of at most PIECE_BYTES.
    event = Output(0, "stdout", ("█" * 400 + "y" * 3000 + "\n").encode())
    line = encode_event(event)
    parts = pieces(line)
    assert len(parts) > 1 and all(len(p) <= PIECE_BYTES and p.endswith(b"\n") for p in parts)
    joiner = Joiner()
    assert [joiner.feed(p) for p in parts[:-1]] == [None] * (len(parts) - 1)
    whole = joiner.feed(parts[-1])
    assert whole == line and decode_event(whole) == event
    # short lines (and the exit marker) pass as they are, before and after a long one
    short = encode_event(Output(1, "stderr", b"x\n"))
    assert pieces(short) == [short]
    assert joiner.feed(short) == short and joiner.feed(b"hvdrun-agent-exit 0\n") is not None
