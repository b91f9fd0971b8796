"""The wire protocol between hvdrun and a host's agent (a local pipe or an SSH channel).

The agent speaks first, as soon as it starts, with one event::

    {"ev": "hello", "protocol": 1, "python": "3.11.7", "hvdrun": "0.1.0", "torch": "2.13.0", ...}

so hvdrun can refuse hosts whose installation differs before any worker starts; anything on
stdout before it is not the agent's (what a remote login shell printed: :func:`find_hello`)
and is skipped. hvdrun then writes one JSON line per request to the agent's stdin:

* ``{"op": "run", "spec": AgentSpec}`` - command, working directory, environment, the host's
  ranks and with them the job secret, which therefore never appears in any process's argv
* ``{"op": "probe", "connect_back": "ADDR:PORT", "peers": [...], "mesh": true?}`` - describe
  the host (``--check-hosts``); with ``mesh``, also listen where its ranks' Gloo would and
  wait for ``{"op": "reach", "targets": {HOST: "ADDR:PORT"}}``: try the other hosts' listeners
* ``{"op": "prepare", "rendezvous_addr": "ADDR:PORT"}`` - before ``run``, on rank 0's host:
  pick the ``MASTER_ADDR``/``MASTER_PORT`` of plain torch.distributed scripts there
* ``{"op": "ping"}`` - hvdrun is alive (remote hosts; see ``AgentSpec.heartbeat_timeout``)
* ``{"op": "terminate"}`` - stop the workers: SIGTERM, SIGKILL after the grace period
* ``{"op": "kill"}`` - SIGKILL the workers now
* ``{"op": "signal", "signum": N}`` - send signal N (SIGUSR1, SIGUSR2) to every worker's
  process group, as mpirun forwards them

End of file on stdin means hvdrun or its connection is gone: the agent stops its workers.
The agent answers with one JSON event per line on stdout:

* ``{"ev": "network", "ifname": IF, "address": A}`` - the interface facing the rendezvous
* ``{"ev": "started", "rank": R, "pid": P}``
* ``{"ev": "out", "rank": R, "stream": "stdout"|"stderr", "data": TEXT, "end": T?,
  "shown": false?}`` - one whole line (or a piece of one longer than 64 KiB), and the
  terminator that followed it (``end``, when not ``\\n``; empty for a cut or an unterminated
  line); ``shown: false`` marks a ``\\n`` that completes the ``\\r`` ending the previous piece
* ``{"ev": "lines", "rank": R, "stream": "stdout"|"stderr", "data": TEXT}`` - whole lines,
  each ending in ``\n`` and none holding a ``\r``: what one read of a worker's pipe got up
  to its last ``\n``, after the start of its first line that earlier reads got (a flood of
  lines costs an event per read, not one per line; reads with a ``\r`` go as ``out``)
* ``{"ev": "exit", "rank": R, "code": C, "error": MESSAGE?}`` - 128+N for signal N
* ``{"ev": "stopped", "rank": R, "pid": P, "signum": N?, "traced": B?}`` - the worker is
  stopped: by signal N (SIGSTOP, SIGTSTP, ...), or held by a debugger (``traced``, ptrace)
* ``{"ev": "continued", "rank": R}`` - a worker reported stopped runs again
* ``{"ev": "signalled", "signum": N}`` - the agent received signal N (SIGTERM, SIGINT,
  SIGHUP) from outside hvdrun (``scancel``, a time limit, ``kill``) and stops its workers
* ``{"ev": "stopping"}`` - the answer to a terminate, at once (its workers are told to stop)
* ``{"ev": "ping"}`` - the agent is alive
* ``{"ev": "probe", ...}`` - the answer to a probe
* ``{"ev": "reached", "results": {HOST: null | WHY}}`` - the answer to a reach
* ``{"ev": "prepared", "address": A, "port": P}`` - the answer to a prepare
* ``{"ev": "done"}`` - every worker has been reported; the agent exits

Output bytes that are not UTF-8 travel as surrogate escapes and come back byte-exact.

In the code, requests and events are small dataclasses (:class:`RunRequest`, :class:`Exit`,
...), turned into lines and back only here, by :func:`encode_request`/:func:`decode_request`
and :func:`encode_event`/:func:`decode_event`; both sides dispatch on their types. An event
of a kind this side does not know (a newer agent) decodes to None and is skipped: new
kinds of events (``stopped``, ``continued``) need no new protocol version, and an older agent
simply never sends them. New fields whose absence an older side would misread do need one
(protocol 3: the ``end`` and ``shown`` of ``out``), and so do new kinds that hvdrun relies
on (protocol 4: ``stopping``, without which hvdrun takes a host for cut off; protocol 5:
``lines``, which an older hvdrun would skip, and the output with it).
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

PROTOCOL_VERSION = 5

#: The signals hvdrun passes on to the workers, as mpirun does: a job's own (Slurm's
#: ``--signal=USR1@60`` before its time limit, say). An agent that gets one itself passes
#: nothing on: Slurm signals the workers of its step too.
FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)

#: ``python -m launcher.agent --shared-stdin``: one task of an srun step, whose stdin every
#: task reads; hvdrun addresses each line (see launcher.agent.session.AddressedStdin).
SHARED_STDIN_FLAG = "--shared-stdin"
#: The last line such an agent writes, with its exit code (srun reports only failures).
EXIT_MARKER = "hvdrun-agent-exit"
#: The longest line such an agent writes, newline included: srun's ``--label`` cuts a task's
#: output into pieces of 1024 bytes and labels each as a line of its own, so a longer event
#: goes as pieces (see :func:`pieces`), joined again by :class:`Joiner`.
PIECE_BYTES = 1000
_MORE, _LAST = b"+", b"="


def pieces(line: bytes, limit: int = PIECE_BYTES) -> list[bytes]:
    """``line`` (newline-terminated) as lines of at most ``limit`` bytes: itself when short
    enough; else pieces marked ``+`` (more follow) and ``=`` (the last). An event line starts
    with ``{`` and the exit marker with ``h``, so neither reads as a piece."""
    if len(line) <= limit:
        return [line]
    body = line[:-1] if line.endswith(b"\n") else line
    size = limit - 2  # (its mark and its newline)
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    return [_MORE + chunk + b"\n" for chunk in chunks[:-1]] + [_LAST + chunks[-1] + b"\n"]


class Joiner:
    """Joins one task's pieces (see :func:`pieces`) back into its lines."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def feed(self, line: bytes) -> bytes | None:
        """The whole line ``line`` completes (itself when it is no piece), or None while
        pieces of it are still to come."""
        mark = line[:1]
        if mark == _MORE:
            self._parts.append(line[1:].rstrip(b"\r\n"))
            return None
        if mark == _LAST:
            self._parts.append(line[1:])
            whole, self._parts = b"".join(self._parts), []
            return whole
        return line


@dataclass
class WorkerLaunch:
    rank: int
    env: dict[str, str]


@dataclass
class AgentSpec:
    hostname: str
    command: list[str]
    cwd: str
    env: dict[str, str]
    workers: list[WorkerLaunch] = field(default_factory=list)
    term_grace: float = 5.0
    rendezvous_addr: str = ""
    # > 0: the agent pings every heartbeat_timeout/4 s and stops its workers when it has
    # heard nothing from hvdrun for heartbeat_timeout s (a cut network closes nothing).
    heartbeat_timeout: float = 0.0
    # > 0: the agent stops its workers after hearing nothing from hvdrun this long
    # (--heartbeat-timeout; an overloaded or stopped hvdrun is not a lost one; a closed
    # connection still counts at once); hvdrun's own check of the agent keeps
    # heartbeat_timeout, and hvdrun pings often enough for the shorter of the two.
    lost_after: float = 0.0
    # A logging level name ("DEBUG", ...): the agent logs to its stderr at that level,
    # which hvdrun shows with --verbose/--log-level. Empty: the agent stays quiet.
    log_level: str = ""
    # The addresses by which hvdrun reaches the job's other hosts: a host with several
    # interfaces gives Gloo and NCCL the one its routes to most of them use.
    peers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AgentSpec:
        raw = dict(raw)
        workers = [WorkerLaunch(**w) for w in raw.pop("workers")]
        return cls(workers=workers, **raw)


# ---- requests: hvdrun -> agent -------------------------------------------------------------


@dataclass(frozen=True)
class RunRequest:
    op: ClassVar[str] = "run"
    spec: AgentSpec


@dataclass(frozen=True)
class ProbeRequest:
    op: ClassVar[str] = "probe"
    connect_back: str | None  # ADDR:PORT of a listener on hvdrun's machine
    peers: tuple[str, ...] = ()  # the addresses of the other hosts checked
    #: Also listen on the address the host's ranks give Gloo (``gloo_listen`` in the
    #: answer) and wait for a :class:`ReachRequest`; an older agent answers without it.
    mesh: bool = False


@dataclass(frozen=True)
class ReachRequest:
    """``--check-hosts``, after a mesh probe: try a TCP connection to each other host's
    ``gloo_listen`` (``targets``: host -> ADDR:PORT), answered by :class:`Reached`."""

    op: ClassVar[str] = "reach"
    targets: dict[str, str]


@dataclass(frozen=True)
class PrepareRequest:
    """Rank 0's host picks the address and a free port for ``MASTER_ADDR``/``MASTER_PORT``:
    its address on the interface facing most of the other hosts (``peers``, the addresses
    hvdrun reaches them at), else the one facing ``rendezvous_addr``; a port free there."""

    op: ClassVar[str] = "prepare"
    rendezvous_addr: str
    peers: tuple[str, ...] = ()


@dataclass(frozen=True)
class PingRequest:
    op: ClassVar[str] = "ping"


@dataclass(frozen=True)
class TerminateRequest:
    op: ClassVar[str] = "terminate"


@dataclass(frozen=True)
class KillRequest:
    op: ClassVar[str] = "kill"


@dataclass(frozen=True)
class SignalRequest:
    """Forward a signal (SIGUSR1, SIGUSR2) to the workers; an older agent skips it."""

    signum: int
    op: ClassVar[str] = "signal"


@dataclass(frozen=True)
class UnknownRequest:
    """A request this agent does not know; what it does with one depends on when it comes."""

    op: str


Request = (
    RunRequest
    | ProbeRequest
    | ReachRequest
    | PrepareRequest
    | PingRequest
    | TerminateRequest
    | KillRequest
    | SignalRequest
    | UnknownRequest
)

_BARE_REQUESTS: dict[str, Request] = {
    request.op: request for request in (PingRequest(), TerminateRequest(), KillRequest())
}


def encode_request(request: Request) -> bytes:
    match request:
        case RunRequest(spec=spec):
            return encode({"op": request.op, "spec": spec.to_dict()})
        case ProbeRequest(connect_back=connect_back, peers=peers, mesh=mesh):
            probe = {"op": request.op, "connect_back": connect_back, "peers": list(peers)}
            return encode({**probe, "mesh": True} if mesh else probe)
        case ReachRequest(targets=targets):
            return encode({"op": request.op, "targets": targets})
        case PrepareRequest(rendezvous_addr=addr, peers=peers):
            return encode({"op": request.op, "rendezvous_addr": addr, "peers": list(peers)})
        case SignalRequest(signum=signum):
            return encode({"op": request.op, "signum": signum})
        case _:
            return encode({"op": request.op})


def _peers(raw: dict[str, Any]) -> tuple[str, ...]:
    """A request's ``peers`` (an older hvdrun sends none)."""
    return tuple(str(peer) for peer in raw.get("peers", ()))


def decode_request(line: bytes) -> Request:
    """One request line; raises ValueError for anything that is not a well-formed request."""
    raw = json.loads(line)
    if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
        raise ValueError(f"not an agent request: {line[:200]!r}")
    op = raw["op"]
    try:
        if op == "run":
            return RunRequest(AgentSpec.from_dict(raw["spec"]))
        if op == "probe":
            return ProbeRequest(raw.get("connect_back"), _peers(raw), bool(raw.get("mesh")))
        if op == "reach":
            return ReachRequest({str(h): str(a) for h, a in dict(raw["targets"]).items()})
        if op == "prepare":
            return PrepareRequest(str(raw["rendezvous_addr"]), _peers(raw))
        if op == "signal":
            return SignalRequest(int(raw["signum"]))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"malformed {op} request: {exc}") from None
    return _BARE_REQUESTS.get(op, UnknownRequest(op))


