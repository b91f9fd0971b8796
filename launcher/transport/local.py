"""The agent for this machine's slots, started as a local subprocess (no SSH).

The agent runs in its own session, so a Ctrl-C at the terminal reaches hvdrun alone and
hvdrun decides how the job stops. It runs in ``/`` with absolute ``PYTHONPATH`` entries, so
a directory of the user's that happens to be called ``launcher`` cannot shadow hvdrun's;
its workers still start in hvdrun's working directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import IO

import psutil

from launcher.transport.connection import AgentConnection, LineReader

AGENT_MODULE = "launcher.agent"


def agent_pythonpath(pythonpath: str | None, cwd: str) -> str | None:
    """``PYTHONPATH`` for an agent that runs in ``/``: relative entries made absolute."""
    if not pythonpath:
        return None
    entries = [os.path.join(cwd, entry) for entry in pythonpath.split(os.pathsep) if entry]
    return os.pathsep.join(entries) or None


def agent_env(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """The environment of an agent this machine starts in ``/`` (itself, or with srun)."""
    env = dict(environ)
    pythonpath = agent_pythonpath(env.pop("PYTHONPATH", None), cwd)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


class LocalAgent(AgentConnection):
    kind = "local"

    def __init__(self, hostname: str, cwd: str) -> None:
        super().__init__(hostname, sys.executable, cwd)
        self._proc: subprocess.Popen[bytes] | None = None

    def _open(self, deadline: float) -> tuple[LineReader, IO[bytes]]:
        env = agent_env(os.environ, self.cwd)
        self._proc = subprocess.Popen(
            [self.python, "-m", AGENT_MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            cwd="/",
            env=env,
        )
        assert self._proc.stdout is not None and self._proc.stderr is not None
        return self._proc.stdout, self._proc.stderr

    def _write(self, data: bytes) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def _close_stdin(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            self._proc.stdin.close()

    def _exit_code(self) -> int | None:
        assert self._proc is not None
        return self._proc.wait()

    def _abort(self) -> None:
        # Local workers can be reached directly: nothing of the job may survive a kill, not
        # even what the workers left outside their process groups (a double fork, setsid),
        # which the agent adopted (it is their subreaper) and would have ended itself had it
        # had the time: the agent's children, found before it dies and they go to init.
        proc = self._proc
        descendants: list[psutil.Process] = []
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                descendants = psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
        for pid in self.worker_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for process in descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()
        if proc is not None:
            deadline = time.monotonic() + 1.0
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
