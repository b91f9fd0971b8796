"""AgentConnection over a scripted transport: what precedes the agent's hello on its stdout
(a login shell's ~/.bashrc), and what hvdrun says about an agent that never started."""

from __future__ import annotations

import io
import logging
import time

import pytest

from launcher.transport.connection import AgentConnection, AgentStartError
from launcher.transport.protocol import PROTOCOL_VERSION, Hello, Ping, encode_event
from launcher.transport.remote import RemoteAgent

HELLO = encode_event(Hello(PROTOCOL_VERSION, hostname="node1", python="3.11.7"))
PYTHON = "/opt/py/bin/python"
LOADER_SAID = (
    f"{PYTHON}: error while loading shared libraries: libpython3.11.so.1.0: cannot open "
    "shared object file: No such file or directory"
)


class _Stderr(io.BytesIO):
    """The agent's stderr, each line of which reaches hvdrun's reader ``delay`` s late
    (after the agent's exit, as it may over SSH)."""

    def __init__(self, data: bytes, delay: float) -> None:
        super().__init__(data)
        self.delay = delay

    def readline(self, size: int | None = -1) -> bytes:
        time.sleep(self.delay)
        return super().readline(size)


class ScriptedAgent(AgentConnection):
    """An agent process over SSH that writes ``stdout`` and ``stderr`` (read ``delay`` s
    late) and exits with ``code``."""

    kind = "ssh"
    printed_before = RemoteAgent.printed_before

    def __init__(
        self, stdout: bytes, stderr: bytes = b"", code: int | None = 0, delay: float = 0.0
    ) -> None:
        super().__init__("node1", PYTHON, "/")
        self._stdout = io.BytesIO(stdout)
        self._stderr = _Stderr(stderr, delay)
        self._code = code

    def _open(self, deadline: float) -> tuple[io.BytesIO, _Stderr]:
        return self._stdout, self._stderr

    def _write(self, data: bytes) -> None:
        pass

    def _close_stdin(self) -> None:
        pass

    def _exit_code(self) -> int | None:
        return self._code

    def _abort(self) -> None:
        pass


def start(agent: AgentConnection) -> float:
    """Starts ``agent`` (start timeout 10 s); returns how long it took."""
    began = time.monotonic()
    agent.start(began + 10)
    return time.monotonic() - began


@pytest.mark.parametrize(
    "printed",
    [
        b"\x1b]0;node1\x07",  # a terminal title set by ~/.bashrc: no newline
        b"Welcome\n",
        b"Welcome to node1\n\nlast login: never\n\x1b]0;root@node1: ~\x07",
    ],
)
def test_what_a_login_shell_prints_before_the_hello_is_skipped(
    printed: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Never a warning, never a wait for the start timeout; --verbose shows it once."""
    agent = ScriptedAgent(printed + HELLO + encode_event(Ping()))
    with caplog.at_level(logging.INFO, logger="launcher.transport.connection"):
        took = start(agent)
        agent.wait_finished(5)
    assert took < 5
    assert agent.hello is not None and agent.hello.hostname == "node1"
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert caplog.records[0].getMessage() == (
        "the login shell on node1 printed to stdout before hvdrun's agent started "
        f"(~/.bashrc?); ignored: {printed!r}"
    )


def test_after_the_hello_a_malformed_line_is_still_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = ScriptedAgent(HELLO + b"Welcome\n" + encode_event(Ping()))
    with caplog.at_level(logging.INFO, logger="launcher.transport.connection"):
        start(agent)
        agent.wait_finished(5)
    assert [r.getMessage() for r in caplog.records] == [
        "agent on node1 wrote a malformed event: b'Welcome\\n'"
    ]
    assert caplog.records[0].levelname == "WARNING"


def test_a_python_the_loader_cannot_start_is_named_with_what_the_loader_said() -> None:
    """Exit 127 with the loader's words is not a missing Python: the message says what the
    loader said (even when its words come after the exit), and which LD_LIBRARY_PATH the
    interpreter got."""
    agent = ScriptedAgent(b"", LOADER_SAID.encode() + b"\n", code=127, delay=0.3)
    agent.interpreter_env = {"LD_LIBRARY_PATH": "/opt/py/lib:/opt/gcc/lib"}
    with pytest.raises(AgentStartError) as failed:
        start(agent)
    assert str(failed.value) == (
        f"the Python at {PYTHON} cannot start there: error while loading shared libraries: "
        "libpython3.11.so.1.0: cannot open shared object file: No such file or directory "
        "(it started with hvdrun's LD_LIBRARY_PATH=/opt/py/lib:/opt/gcc/lib: is the library "
        "in one of those directories on that host?)"
    )
    without = ScriptedAgent(b"Welcome\n", LOADER_SAID.encode() + b"\n", code=127)
    without.interpreter_env = {}
    with pytest.raises(AgentStartError, match=r"^the Python at .* cannot start there: ") as failed:
        start(without)
    assert str(failed.value).endswith(
        "(hvdrun has no LD_LIBRARY_PATH to pass on: set it to the directory that holds the "
        "library there, as a `module load` of that Python does)"
    )


def test_a_missing_python_is_still_named_as_missing() -> None:
    missing = f"sh: 1: exec: {PYTHON}: not found\n".encode()
    agent = ScriptedAgent(b"", missing, code=127, delay=0.3)
    with pytest.raises(AgentStartError) as failed:
        start(agent)
    assert str(failed.value) == (
        f"no Python at {PYTHON} there: hvdrun must be installed at the same path on every "
        "host (as with Horovod)"
    )
