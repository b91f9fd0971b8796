"""The agent for a remote host: ``python -m launcher.agent`` over one SSH connection.

The agent runs under the same Python path as hvdrun (hvdrun must be installed at the same
place on every host, as with Horovod), started through ``/bin/sh`` whatever the login shell
is. Its stdin, stdout and stderr are the SSH channel's: the job spec (and the secret in it)
travels on stdin, never on a command line. The command line sets only what the interpreter
needs before it can read stdin, from the job's environment, as horovodrun's ssh command line
does: ``PYTHONPATH``, and the loader's ``LD_LIBRARY_PATH`` and the like
(``connection.INTERPRETER_VARIABLES``). No pseudo-terminal is requested, so output stays
byte-exact and a dropped connection reaches the agent as end of file on stdin; what the
login shell prints on stdout before the agent starts (``~/.bashrc``) is skipped (see
``AgentConnection``).

Besides end of file, both sides exchange heartbeats (``--agent-timeout``): a cut network
closes nothing, and neither sshd nor TCP notices it for hours by default.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import time
from collections.abc import Mapping
from typing import Any

import paramiko

from launcher.transport.connection import (
    NO_CWD_EXIT,
    AgentConnection,
    AgentStartError,
    LineReader,
    interpreter_env,
)
from launcher.transport.local import AGENT_MODULE, agent_pythonpath
from launcher.transport.ssh import SSHConnector
from launcher.transport.ssh_config import SSHConnectError, SSHTarget

log = logging.getLogger(__name__)


def agent_command(python: str, cwd: str, env: Mapping[str, str]) -> str:
    """The command line sshd hands to the login shell. Of the job's environment ``env`` it
    sets only ``INTERPRETER_VARIABLES`` and ``PYTHONPATH`` (its entries absolute): the
    rest, and the secret, travel on stdin."""
    quote = shlex.quote
    settings = interpreter_env(env)
    pythonpath = agent_pythonpath(env.get("PYTHONPATH"), cwd)
    if pythonpath:
        settings["PYTHONPATH"] = pythonpath
    assignments = " ".join(quote(f"{name}={value}") for name, value in settings.items())
    env_prefix = f"env {assignments} " if assignments else ""
    script = (
        f"if [ ! -d {quote(cwd)} ]; then "
        f"echo 'hvdrun: no directory '{quote(cwd)}' on this host' >&2; exit {NO_CWD_EXIT}; fi; "
        f"cd / && exec {env_prefix}{quote(python)} -m {AGENT_MODULE}"
    )
    return f"exec /bin/sh -c {quote(script)}"


class RemoteAgent(AgentConnection):
    kind = "ssh"
    printed_before = ("the login shell", "~/.bashrc")

    def __init__(
        self,
        target: SSHTarget,
        python: str,
        cwd: str,
        env: Mapping[str, str],
        heartbeat_timeout: float,
    ) -> None:
        """``env``: the job's environment (the part its agent needs on the command line,
        see :func:`agent_command`)."""
        super().__init__(target.alias, python, cwd)
        self.target = target
        self.heartbeat_timeout = heartbeat_timeout
        self.interpreter_env = interpreter_env(env)
        self._command = agent_command(python, cwd, env)
        self._connector = SSHConnector(target)
        self._client: paramiko.SSHClient | None = None
        self._channel: paramiko.Channel | None = None
        self.local_address: str | None = None

    def current_stage(self) -> str:
        return self.stage if self._client is not None else self._connector.stage

    def _open(self, deadline: float) -> tuple[LineReader, LineReader]:
        try:
            session = self._connector.connect(deadline)
        except SSHConnectError as exc:
            raise AgentStartError(str(exc)) from None
        self._client = session.client
        self.local_address = session.local_address
        self.stage = "starting the agent over SSH"
        transport = session.client.get_transport()
        if transport is None or not transport.is_active():
            raise AgentStartError("the SSH connection closed right after login")
        try:
            channel = transport.open_session(timeout=max(deadline - time.monotonic(), 0.1))
            # (as bytes: a directory or a path variable need not be UTF-8, sshd takes bytes)
            channel.exec_command(os.fsencode(self._command))
        except Exception as exc:
            raise AgentStartError(f"cannot start the agent over SSH: {exc}") from None
        self._channel = channel
        stdout: Any = channel.makefile("rb")
        stderr: Any = channel.makefile_stderr("rb")
        return stdout, stderr

    def _write(self, data: bytes) -> None:
        assert self._channel is not None
        self._channel.sendall(data)

    def _close_stdin(self) -> None:
        if self._channel is not None:
            self._channel.shutdown_write()

    def _exit_code(self) -> int | None:
        assert self._channel is not None
        code = self._channel.recv_exit_status()
        return None if code < 0 else code

    def _stop_orphans(self, pids: list[int]) -> None:
        """The SSH connection outlives a killed agent: through it, the workers' process
        groups and sessions (each worker leads its own) are killed on the host."""
        transport = self._client.get_transport() if self._client is not None else None
        if transport is None or not transport.is_active():
            return
        groups = " ".join(str(pid) for pid in pids)
        command = (
            f"for p in {groups}; do kill -KILL -- -$p 2>/dev/null; "
            "pkill -KILL -s $p 2>/dev/null; done; true"
        )
        channel = transport.open_session(timeout=5.0)
        channel.settimeout(5.0)
        channel.exec_command(command)
        channel.recv_exit_status()
        channel.close()
        log.info("%s: killed the workers (pids %s) its lost agent left", self.hostname, groups)

    def _abort(self) -> None:
        self._connector.abort()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()

    def shutdown(self, timeout: float) -> None:
        """Closes stdin, gives the agent ``timeout`` s to finish, then drops the connection."""
        self.close()
        self.wait_finished(timeout)
        self.abort()