# ---- events: agent -> hvdrun ---------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The agent's first words: its protocol and the versions installed on its host."""

    protocol: int | None
    hostname: str | None = None
    pid: int | None = None
    python: str | None = None
    executable: str | None = None
    hvdrun: str | None = None
    torch: str | None = None
    # under srun: the Slurm node and task the agent runs as, and the step ("JOB.STEP")
    node: str | None = None
    task: int | None = None
    step: str | None = None

    def facts(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Network:
    """The interface (and its address) through which the host reaches the rendezvous."""

    ifname: str | None
    address: str | None


@dataclass(frozen=True)
class Prepared:
    """Where plain torch.distributed scripts meet: ``MASTER_ADDR`` and ``MASTER_PORT``."""

    address: str
    port: int


@dataclass(frozen=True)
class Started:
    rank: int
    pid: int


@dataclass(frozen=True)
class Output:
    """A line of a worker's stdout or stderr (a :class:`launcher.output.Piece`: a whole
    line, a piece of a longer one, or a lone ``\\n`` not ``shown``), its terminator apart."""

    rank: int
    stream: str  # "stdout" or "stderr"
    data: bytes
    end: bytes = b"\n"
    shown: bool = True


@dataclass(frozen=True)
class Lines:
    """Whole lines of a worker's stdout or stderr, as they were written: each ends in
    ``\n``, none holds a ``\r`` (see the module docstring's ``lines``)."""

    rank: int
    stream: str  # "stdout" or "stderr"
    data: bytes


@dataclass(frozen=True)
class Exit:
    """A worker's exit code (128+N for signal N); ``error`` when it could not be started."""

    rank: int
    code: int
    error: str | None = None


@dataclass(frozen=True)
class Stopped:
    """A worker that does not run: stopped by signal ``signum`` (SIGSTOP, SIGTSTP, SIGTTIN,
    SIGTTOU; None where the agent could not tell which), or held by a debugger (``traced``:
    a ptrace stop, as while gdb sits at its prompt)."""

    rank: int
    pid: int
    signum: int | None = None
    traced: bool = False


@dataclass(frozen=True)
class Continued:
    """A worker reported :class:`Stopped` runs again."""

    rank: int


@dataclass(frozen=True)
class Signalled:
    """The agent received ``signum`` (SIGTERM, SIGINT, SIGHUP) from outside hvdrun, which
    reached its host's workers too as a rule (Slurm signals a whole step; ``kill`` of a
    process group): it stops its workers."""

    signum: int


@dataclass(frozen=True)
class Stopping:
    """The agent got hvdrun's terminate and is stopping its workers: said at once, so that
    hvdrun tells a host that answers nothing (cut off) from one whose workers take long."""


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Probe:
    """``--check-hosts``: what the agent found out about its host."""

    facts: dict[str, Any]


@dataclass(frozen=True)
class Reached:
    """The answer to a :class:`ReachRequest`: per host, None when the connection worked,
    else why not."""

    results: dict[str, str | None]


@dataclass(frozen=True)
class Done:
    """Every worker has been reported; the agent exits."""


AgentEvent = (
    Hello
    | Network
    | Prepared
    | Started
    | Output
    | Lines
    | Exit
    | Stopped
    | Continued
    | Signalled
    | Stopping
    | Ping
    | Probe
    | Reached
    | Done
)


def encode_event(event: AgentEvent) -> bytes:
    match event:
        case Hello():
            facts = asdict(event)
            for name in ("node", "task", "step"):  # only an agent under srun has them
                if facts[name] is None:
                    del facts[name]
            return encode({"ev": "hello", **facts})
        case Network(ifname, address):
            return encode({"ev": "network", "ifname": ifname, "address": address})
        case Prepared(address, port):
            return encode({"ev": "prepared", "address": address, "port": port})
        case Started(rank, pid):
            return encode({"ev": "started", "rank": rank, "pid": pid})
        case Output(rank, stream, data, end, shown):
            out: dict[str, Any] = {
                "ev": "out",
                "rank": rank,
                "stream": stream,
                "data": text_of(data),
            }
            if end != b"\n":
                out["end"] = text_of(end)
            if not shown:
                out["shown"] = False
            return encode(out)
        case Lines(rank, stream, data):
            return encode({"ev": "lines", "rank": rank, "stream": stream, "data": text_of(data)})
        case Exit(rank, code, error):
            message: dict[str, Any] = {"ev": "exit", "rank": rank, "code": code}
            if error is not None:
                message["error"] = error
            return encode(message)
        case Stopped(rank, pid, signum, traced):
            stop: dict[str, Any] = {"ev": "stopped", "rank": rank, "pid": pid}
            if signum is not None:
                stop["signum"] = signum
            if traced:
                stop["traced"] = True
            return encode(stop)
        case Continued(rank):
            return encode({"ev": "continued", "rank": rank})
        case Signalled(signum):
            return encode({"ev": "signalled", "signum": signum})
        case Stopping():
            return encode({"ev": "stopping"})
        case Ping():
            return encode({"ev": "ping"})
        case Probe(facts):
            return encode({"ev": "probe", **facts})
        case Reached(results):
            return encode({"ev": "reached", "results": results})
        case Done():
            return encode({"ev": "done"})


def _hello(raw: dict[str, Any]) -> Hello:
    return Hello(
        protocol=raw.get("protocol"),
        hostname=raw.get("hostname"),
        pid=raw.get("pid"),
        python=raw.get("python"),
        executable=raw.get("executable"),
        hvdrun=raw.get("hvdrun"),
        torch=raw.get("torch"),
        node=raw.get("node"),
        task=raw.get("task"),
        step=raw.get("step"),
    )


_EVENT_DECODERS: dict[str, Callable[[dict[str, Any]], AgentEvent]] = {
    "hello": _hello,
    "network": lambda raw: Network(raw.get("ifname"), raw.get("address")),
    "prepared": lambda raw: Prepared(str(raw["address"]), int(raw["port"])),
    "started": lambda raw: Started(int(raw["rank"]), int(raw["pid"])),
    "out": lambda raw: Output(
        int(raw["rank"]),
        str(raw["stream"]),
        bytes_of(raw["data"]),
        bytes_of(raw.get("end", "\n")),
        bool(raw.get("shown", True)),
    ),
    "lines": lambda raw: Lines(int(raw["rank"]), str(raw["stream"]), bytes_of(raw["data"])),
    "exit": lambda raw: Exit(int(raw["rank"]), int(raw["code"]), raw.get("error")),
    "stopped": lambda raw: Stopped(
        int(raw["rank"]),
        int(raw["pid"]),
        None if raw.get("signum") is None else int(raw["signum"]),
        bool(raw.get("traced", False)),
    ),
    "continued": lambda raw: Continued(int(raw["rank"])),
    "signalled": lambda raw: Signalled(int(raw["signum"])),
    "stopping": lambda raw: Stopping(),
    "ping": lambda raw: Ping(),
    "probe": lambda raw: Probe({k: v for k, v in raw.items() if k != "ev"}),
    "reached": lambda raw: Reached(
        {str(h): None if e is None else str(e) for h, e in dict(raw["results"]).items()}
    ),
    "done": lambda raw: Done(),
}


def decode_event(line: bytes) -> AgentEvent | None:
    """One event line; None for a kind this side does not know. Raises ValueError for
    anything that is not a well-formed event."""
    raw = json.loads(line)
    if not isinstance(raw, dict) or "ev" not in raw:
        raise ValueError(f"not an agent event: {line[:200]!r}")
    decoder = _EVENT_DECODERS.get(raw["ev"])
    if decoder is None:
        return None
    try:
        return decoder(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"malformed {raw['ev']} event: {exc}") from None


# ---- lines -------------------------------------------------------------------------------


def encode(message: dict[str, Any]) -> bytes:
    """One protocol line: compact-enough JSON, ASCII only, newline-terminated."""
    return json.dumps(message, ensure_ascii=True).encode() + b"\n"


#: How the agent's hello line begins (:func:`encode_event` puts ``ev`` first).
_HELLO_START = encode({"ev": "hello"})[: -len(b"}\n")]


def find_hello(line: bytes) -> int:
    """Where the agent's hello begins in ``line``, a line read before it; -1 if it is not
    there. A login shell may print before the agent starts (``~/.bashrc``), whole lines or
    text without a newline (a terminal title's escape sequence), which then begins the
    hello's line."""
    return line.find(_HELLO_START)


def text_of(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def bytes_of(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
