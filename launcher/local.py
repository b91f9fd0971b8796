"""hvdrun's handle on one host's agent, started as a local subprocess.

The agent runs in its own session, so a Ctrl-C at the terminal reaches hvdrun alone and
hvdrun decides how the job stops. Its events are parsed here and put, tagged with the host
name, on the job's event queue. Remote hosts (over SSH) use the same protocol.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import subprocess
import sys
import threading
from typing import IO, Any

from launcher.protocol import TERMINATE, AgentSpec, decode_event

log = logging.getLogger(__name__)

AGENT_COMMAND = [sys.executable, "-m", "launcher.agent"]


class LocalAgent:
    def __init__(self, spec: AgentSpec, events: queue.Queue[dict[str, Any]]) -> None:
        self.spec = spec
        self.hostname = spec.hostname
        self._events = events
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdin_lock = threading.Lock()

    def start(self) -> None:
        self._proc = subprocess.Popen(
            AGENT_COMMAND,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self._send(self.spec.to_line())
        assert self._proc.stdout is not None
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True).start()

    def _send(self, data: bytes) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        with self._stdin_lock, contextlib.suppress(BrokenPipeError, ValueError, OSError):
            self._proc.stdin.write(data)
            self._proc.stdin.flush()

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            try:
                event = decode_event(line)
            except ValueError:
                log.warning("agent on %s wrote a malformed event: %r", self.hostname, line[:200])
                continue
            event["host"] = self.hostname
            self._events.put(event)
        assert self._proc is not None
        code = self._proc.wait()
        self._events.put({"ev": "agent_exit", "host": self.hostname, "code": code})

    def terminate(self) -> None:
        """Ask the agent to stop its workers (SIGTERM, then SIGKILL after the grace period)."""
        self._send(TERMINATE)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
