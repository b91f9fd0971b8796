"""The wire protocol between hvdrun and a host's agent.

hvdrun writes one JSON line to the agent's stdin: the :class:`AgentSpec` (command, working
directory, environment, the host's ranks, and with them the job secret, which therefore never
appears in any process's argv). Closing stdin, or a ``{"op": "terminate"}`` line, tells the
agent to stop its workers. The agent answers with one JSON event per line on stdout:

* ``{"ev": "started", "rank": R, "pid": P}``
* ``{"ev": "out", "rank": R, "stream": "stdout"|"stderr", "data": TEXT}`` - one whole line
* ``{"ev": "exit", "rank": R, "code": C, "error": MESSAGE?}`` - 128+N for signal N
* ``{"ev": "done"}`` - every worker has been reported; the agent exits

Output bytes that are not UTF-8 travel as surrogate escapes and come back byte-exact.
The same protocol runs over a local pipe or an SSH channel.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


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

    def to_line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> AgentSpec:
        raw = json.loads(line)
        workers = [WorkerLaunch(**w) for w in raw.pop("workers")]
        return cls(workers=workers, **raw)


TERMINATE = b'{"op": "terminate"}\n'


def encode_event(event: dict[str, Any]) -> bytes:
    return json.dumps(event, ensure_ascii=True).encode() + b"\n"


def decode_event(line: bytes) -> dict[str, Any]:
    event = json.loads(line)
    if not isinstance(event, dict) or "ev" not in event:
        raise ValueError(f"not an agent event: {line[:200]!r}")
    return event


def text_of(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def bytes_of(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
