"""The wire protocol between hvdrun and a host's agent (a local pipe or an SSH channel).

The agent speaks first, as soon as it starts, with one event::

    {"ev": "hello", "protocol": 1, "python": "3.11.7", "hvdrun": "0.1.0", "torch": "2.13.0", ...}

so hvdrun can refuse hosts whose installation differs before any worker starts. hvdrun then
writes one JSON line per request to the agent's stdin:

* ``{"op": "run", "spec": AgentSpec}`` - command, working directory, environment, the host's
  ranks and with them the job secret, which therefore never appears in any process's argv
* ``{"op": "probe", "connect_back": "ADDR:PORT"}`` - describe the host (``--check-hosts``)
* ``{"op": "ping"}`` - hvdrun is alive (remote hosts; see ``AgentSpec.heartbeat_timeout``)
* ``{"op": "terminate"}`` - stop the workers: SIGTERM, SIGKILL after the grace period
* ``{"op": "kill"}`` - SIGKILL the workers now

End of file on stdin means hvdrun or its connection is gone: the agent stops its workers.
The agent answers with one JSON event per line on stdout:

* ``{"ev": "network", "ifname": IF, "address": A}`` - the interface facing the rendezvous
* ``{"ev": "started", "rank": R, "pid": P}``
* ``{"ev": "out", "rank": R, "stream": "stdout"|"stderr", "data": TEXT}`` - one whole line
* ``{"ev": "exit", "rank": R, "code": C, "error": MESSAGE?}`` - 128+N for signal N
* ``{"ev": "ping"}`` - the agent is alive
* ``{"ev": "probe", ...}`` - the answer to a probe
* ``{"ev": "done"}`` - every worker has been reported; the agent exits

Output bytes that are not UTF-8 travel as surrogate escapes and come back byte-exact.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PROTOCOL_VERSION = 1


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AgentSpec:
        raw = dict(raw)
        workers = [WorkerLaunch(**w) for w in raw.pop("workers")]
        return cls(workers=workers, **raw)


def run_request(spec: AgentSpec) -> bytes:
    return encode({"op": "run", "spec": spec.to_dict()})


def probe_request(connect_back: str | None) -> bytes:
    return encode({"op": "probe", "connect_back": connect_back})


TERMINATE = b'{"op": "terminate"}\n'
KILL = b'{"op": "kill"}\n'
PING = b'{"op": "ping"}\n'


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=True).encode() + b"\n"


encode_event = encode


def decode_event(line: bytes) -> dict[str, Any]:
    event = json.loads(line)
    if not isinstance(event, dict) or "ev" not in event:
        raise ValueError(f"not an agent event: {line[:200]!r}")
    return event


def decode_request(line: bytes) -> dict[str, Any]:
    request = json.loads(line)
    if not isinstance(request, dict) or "op" not in request:
        raise ValueError(f"not an agent request: {line[:200]!r}")
    return request


def text_of(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def bytes_of(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
