"""The command line a remote login shell runs to start the agent (run here by a shell)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launcher.transport.connection import NO_CWD_EXIT
from launcher.transport.remote import agent_command


def run_as_login_shell(command: str) -> subprocess.CompletedProcess[bytes]:
    # what sshd does with the command: the login shell gets it after -c
    return subprocess.run(["bash", "-c", command], input=b"", capture_output=True, timeout=30)


def test_agent_starts_in_a_quoted_directory(tmp_path: Path) -> None:
    odd = tmp_path / "it's a dir; $(echo no)"
    odd.mkdir()
    result = run_as_login_shell(agent_command(sys.executable, str(odd), None))
    assert result.returncode == 0, result.stderr
    hello = json.loads(result.stdout.splitlines()[0])
    assert hello["ev"] == "hello"
    assert hello["executable"] == sys.executable


def test_missing_working_directory_is_its_own_exit_code(tmp_path: Path) -> None:
    missing = tmp_path / "not here"
    result = run_as_login_shell(agent_command(sys.executable, str(missing), None))
    assert result.returncode == NO_CWD_EXIT
    assert result.stderr.decode() == f"hvdrun: no directory {missing} on this host\n"


def test_missing_python_exits_127(tmp_path: Path) -> None:
    result = run_as_login_shell(agent_command(str(tmp_path / "python"), "/", "/a b"))
    assert result.returncode == 127


def test_no_secret_or_environment_in_the_command() -> None:
    command = agent_command("/venv/bin/python", "/work", "/src")
    assert command == (
        "exec /bin/sh -c 'if [ ! -d /work ]; then echo '\"'\"'hvdrun: no directory "
        "'\"'\"'/work'\"'\"' on this host'\"'\"' >&2; exit 200; fi; cd / && exec env "
        "PYTHONPATH=/src /venv/bin/python -m launcher.agent'"
    )
